"""Tasks written module-first, as a user writes them: an ``nn.Module`` factory, a dataset
and a loss.

:class:`ModuleTask` is a :class:`~learned_opt.tasks.base.Task` whose model is a plain
``nn.Module`` with PyTorch's default initialisation. Its functional face is derived from
the module with ``torch.func.functional_call`` (so it works under ``vmap`` for simulated
workers, provided the module keeps no running buffers), instead of being written twice.
The held-out evaluation tasks (:mod:`learned_opt.tasks.heldout`) are built this way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from .base import Params, Task, WorkerBatches, check_l2
from .datasets import DATASET_KINDS, Dataset
from .models import Model

__all__ = ["ModuleModel", "ModuleTask", "FullBatches"]


class ModuleModel(Model):
    """A :class:`Model` backed by an ``nn.Module`` factory.

    ``init(generator)`` builds a fresh module with the global RNG seeded from one draw of
    ``generator`` (the RNG state outside is left as it was), so parameters follow the
    module's own default initialisation and are reproducible from the generator.
    """

    def __init__(self, factory: Callable[[], nn.Module]):
        self.factory = factory
        self.template = factory()
        if any(True for _ in self.template.buffers()):
            names = [n for n, _ in self.template.named_buffers()]
            raise ValueError(
                f"module-first tasks need modules without buffers (running statistics "
                f"break the pure loss under vmap), got buffers {names}"
            )

    def param_specs(self):
        return [(k, tuple(p.shape), "module") for k, p in self.template.named_parameters()]

    def init(self, generator: torch.Generator | None, init_scale: float = 1.0) -> Params:
        if init_scale != 1.0:
            raise ValueError(
                f"module-first tasks use the module's own initialisation; got init_scale "
                f"{init_scale}, valid choice: 1.0"
            )
        seed = 0 if generator is None else int(torch.randint(0, 2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.factory()
        return {k: p.detach().clone() for k, p in module.named_parameters()}

    def apply(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.template, params, (x,))

    def module(self) -> nn.Module:
        return self.factory()


class FullBatches(WorkerBatches):
    """Full-batch "batches" for one worker: every step is the whole training set."""

    def __init__(self, task: Task, device=None):
        super().__init__(task, 0, 1, "iid", 1.0, device)
        self.batch_size = task.data.num_train

    def indices(self, step: int) -> torch.Tensor:
        return torch.arange(self.task.data.num_train)[None]


class ModuleTask(Task):
    """A task whose model is a plain ``nn.Module`` (see the module docstring).

    Args:
        name: the task's registry name; ``describe()`` returns it.
        factory: builds the module (PyTorch's default initialisation).
        data: the :class:`Dataset`; its ``kind`` picks the loss as for every task
            (cross-entropy for "classification" and "lm", mean squared error for
            "regression", whatever the target's shape).
        batch_size: examples per worker per step; ``None`` means full batch: one worker
            uses the whole training set every step, and each of ``N > 1`` workers draws
            ``num_train // N`` examples (its even share) from its own shard.
        l2: coefficient of ``0.5 * l2 * sum(w**2)`` over the weight matrices (tensors of
            rank >= 2) added to the loss (:meth:`Task.penalty`, as for every task).
        doc: one line saying what the task is.
    """

    def __init__(
        self,
        name: str,
        factory: Callable[[], nn.Module],
        data: Dataset,
        batch_size: int | None,
        l2: float = 0.0,
        doc: str = "",
    ):
        if not name or any(c.isspace() or c == "=" for c in name):
            raise ValueError(f"task name must be non-empty, without whitespace or '=': {name!r}")
        if data.kind not in set(DATASET_KINDS.values()):
            raise ValueError(f"unknown data kind {data.kind!r}")
        if batch_size is not None and not 1 <= batch_size <= data.num_train:
            raise ValueError(
                f"bad batch_size {batch_size}; valid choices: None (full batch) or 1 to "
                f"{data.num_train}"
            )
        check_l2(l2)
        self.spec = None
        self.name, self.doc, self.data, self.kind = name, doc, data, data.kind
        self.full_batch = batch_size is None
        self.batch_size = data.num_train if batch_size is None else batch_size
        self.l2 = float(l2)
        self.init_scale = 1.0
        self.model = ModuleModel(factory)
        self.num_params = self.model.num_params

    def describe(self) -> str:
        """The registry name (``get_task(task.describe())`` rebuilds the task)."""
        return self.name

    def worker_batches(
        self, seed: int = 0, num_workers: int = 1, partition: str = "iid", alpha: float = 1.0,
        device=None,
    ) -> WorkerBatches | FullBatches:  # fmt: skip
        if not self.full_batch:
            return super().worker_batches(seed, num_workers, partition, alpha, device)
        if num_workers == 1:
            return FullBatches(self, device)
        wb = WorkerBatches(self, seed, num_workers, partition, alpha, device)
        wb.batch_size = self.data.num_train // num_workers
        return wb
