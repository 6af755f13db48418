"""Shared fixtures of the meta-training tests: a one-parameter inner problem."""

from __future__ import annotations

import pytest
import torch


class OneParamQuadratic:
    """f(x) = 0.5 * a * (x - b)^2 on a scalar x, with a noisy target b per step and worker.

    A test double with the task interface that meta-training uses."""

    name = "one_param"
    kind = "quadratic"

    def __init__(self, a: float = 2.0, x0: float = 3.0):
        self.a, self.x0 = a, x0

    def describe(self) -> str:
        return f"one_param a={self.a} x0={self.x0}"

    def init(self, generator=None, device=None):
        return {"x": torch.tensor([self.x0], dtype=torch.float64)}

    def loss(self, params, batch):
        (b,) = batch
        return 0.5 * self.a * ((params["x"] - b) ** 2).sum()

    def worker_batches(self, seed, num_workers, partition, alpha, device=None):
        task = self

        class _Batches:
            def get(self, step):
                gen = torch.Generator().manual_seed(1000 * seed + step)
                return (0.1 * torch.randn(num_workers, 1, generator=gen, dtype=torch.float64),)

        del task
        return _Batches()


@pytest.fixture
def one_param_task():
    return OneParamQuadratic()
