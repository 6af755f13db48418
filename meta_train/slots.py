"""Persistent inner trajectories of meta-training: sampling, saving and restoring them.

Task augmentation (the ``augment_loss_scale`` and ``augment_init_scale`` settings): a
sampled task may have its loss multiplied by a log-uniform factor in ``[1/a, a]`` and each
of its initial parameter tensors by its own log-uniform factor in ``[1/b, b]``, drawn from
the slot's seed, so that a rule cannot key on absolute magnitudes of losses, gradients or
weights (:class:`AugmentedTask`).
"""

from __future__ import annotations

import math
import random

import torch

from learned_opt.distributed.topology import get_topology
from learned_opt.tasks import from_description

from .inner import Trajectory, new_trajectory


def log_uniform(rng: random.Random, bound: float) -> float:
    """A factor log-uniform in ``[1/bound, bound]`` (exactly 1.0 when ``bound`` is 1)."""
    if bound == 1.0:
        return 1.0
    return math.exp(rng.uniform(-math.log(bound), math.log(bound)))


class AugmentedTask:
    """``task`` with its loss times ``loss_scale`` and each initial parameter tensor times
    its own factor, log-uniform in ``[1/init_scale, init_scale]`` and drawn from
    ``init_seed``. Every other attribute is the task's own; ``describe()`` is the task's
    (the factors are saved with the slot, see :func:`serialise_slots`)."""

    def __init__(self, task, loss_scale: float = 1.0, init_scale: float = 1.0, init_seed: int = 0):
        self.task, self.loss_scale = task, float(loss_scale)
        self.init_scale, self.init_seed = float(init_scale), int(init_seed)

    def __getattr__(self, name):
        return getattr(self.task, name)

    def augmentation(self) -> dict:
        """The factors as plain data (what restoring a slot needs)."""
        return {
            "loss_scale": self.loss_scale,
            "init_scale": self.init_scale,
            "init_seed": self.init_seed,
        }

    def init(self, generator=None, device=None):
        params = self.task.init(generator, device)
        rng = random.Random(self.init_seed)
        return {k: v * log_uniform(rng, self.init_scale) for k, v in params.items()}

    def loss(self, params, batch):
        return self.loss_scale * self.task.loss(params, batch)


class SlotSampler:
    """Draws a new trajectory from a seed: a task from the family, a worker count, a
    topology valid for it, a data partition, a log-uniform length and, when the settings
    ask for them, the task's augmentation (:class:`AugmentedTask`) and the paired
    schedule on its multiplier (a ``scheduled_fraction`` of the trajectories)."""

    def __init__(self, family, settings):
        self.family, self.s = family, settings

    def sample(self, seed: int, device=None) -> Trajectory:
        s = self.s
        rng = random.Random(seed)
        task = self.family.sample(torch.Generator().manual_seed(seed))
        num_workers = rng.choice(s.worker_counts)
        topology = "ring"
        for name in rng.sample(s.topologies, len(s.topologies)):
            try:
                get_topology(name, num_workers)
            except ValueError:
                continue
            topology = name
            break
        partition = rng.choice(s.partitions)
        length = int(math.exp(rng.uniform(math.log(s.min_length), math.log(s.max_length))))
        length = max(length, s.unroll_length)
        loss_bound = float(getattr(s, "augment_loss_scale", 1.0))
        init_bound = float(getattr(s, "augment_init_scale", 1.0))
        if loss_bound != 1.0 or init_bound != 1.0:
            aug = random.Random(seed + 7_919)  # its own stream: the draws above are unchanged
            task = AugmentedTask(
                task, log_uniform(aug, loss_bound), init_bound, aug.getrandbits(31)
            )
        fraction = float(getattr(s, "scheduled_fraction", 0.0))
        # its own stream too: the draws above, and the runs of earlier stages, are unchanged
        scheduled = random.Random(seed + 104_729).random() < fraction
        return new_trajectory(
            task, num_workers, topology, partition, s.alpha, seed, length, device,
            score=s.decentralized_score, scheduled=scheduled,
        )  # fmt: skip


def _serialise(traj: Trajectory) -> dict:
    return {
        "task": traj.task.describe(),
        "augmentation": traj.task.augmentation() if isinstance(traj.task, AugmentedTask) else None,
        "num_workers": traj.num_workers,
        "topology": traj.topology,
        "partition": traj.partition,
        "alpha": traj.alpha,
        "seed": traj.seed,
        "length": traj.length,
        "score": traj.score,
        "scheduled": traj.scheduled,
        "step": traj.step,
        "loss0": traj.loss0,
        "params": traj.params.detach().cpu(),
        "states": None
        if traj.states is None
        else {k: v.detach().cpu() for k, v in traj.states.items()},
        "pes_accum": getattr(traj, "pes_accum", None),
    }


def serialise_slots(slots: list) -> list:
    """Plain-data copy of every slot's particles (for a Lightning checkpoint)."""
    return [None if slot is None else [_serialise(t) for t in slot] for slot in slots]


def restore_slots(data: list, estimator, device=None) -> list:
    """Rebuild slots saved by :func:`serialise_slots`, so a resumed run continues them."""
    slots = []
    for slot in data:
        if slot is None:
            slots.append(None)
            continue
        particles = []
        for d in slot:
            task = from_description(d["task"])
            if d.get("augmentation"):
                task = AugmentedTask(task, **d["augmentation"])
            traj = new_trajectory(
                task, d["num_workers"], d["topology"], d["partition"],
                d["alpha"], d["seed"], d["length"], device,
                score=d.get("score", "next_worker"),  # slots saved before scores existed
                scheduled=d.get("scheduled", False),  # and before schedules
            )  # fmt: skip
            traj.params = d["params"].to(device)
            if d["states"] is not None:
                traj.states = {k: v.to(device) for k, v in d["states"].items()}
            traj.step, traj.loss0 = d["step"], d["loss0"]
            traj.pes_accum = d.get("pes_accum")
            particles.append(traj)
        slots.append(particles)
    return slots
