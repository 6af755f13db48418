"""Exact averages over all ranks: gradient all-reduce (plain data parallel) and model averaging.

``all_reduce_mean_`` is the one place where tensors are replaced by their mean over the
ranks. The torchrun entry point uses it to average gradients (``--mixing allreduce``) and
the Lightning strategy uses it for gradients, for the averaged model it validates and
checkpoints, and for the model every rank holds when training ends.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-reduce of ``nbytes`` bytes."""
    return 2 * (world_size - 1) * nbytes // world_size


@torch.no_grad()
def all_reduce_mean_(tensors: Iterable[Tensor], communicator, step: int, what: str) -> int:
    """Replace every tensor by its mean over the ranks, in place.

    Tensors are packed into one flat buffer per dtype (so a tensor listed twice, such as a
    tied weight, is averaged once) and summed with ``communicator.all_reduce`` (which has
    the communicator's timeout; ``what`` names the collective in its error). Returns the
    bytes a ring all-reduce sends per worker.
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    sent = 0
    for members in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        communicator.all_reduce(flat, step, what)
        world = communicator.world_size  # after the sum: a failure may have re-formed the group
        flat.div_(world)
        offset = 0
        for t in members:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        sent += ring_all_reduce_bytes(flat.numel() * flat.element_size(), world)
    return sent
