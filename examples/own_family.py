"""Meta-train the learned optimizer's constants on your own work: a family of training jobs.

A family is a callable from a seed to a job: a module, a stream of batches and a loss of a
batch (and, optionally, the steps it trains for). Here each seed draws a small teacher
network and a student MLP of drawn width and depth that regresses it: the kind of job a
user trains again and again with other sizes and data. The same seed gives the same job.

Meta-train on it (from the repository root; ``PYTHONPATH`` makes the module importable)::

    PYTHONPATH=examples learned-opt-meta fit --config es_smoke \\
        --model.family own_family:TeacherFamily --trainer.max_steps 20

then export the run's constants, and compare them with the shipped rule and with tuned
AdamW on draws meta-training never saw (seeds 0 to 15; meta-training draws from 10,000,000)::

    PYTHONPATH=examples learned-opt export \\
        runs/meta_es_smoke/lightning_logs/version_0/checkpoints/last.ckpt mine.pt
    python examples/own_family.py mine.pt --draws 16

``LearnedOptimizer(model.parameters(), checkpoint="mine.pt")`` trains with it.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

import torch
from torch import nn


class TeacherFamily:
    """Student MLPs regressing a random teacher network; sizes and noise drawn per seed."""

    def __init__(self, horizon: int = 200):
        self.horizon = horizon

    def __call__(self, seed: int):
        rng = random.Random(seed)
        dim, width = rng.choice((4, 8, 16)), rng.choice((16, 32, 64))
        depth, noise = rng.randint(1, 3), rng.choice((0.0, 0.05, 0.2))
        gen = torch.Generator().manual_seed(seed)
        teacher = torch.randn(dim, 8, generator=gen), torch.randn(8, generator=gen)
        x = torch.randn(512, dim, generator=gen)
        y = torch.tanh(x @ teacher[0]) @ teacher[1]
        y = y + noise * torch.randn(512, generator=gen)
        layers, inp = [], dim
        for _ in range(depth):  # default initialisation, seeded by the caller
            layers += [nn.Linear(inp, width), nn.ReLU()]
            inp = width
        model = nn.Sequential(*layers, nn.Linear(inp, 1))

        def batches():
            while True:
                i = torch.randint(0, 512, (32,), generator=gen)
                yield x[i], y[i]

        def loss_fn(batch):
            return nn.functional.mse_loss(model(batch[0])[:, 0], batch[1])

        return Job(model, loss_fn, batches(), self.horizon)


class Job:
    """What a family returns: the attributes the estimator reads."""

    def __init__(self, model, loss_fn, batches, horizon):
        self.model, self.loss_fn, self.batches, self.horizon = model, loss_fn, batches, horizon


ADAMW_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def curve(job, make_opt, steps: int) -> list[float]:
    """The loss before each of ``steps`` updates (``inf`` from a non-finite one on)."""
    opt, out = make_opt(job.model.parameters()), []
    for _, batch in zip(range(steps), job.batches):
        loss = job.loss_fn(batch)
        if not math.isfinite(float(loss.detach())):
            return out + [math.inf] * (steps - len(out))
        out.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


def compare(checkpoint: str, draws: int = 16) -> dict:
    """Geometric-mean step speedups of ``checkpoint`` over the shipped rule and over AdamW
    tuned per draw (its best rate of :data:`ADAMW_GRID` by final loss), on seeds
    ``0 .. draws - 1`` of the family."""
    from learned_opt import LearnedOptimizer
    from learned_opt.meta_train.evaluation import final_loss, speedup

    family = TeacherFamily()

    def run(seed, make_opt):
        torch.manual_seed(seed)  # the module's default initialisation follows the seed
        job = family(seed)
        return curve(job, make_opt, job.horizon)

    logs: dict[str, list[float]] = {"shipped rule": [], "tuned AdamW": []}
    for seed in range(draws):
        mine = run(seed, lambda p: LearnedOptimizer(p, checkpoint=checkpoint, compile=False))
        shipped = run(seed, lambda p: LearnedOptimizer(p, compile=False))
        adamw = min(
            (run(seed, lambda p, lr=lr: torch.optim.AdamW(p, lr=lr)) for lr in ADAMW_GRID),
            key=final_loss,
        )
        for name, other in (("shipped rule", shipped), ("tuned AdamW", adamw)):
            logs[name].append(math.log(min(max(speedup(mine, other), 1 / 20), 20)))
    return {name: math.exp(statistics.fmean(x)) for name, x in logs.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="a checkpoint against the shipped rule "
        "and tuned AdamW on unseen draws of TeacherFamily"
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--draws", type=int, default=16)
    args = parser.parse_args()
    for name, x in compare(args.checkpoint, args.draws).items():
        print(f"{args.checkpoint}: {x:.2f}x the steps-to-level speed of the {name}")
