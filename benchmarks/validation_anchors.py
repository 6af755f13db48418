"""Zero-tuning anchors: the optimizers a user would otherwise pick, at the settings their
own documentation recommends, on any task's plain ``(model, loss_fn, batches)``.

=====================  ==================================================================
anchor                 settings
=====================  ==================================================================
schedulefree_adamw     ``schedulefree.AdamWScheduleFree``: lr 0.0025, betas (0.9, 0.999)
                       (its defaults), warmup 5% of the run; ``train()`` before every
                       step, and the loss recorded at the ``eval()`` point (the weights a
                       user would evaluate and ship)
prodigy_constant       ``prodigyopt.Prodigy``: lr 1.0 and its other defaults, constant
prodigy_cosine         the same with cosine annealing to 0 over the run (its README's
                       recommended schedule)
muon_adamw             ``torch.optim.Muon`` (lr 0.02, momentum 0.95, Nesterov, weight
                       decay 0.01) on hidden 2-D matrices, ``torch.optim.AdamW`` (lr 3e-4,
                       betas (0.9, 0.95), weight decay 0.01) on the rest: embeddings, the
                       input layer (when there is no embedding), the output layer, biases,
                       norms, conv kernels (Keller Jordan's recipe)
=====================  ==================================================================

Every anchor except schedule-free runs through :func:`benchmarks.heldout_single.run`,
as AdamW and the learned side do; schedule-free needs its own loop (two forwards a step:
the recorded loss at the evaluation point, the gradient at the training point).
"""

from __future__ import annotations

import math
import time
from importlib.metadata import version

import torch
from torch import nn

from benchmarks import heldout_single as single
from benchmarks import rules
from learned_opt.tasks import get_task

ANCHORS = ("schedulefree_adamw", "prodigy_constant", "prodigy_cosine", "muon_adamw")
#: AdamW beside Muon (on the parameters Muon does not take).
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.01}


def versions() -> str:
    """The anchors' package versions, part of a cached anchor run's key."""
    return f"torch-{torch.__version__}+sf-{version('schedulefree')}+prodigy-{version('prodigyopt')}"


def hidden_matrices(model: nn.Module) -> list[bool]:
    """Per parameter of ``model.parameters()``: whether Muon takes it. Hidden matrices are
    the 2-D weights but those of embeddings, of the last ``nn.Linear`` (the output layer)
    and, in a model without embeddings, of the first ``nn.Linear`` (the input layer)."""
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    edges = {id(linears[-1].weight)} if linears else set()
    if linears and not embeds:
        edges.add(id(linears[0].weight))
    return [p.ndim == 2 and id(p) not in embeds | edges for p in model.parameters()]


def run_schedule_free(task_name: str, steps: int, seed: int = 0) -> list[float]:
    """Schedule-free AdamW for ``steps`` steps, the loss taken at the evaluation point, the
    gradient at the training point; as :func:`benchmarks.heldout_single.run` otherwise."""
    torch.manual_seed(seed)
    model, loss_fn, batches = get_task(task_name).workload(seed)
    opt = rules.factory("sfadamw", steps)[0](model.parameters())
    curve: list[float] = []
    for _, batch in zip(range(steps), batches):
        opt.eval()
        with torch.no_grad():
            value = float(loss_fn(batch))
        if not math.isfinite(value):
            curve += [math.inf] * (steps - len(curve))
            break
        curve.append(float(f"{value:.6g}"))
        opt.train()
        loss = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return curve


def run_anchor(task_name: str, anchor: str, steps: int, seed: int = 0) -> dict:
    """One anchor's run in a fresh job: ``{"curve", "seconds"}``. Muon's split follows a
    fresh module of the task (parameter order is the module's)."""
    if anchor not in ANCHORS:
        raise ValueError(f"unknown anchor {anchor!r}; valid choices: {ANCHORS}")
    torch.set_num_threads(1)
    start = time.perf_counter()
    if anchor == "schedulefree_adamw":
        curve = run_schedule_free(task_name, steps, seed)
    else:
        if anchor == "muon_adamw":
            hidden = hidden_matrices(get_task(task_name).module())
            make = lambda params: rules.muon_with_adamw(params, hidden, **ADAMW)  # noqa: E731
        else:
            make = rules.factory("prodigy", steps)[0]
        schedule = "cosine" if anchor == "prodigy_cosine" else "constant"
        curve = single.run(task_name, lambda params, _: make(params), steps, schedule=schedule,
                           seed=seed)  # fmt: skip
    return {"curve": curve, "seconds": round(time.perf_counter() - start, 1)}
