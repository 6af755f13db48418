"""``TaskSeedDataModule``: supplies the task-sampling seeds of every meta-step.

The seeds are a pure function of ``(seed, meta-step)``, where ``seed`` defaults to the
global seed set by ``seed_everything``; a run is therefore reproducible, and a resumed run
draws the seeds it would have drawn without the interruption.

In a data-parallel run (``--trainer.devices N``) each rank takes its own share of a meta-step's
seeds: rank ``r`` of ``N`` gets seeds ``r * count`` to ``(r + 1) * count`` of the
``N * count`` seeds of that step, so N processes with ``tasks_per_step`` each train the
tasks one process with ``N * tasks_per_step`` would.
"""

from __future__ import annotations

import itertools

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset


def step_seeds(
    seed: int, meta_step: int, count: int, rank: int = 0, world: int = 1
) -> torch.Tensor:
    """The ``count`` task seeds of ``meta_step`` for rank ``rank`` of ``world`` (int64): its
    share of the step's ``world * count`` seeds."""
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(meta_step)) % (2**63 - 1))
    every = torch.randint(0, 2**31 - 1, (count * world,), generator=gen)
    return every[rank * count : (rank + 1) * count]


class _SeedStream(IterableDataset):
    def __init__(self, seed: int, count: int, start: int, rank: int = 0, world: int = 1):
        self.seed, self.count, self.start = seed, count, start
        self.rank, self.world = rank, world

    def __iter__(self):
        for step in itertools.count(self.start):
            yield step_seeds(self.seed, step, self.count, self.rank, self.world)


class _Once(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1)


class TaskSeedDataModule(L.LightningDataModule):
    """Training batches are the task seeds of one meta-step; validation is one item.

    Args:
        seed: base seed; None takes the global seed (``seed_everything``).
        tasks_per_step: seeds per meta-step; ``learned-opt-meta`` sets it from the
            model's ``tasks_per_step`` (it is not a config field of its own).
    """

    def __init__(self, seed: int | None = None, tasks_per_step: int = 4):
        super().__init__()
        if tasks_per_step < 1:
            raise ValueError(f"data field 'tasks_per_step' must be >= 1, got {tasks_per_step}")
        self.seed, self.tasks_per_step = seed, tasks_per_step

    def _base_seed(self) -> int:
        return int(self.seed) if self.seed is not None else int(torch.initial_seed()) % (2**31)

    def train_dataloader(self):
        trainer = self.trainer
        start = int(trainer.global_step) if trainer is not None else 0
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        stream = _SeedStream(self._base_seed(), self.tasks_per_step, start, rank, world)
        return DataLoader(stream, batch_size=None, num_workers=0)

    def val_dataloader(self):
        return DataLoader(_Once(), batch_size=None, num_workers=0)
