"""Robust mixing's distances, compiled: one pass over each tensor.

Before it mixes, robust mixing (``robust="clip"``, :mod:`.mixing`) needs ``||x_j - x||``
for every tensor ``x`` and every neighbour ``j``. Eagerly
(:func:`~.mixing.distance_lists`) each distance subtracts into a temporary and then takes
its norm. That reads the neighbour's copy and ``x``, writes the difference and reads it
again, and it first converts a bfloat16 neighbour (shared moments) to float32. Compiled
ahead of time, the same distances read each tensor once.

The kernels are built by the step's compile worker (:mod:`learned_opt.kernel`, recipe
:data:`DISTANCES`). That means a child process at low priority, one build per host and
user, and packages in :func:`~learned_opt.kernel.kernel_dir`. They follow the step's
policy too: a kind (its tensors' shapes, dtypes and strides, the number of neighbours,
the thread count) is computed eagerly until it has run
:data:`~learned_opt.kernel.COMPILE_AFTER` times and the communicator's eager distances
have taken :data:`~learned_opt.kernel.COMPILE_AFTER_SECONDS` (at once where its package
is on disk), then built in the background, never waited for. Kernels are built for CPU
tensors only (:data:`~learned_opt.kernel.KERNEL_DEVICES`).

Measured by ``benchmarks/robust_cost.py`` (in git at ``c2adf13``); ``benchmarks/gossip_step.py``
times robust mixing on real workers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from learned_opt.kernel import (
    KernelCache,
    Recipe,
    export_package,
    kernel_threads,
    load_runner,
    package_file,
    register,
    source_digest,
)

from .mixing import distance_lists


class _Distances(torch.nn.Module):
    """The module that is exported: the flat list of :func:`flat_inputs` (``count``
    tensors, then ``neighbours`` copies of each, neighbour by neighbour) to the ``[D, T]``
    distances, in float32 (float64 where a tensor is)."""

    def __init__(self, count: int, neighbours: int):
        super().__init__()
        self.count, self.neighbours = count, neighbours

    def forward(self, tensors: list[Tensor]) -> Tensor:
        t_count = self.count
        xs = tensors[:t_count]
        wide = any(t.dtype == torch.float64 for t in tensors)
        dtype = torch.float64 if wide else torch.float32
        squares = [
            (tensors[t_count * (1 + j) + t].to(dtype) - xs[t].to(dtype)).square().sum()
            for j in range(self.neighbours)
            for t in range(t_count)
        ]
        return torch.stack(squares).view(self.neighbours, t_count).sqrt()


def flat_inputs(xs: Sequence[Tensor], neighbor_xs: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """A kernel's inputs: the tensors ``xs``, then each neighbour's copy of all of them
    (``neighbor_xs[t][j]``, as :func:`~.mixing.distance_lists` takes them)."""
    neighbours = len(neighbor_xs[0])
    return list(xs) + [nbs[j] for j in range(neighbours) for nbs in neighbor_xs]


def _signature(xs, neighbor_xs) -> tuple:
    """The kind of a set of distances: the tensors' devices, dtypes, shapes and strides,
    and torch's thread count (a kernel is built for them and checks none)."""
    return (
        tuple((t.device, t.dtype, tuple(t.shape), t.stride()) for t in xs),
        tuple(tuple((t.dtype, tuple(t.shape), t.stride()) for t in nbs) for nbs in neighbor_xs),
        kernel_threads(),
    )


def _copy(args: tuple) -> tuple:
    xs, neighbor_xs = args
    return [x.detach().clone() for x in xs], [[t.clone() for t in nbs] for nbs in neighbor_xs]


def _payload(args: tuple) -> dict:
    xs, neighbor_xs = args
    return {"xs": list(xs), "neighbours": [list(nbs) for nbs in neighbor_xs]}


def _build(build: dict, path: Path) -> None:
    xs, neighbor_xs = build["xs"], build["neighbours"]
    with torch.no_grad():
        module = _Distances(len(xs), len(neighbor_xs[0]))
        export_package(module, flat_inputs(xs, neighbor_xs), path)


def package_path(args: tuple) -> Path:
    """The package file of the distances of ``args`` (``(xs, neighbor_xs)``)."""
    return package_file(("distances", _signature(*args)), source_digest(Path(__file__).parent))


def _load(path: Path):
    run = load_runner(path)

    def kernel(xs, neighbor_xs) -> Tensor:
        return run(flat_inputs(xs, neighbor_xs))[0]

    return kernel


#: The distances' kernels, built by the step's compile worker.
DISTANCES = register(
    Recipe(
        "distances",
        __name__,
        ("robust mixing's distances", "its mixes keep the eager distances"),
        _copy,
        _payload,
        _build,
        package_path,
        _load,
    )
)


class Distances(KernelCache):
    """One communicator's robust-mixing distances (:func:`~.mixing.distance_lists`):
    eager until the kernel of their kind is built, then compiled (see the module); the
    same values, up to float32 rounding (non-finite where a neighbour sent NaN or Inf)."""

    def __call__(self, xs: Sequence[Tensor], neighbor_xs: Sequence[Sequence[Tensor]]) -> Tensor:
        """``[D, T]``: the distance of neighbour ``j``'s copy of tensor ``t`` to ``xs[t]``
        (``neighbor_xs[t][j]``; every tensor has the same ``D`` neighbours)."""
        if not xs or not neighbor_xs[0] or not all(map(self.compiles, {x.device for x in xs})):
            return distance_lists(xs, neighbor_xs)
        entry = self._entry(_signature(xs, neighbor_xs))
        if entry.fn is not None:
            with torch.no_grad():
                return entry.fn(xs, neighbor_xs)
        start = time.perf_counter()
        dist = distance_lists(xs, neighbor_xs)
        self.eager_seconds += time.perf_counter() - start
        self._queue_if_due(entry, lambda: (xs, neighbor_xs), DISTANCES)
        return dist
