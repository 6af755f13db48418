"""Worker functions for the shared outer step on real gloo ranks (importable by spawned
processes): the torchrun entry's ``--outer-step``, ``OuterStep`` against the simulator on a
toy problem, and ``GossipStrategy(outer_step=...)``."""

from __future__ import annotations

import dist_workers as w
import lightning_workers as lw
import torch

from learned_opt.distributed.lightning import GossipStrategy
from learned_opt.distributed.outer import OuterStep, outer_rule
from learned_opt.distributed.train import launched

TOY_STEPS, TOY_H, TOY_SPEC = 11, 3, "topk:0.2:4"  # 3 rounds, then a shorter one (flush)


def toy_start() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(40, generator=gen), torch.randn(3, 5, generator=gen)]


def toy_targets(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank + 1)
    return [torch.randn(40, generator=gen), torch.randn(3, 5, generator=gen)]


def toy_local_step(params: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """A local step on rank's own quadratic, in place."""
    for p, t in zip(params, targets):
        p.sub_(0.2 * (p - t))


def toy(rank: int, world: int, rule: str) -> dict:
    params, targets = toy_start(), toy_targets(rank)
    factory, decay = outer_rule(rule)
    rounds = OuterStep(params, factory, local_steps=TOY_H, rank=rank, world_size=world,
                       compression=TOY_SPEC, decay=decay)  # fmt: skip
    for _ in range(TOY_STEPS):
        toy_local_step(params, targets)
        rounds.step()
    flushed = rounds.flush()
    return {"params": [p.clone() for p in params], "bytes_sent": rounds.bytes_sent,
            "rounds": rounds.rounds, "flushed": flushed}  # fmt: skip


def lightning_run(rank: int, world: int, root: str, batches: int = 7) -> dict:
    strategy = GossipStrategy(timeout=120, outer_step="demo", average_at_end=False,
                              outer_kwargs={"local_steps": 3})  # fmt: skip
    model = lw.Digits(optimizer="adam")
    before = [p.detach().clone() for p in model.parameters()]
    run = lw.trainer(f"{root}/outer", world, 1, strategy=strategy)
    run.fit(model, lw.loader(rank, world, batches))
    rounds = next(iter(strategy.rounds.values()))
    return {"params": [p.detach().clone() for p in model.parameters()], "before": before,
            "rounds": rounds.rounds, "bytes_sent": rounds.bytes_sent}  # fmt: skip


def outer_suite(rank: int, world: int, root: str) -> dict:
    """Every check on one set of ranks (starting them is the slow part)."""
    argv = ["--task", "iris_mlp", "--steps", "10", "--optimizer", "adam", "--local-steps", "4",
            "--timeout", str(w.COLLECTIVE_TIMEOUT)]  # fmt: skip
    return {
        "entry": launched(rank, world, [*argv, "--outer-step", "nesterov"]),
        "exact": launched(rank, world, argv[:6] + argv[8:]),
        "toy": {rule: toy(rank, world, rule) for rule in ("nesterov", "demo")},
        "lightning": lightning_run(rank, world, root),
    }
