"""Persistent inner trajectories of meta-training: sampling, saving and restoring them."""

from __future__ import annotations

import math
import random

import torch

from learned_opt.distributed.topology import get_topology
from learned_opt.tasks import from_description

from .inner import Trajectory, new_trajectory


class SlotSampler:
    """Draws a new trajectory from a seed: a task from the family, a worker count, a
    topology valid for it, a data partition and a log-uniform length."""

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
        return new_trajectory(
            task, num_workers, topology, partition, s.alpha, seed, length, device,
            score=s.decentralized_score,
        )  # fmt: skip


def _serialise(traj: Trajectory) -> dict:
    return {
        "task": traj.task.describe(),
        "num_workers": traj.num_workers,
        "topology": traj.topology,
        "partition": traj.partition,
        "alpha": traj.alpha,
        "seed": traj.seed,
        "length": traj.length,
        "score": traj.score,
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
            traj = new_trajectory(
                from_description(d["task"]), d["num_workers"], d["topology"], d["partition"],
                d["alpha"], d["seed"], d["length"], device,
                score=d.get("score", "next_worker"),  # slots saved before scores existed
            )  # fmt: skip
            traj.params = d["params"].to(device)
            if d["states"] is not None:
                traj.states = {k: v.to(device) for k, v in d["states"].items()}
            traj.step, traj.loss0 = d["step"], d["loss0"]
            traj.pes_accum = d.get("pes_accum")
            particles.append(traj)
        slots.append(particles)
    return slots
