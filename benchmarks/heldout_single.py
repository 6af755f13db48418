"""Single-worker runs of the held-out suite: any ``torch.optim`` optimizer on a task's
plain ``(model, loss_fn, batches)``, the AdamW tuning grid, and side-by-side step timing.

A *learned side* is a string: a checkpoint (a shipped name or a file path), or an
optimizer factory ``module:function``, a callable ``(params, lr_mult) -> Optimizer``.
"""

from __future__ import annotations

import functools
import importlib
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import rules
from learned_opt import LearnedOptimizer, load_checkpoint, wsd_schedule
from learned_opt.kernel import compile_after_seconds
from learned_opt.meta_train.evaluation import final_loss
from learned_opt.tasks import get_task

Factory = Callable[..., torch.optim.Optimizer]  # (params, lr_mult) -> optimizer
SCHEDULES = ("constant", "cosine")
#: The schedules a rule may run under (``--schedule``): the baselines' and
#: :func:`learned_opt.wsd_schedule`'s.
WSD_DECAY = {"wsd": 0.2, "wsd_half": 0.5}  # decay_fraction of each wsd schedule
RULE_SCHEDULES = (*SCHEDULES, *WSD_DECAY)
#: AdamW's learning-rate grid (6 points, half-decades); extended at an edge when the best
#: rate sits there. ``QUICK_GRID`` is the --quick subset.
ADAMW_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
QUICK_GRID = (1e-3, 3e-3, 1e-2)
#: Learning-rate multipliers of the learned side: the default and the robustness pair.
LR_MULTS = (1.0, 0.3, 3.0)


def is_factory(side: str) -> bool:
    """Whether a learned side names a ``module:function`` factory rather than a checkpoint."""
    return ":" in side and not Path(side).exists()


def _checkpoint_factory(checkpoint: str, params, lr_mult: float) -> torch.optim.Optimizer:
    return LearnedOptimizer(params, checkpoint=checkpoint, lr=lr_mult)


def resolve_side(side: str) -> Factory:
    """The optimizer factory ``(params, lr_mult) -> Optimizer`` of a learned side.

    Raises ``ValueError`` for a factory that cannot be imported or is not callable, and
    :class:`learned_opt.CheckpointError` for a checkpoint that cannot be loaded.
    """
    if not is_factory(side):
        load_checkpoint(side)  # fail early, naming the file and the problem
        return functools.partial(_checkpoint_factory, side)
    module_name, _, attr = side.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"optimizer factory {side!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"optimizer factory {side!r} is not callable")
    return fn


def shipped_default(params, lr_mult: float = 1.0) -> torch.optim.Optimizer:
    """The shipped single-worker rule as a factory (``--factory
    benchmarks.heldout_single:shipped_default``): single-worker only, so a run of it tunes
    no decentralized baseline."""
    return LearnedOptimizer(params, lr=lr_mult)


def adamw(lr: float) -> Factory:
    """AdamW at ``lr`` (torch's defaults otherwise) as a factory ignoring the multiplier."""
    return lambda params, lr_mult=1.0: torch.optim.AdamW(params, lr=lr * lr_mult)


def run(task_name: str, factory: Factory, steps: int, *, lr_mult: float = 1.0,
        schedule: str = "constant", seed: int = 0,
        clock: list[float] | None = None) -> list[float]:  # fmt: skip
    """Train the task's workload for ``steps`` steps; the per-step training loss curve (the
    rest ``inf`` after a non-finite loss). ``clock``, if given, receives the seconds from
    the optimizer's construction to the end of each step."""
    if schedule not in RULE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid choices: {RULE_SCHEDULES}")
    torch.manual_seed(seed)
    model, loss_fn, batches = get_task(task_name).workload(seed)
    start = time.perf_counter()
    opt = factory(model.parameters(), lr_mult)
    sched = None
    if schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    elif schedule in WSD_DECAY:
        sched = wsd_schedule(opt, steps, decay_fraction=WSD_DECAY[schedule])
    return rules.train(opt, sched, loss_fn, batches, steps, clock, start)


def run_job(task_name: str, side: str | None, steps: int, *, lr: float = 1.0,
            schedule: str = "constant", seed: int = 0) -> dict:  # fmt: skip
    """One run in a fresh job: AdamW at ``lr`` (``side`` None) or a learned side at the
    multiplier ``lr``."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    factory = adamw(lr) if side is None else resolve_side(side)
    mult = 1.0 if side is None else lr
    curve = run(task_name, factory, steps, lr_mult=mult, schedule=schedule, seed=seed)
    return {"curve": curve, "seconds": round(time.perf_counter() - start, 1)}


def timing_job(task_name: str, side: str, steps: int = 20, seed: int = 0) -> dict:
    """Step time of a learned side side by side with AdamW's (:func:`time_side_by_side`)."""
    torch.set_num_threads(1)
    factories = {"adamw": adamw(1e-3), "learned": resolve_side(side)}
    return {"ms_per_step": time_side_by_side(task_name, factories, steps, seed)}


def time_side_by_side(task_name: str, factories: dict[str, Factory], steps: int = 20,
                      seed: int = 0, warmup: int = 3) -> dict[str, float]:  # fmt: skip
    """Median wall-clock ms of one full training step per optimizer, the optimizers taking
    turns step by step on their own copies of the model with the same batches. A learned
    optimizer is timed once its kernel is compiled (the warm-up steps queue the compile)."""
    jobs = {}
    for name, factory in factories.items():
        model, loss_fn, batches = get_task(task_name).workload(seed)
        jobs[name] = (loss_fn, batches, factory(model.parameters(), 1.0), [])
    with compile_after_seconds(0):  # the warm-up steps queue the compile at once
        for i in range(warmup + steps):
            if i == warmup:
                for _, _, opt, _ in jobs.values():
                    if hasattr(opt, "wait_compiled"):
                        opt.wait_compiled(timeout=1800)
            for loss_fn, batches, opt, times in jobs.values():
                batch = next(batches)
                t0 = time.perf_counter()
                loss = loss_fn(batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(job[3]) for name, job in jobs.items()}


def best_adamw(runs: dict[str, list[float]], horizon: int) -> dict | None:
    """The best AdamW run at ``horizon`` by final smoothed loss, from runs keyed
    ``"<schedule>|<lr>|<steps>"``: constant runs of at least ``horizon`` steps are cut
    to it, cosine runs count only at exactly ``horizon`` steps."""
    candidates = {}
    for key, curve in runs.items():
        schedule, lr, steps = key.split("|")
        if (schedule == "constant" and int(steps) >= horizon) or int(steps) == horizon:
            candidates[(schedule, float(lr))] = curve[:horizon]
    if not candidates:
        return None
    (schedule, lr), curve = min(candidates.items(), key=lambda kv: final_loss(kv[1]))
    finals = {f"{s}|{r:g}": final_loss(c) for (s, r), c in sorted(candidates.items())}
    return {"lr": lr, "schedule": schedule, "curve": curve, "final": final_loss(curve),
            "grid": finals}  # fmt: skip


def edge_extension(best: dict, lrs: list[float], ladder=ADAMW_GRID) -> float | None:
    """The next learning rate to try when the best one sits at an edge of ``lrs``: the next
    rate of ``ladder`` (the full grid) beyond it, else a factor sqrt(10) beyond."""
    lrs = sorted(lrs)
    if best["lr"] == lrs[-1]:
        beyond = [x for x in ladder if x > lrs[-1]]
        return min(beyond) if beyond else float(f"{lrs[-1] * math.sqrt(10):.3g}")
    if best["lr"] == lrs[0]:
        beyond = [x for x in ladder if x < lrs[0]]
        return max(beyond) if beyond else float(f"{lrs[0] / math.sqrt(10):.3g}")
    return None
