"""Meta-train the learned optimizer's constants on your own work: a family of training jobs.

A family is a callable from a seed to a job: a module, a stream of batches and a loss of a
batch (and, optionally, the steps it trains for). Here each seed draws a small teacher
network and a student MLP of drawn width and depth that regresses it: the kind of job a
user trains again and again with other sizes and data. The same seed gives the same job.

Meta-train on it (from the repository root; ``PYTHONPATH`` makes the module importable)::

    PYTHONPATH=examples learned-opt-meta fit --config es_smoke \\
        --model.family own_family:TeacherFamily --trainer.max_steps 20

then export the run's constants and use them::

    learned-opt export runs/meta_es_smoke/lightning_logs/version_0/checkpoints/last.ckpt mine.pt
    python -c "import torch; from learned_opt import LearnedOptimizer; \\
        LearnedOptimizer(torch.nn.Linear(2, 2).parameters(), checkpoint='mine.pt')"
"""

from __future__ import annotations

import random

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
