"""Families of whole training jobs for the evolution-strategies estimator: the task
distribution, or a family a user writes, named by class path.

A family is a callable from a seed to a job: an ``nn.Module``, a stream of batches and a
loss of a batch, optionally with the steps the job trains for (``horizon``). It returns an
object with the attributes ``model``, ``loss_fn``, ``batches`` (and ``horizon``), as
:func:`learned_opt.tasks.distribution.build` does, or a tuple ``(model, batches, loss_fn)``.
``model.family`` names it by class path, jsonargparse style (``my_pkg.tasks:MyFamily`` or
``my_pkg.tasks.MyFamily``): a class is instantiated without arguments, a function is called
as it is. The same seed must give the same job; the family is called with torch's global
generator seeded from the seed (and restored afterwards), so a module's default
initialisation follows the seed.

    class MyFamily:
        def __call__(self, seed):
            gen = torch.Generator().manual_seed(seed)
            model = torch.nn.Linear(8, 1)
            x = torch.randn(256, 8, generator=gen)
            y = x @ torch.randn(8, generator=gen)

            def batches():
                while True:
                    i = torch.randint(0, 256, (32,), generator=gen)
                    yield x[i], y[i]

            loss = lambda batch: ((model(batch[0])[:, 0] - batch[1]) ** 2).mean()
            return model, batches(), loss
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

#: ``model.family`` for the task distribution (:mod:`learned_opt.tasks.distribution`).
DISTRIBUTION = "distribution"


@dataclass
class FamilyJob:
    """One job of a family: ``loss_fn(next(batches))`` is the loss of ``model``."""

    model: nn.Module
    loss_fn: Callable
    batches: Iterator
    horizon: int | None = None  # the job's own training steps (None: the estimator's cap)
    kind: str = "user"  # what the job is, for the logs (the distribution's kind)


def is_class_path(name: str) -> bool:
    """Whether ``name`` is a class path (``pkg.mod:Name`` or ``pkg.mod.Name``)."""
    return ":" in name or "." in name


def import_object(path: str):
    """The object a class path names; a one-line ``ValueError`` if it cannot be imported."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"family {path!r}: expected a class path such as my_pkg.tasks:MyFamily")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"family {path!r} cannot be imported: {exc}") from None
    return obj


def user_family(path: str) -> Callable[[int], FamilyJob]:
    """The family a class path names, as ``seed -> FamilyJob``."""
    obj = import_object(path)
    family = obj() if isinstance(obj, type) else obj
    if not callable(family):
        raise ValueError(f"family {path!r}: {type(family).__name__} is not callable on a seed")

    def make(seed: int) -> FamilyJob:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            job = family(seed)
        return as_job(job, path)

    return make


def as_job(job, name: str = "family") -> FamilyJob:
    """A family's return value as a :class:`FamilyJob`."""
    if isinstance(job, FamilyJob):
        return job
    if isinstance(job, tuple):
        if len(job) != 3:
            raise ValueError(f"{name}: a job tuple is (model, batches, loss_fn), got {len(job)}")
        model, batches, loss_fn = job
        return FamilyJob(model, loss_fn, iter(batches))
    try:
        return FamilyJob(
            job.model, job.loss_fn, iter(job.batches), getattr(job, "horizon", None),
            getattr(job, "kind", "user"),
        )  # fmt: skip
    except AttributeError as exc:
        raise ValueError(
            f"{name}: a job needs model, loss_fn and batches, or is (model, batches, loss_fn): "
            f"{exc}"
        ) from None


def distribution_family(kinds: list[str] | None = None) -> Callable[[int], FamilyJob]:
    """The task distribution as ``seed -> FamilyJob`` (its kinds limited to ``kinds``)."""
    from learned_opt.tasks.distribution import build, draw

    pool = tuple(kinds) if kinds else None

    def make(seed: int) -> FamilyJob:
        spec = draw(seed, pool)
        job = build(spec)
        return FamilyJob(job.model, job.loss_fn, job.batches, spec.horizon, spec.kind)

    return make


def resolve_family(name: str, kinds: list[str] | None = None) -> Callable[[int], FamilyJob]:
    """``seed -> FamilyJob`` for ``model.family``: ``"distribution"`` or a class path."""
    if name == DISTRIBUTION:
        return distribution_family(kinds)
    if is_class_path(name):
        return user_family(name)
    raise ValueError(
        f"family {name!r}: the es estimator trains on {DISTRIBUTION!r} or on a family given "
        "by class path (my_pkg.tasks:MyFamily)"
    )
