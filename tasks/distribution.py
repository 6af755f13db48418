"""The task distribution: whole training jobs drawn from a seed.

``draw(seed)`` returns a :class:`JobSpec`, plain data that names the kind of model and every
drawn choice (width, depth, data, batch size, horizon, initialisation scale, loss);
``build(spec)`` turns it into a :class:`Job`: an ``nn.Module``, a loss of a batch and an
endless batch stream, the way a user writes a training job. The same seed gives the same job.

Kinds (:data:`KINDS`) are drawn uniformly; within a kind every choice is drawn. Horizons run
from 100 to 5000 steps, most of them short (60 % up to 500, 30 % up to 2000). The held-out
suite (:mod:`learned_opt.tasks.heldout`) is not part of this distribution.

Seeds are a shared resource: the reporting draw, every decision and meta-training take
disjoint ranges of them (see ``benchmarks/decide.py`` and its ledger), so no choice is made on
jobs it is later measured on.

    >>> spec = draw(7)
    >>> job = build(spec)
    >>> loss = job.loss_fn(next(job.batches))
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .kinds import KINDS, horizon, lm_loss, log_uniform

__all__ = ["KINDS", "Job", "JobSpec", "build", "draw", "from_description"]


@dataclass(frozen=True)
class JobSpec:
    """Everything that defines a drawn job; equal specs build identical jobs."""

    seed: int  # the draw's seed: options, data, initialisation and batches follow from it
    kind: str  # one of KINDS
    horizon: int  # training steps
    batch_size: int  # examples per step; 0 is the full batch
    init_scale: float  # multiplies every initial weight of rank >= 2
    options: tuple[tuple[str, object], ...]  # the kind's drawn choices, sorted by name

    def option(self, name: str):
        return dict(self.options)[name]

    def describe(self) -> str:
        """One line of ``key=value`` fields that :func:`from_description` parses back."""
        head = f"seed={self.seed} kind={self.kind} horizon={self.horizon} "
        head += f"batch={self.batch_size} init={self.init_scale:g}"
        return " ".join([head] + [f"{k}={_fmt(v)}" for k, v in self.options])


def _fmt(v) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


@dataclass
class Job:
    """A drawn training job: ``loss_fn(next(batches))`` is the loss of ``model``."""

    spec: JobSpec
    model: nn.Module
    loss_fn: Callable[[tuple], torch.Tensor]
    batches: Iterator[tuple]


# ----------------------------------------------------------------------------- draw and build
def draw(seed: int, kinds: tuple[str, ...] | None = None) -> JobSpec:
    """The job of ``seed``: its kind drawn uniformly from ``kinds`` (default every kind)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"a draw's seed must be an int >= 0, got {seed!r}")
    pool = tuple(kinds or KINDS)
    unknown = sorted(set(pool) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; valid kinds: {sorted(KINDS)}")
    rng = random.Random(f"learned-opt/draw/{seed}")
    kind = rng.choice(pool)
    options, batch_size = KINDS[kind][0](rng)
    init_scale = 1.0 if rng.random() < 0.5 else round(log_uniform(rng, 0.5, 2.0), 3)
    return JobSpec(seed, kind, horizon(rng), batch_size, init_scale, tuple(sorted(options.items())))


def build(spec: JobSpec) -> Job:
    """The job a spec describes: model initialised, data generated, batches seeded."""
    if spec.kind not in KINDS:
        raise ValueError(f"unknown kind {spec.kind!r}; valid kinds: {sorted(KINDS)}")
    r = np.random.default_rng([spec.seed, 1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model, loss, source = KINDS[spec.kind][1](dict(spec.options), r)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(spec.init_scale)
    loss = loss or lm_loss

    def batches():
        gen = torch.Generator().manual_seed(spec.seed)
        while True:
            yield source(gen, spec.batch_size)

    return Job(spec, model, lambda batch: loss(model, batch), batches())


def from_description(line: str) -> JobSpec:
    """The spec that ``spec.describe()`` printed: the draw of its seed, checked field by field."""
    fields = dict(token.partition("=")[::2] for token in line.split())
    if "seed" not in fields:
        raise ValueError(f"job description lacks seed: {line!r}")
    spec = draw(int(fields["seed"]))
    if spec.kind != fields.get("kind"):  # drawn from a subset of the kinds
        spec = draw(spec.seed, (fields.get("kind", ""),))
    if spec.describe() != line.strip():
        raise ValueError(f"job description does not match the draw of its seed: {line!r}")
    return spec


def replace_horizon(spec: JobSpec, horizon: int) -> JobSpec:
    """The same job trained for ``horizon`` steps."""
    return dataclasses.replace(spec, horizon=horizon)
