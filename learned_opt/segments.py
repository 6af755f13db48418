"""The layout-neutral view of the learned step: elements in segments, with segment reductions.

A step works on element tensors ``[..., P]`` whose last dim concatenates the elements of
``T`` parameter tensors (segments); leading dims stack independent rows (workers, or
same-shape tensors). Per-tensor quantities are ``[..., T]``: :func:`segment_sum` and
:func:`segment_mean` reduce elements to them, :func:`segment_expand` broadcasts them back.
Every formula of :mod:`learned_opt.features` and :mod:`learned_opt.step` is written on
such a view, so the same code serves one tensor (one segment, one row) and all tensors of
a model packed into one flat vector, with workers stacked as rows.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .features import constant
from .orthogonal import is_matrix


@dataclass(frozen=True)
class FlatLayout:
    """Names, shapes and offsets of the tensors packed into a flat vector.

    ``sparse_rows``: per tensor, whether it is a row-sparse matrix (an embedding table:
    rows absent from a batch get no gradient), which takes the Adam form and is never
    orthogonalised (empty: none is)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    sparse_rows: tuple[bool, ...] = ()

    def matrices(self, cfg) -> tuple[bool, ...]:
        """Per tensor, whether it takes the orthogonalised step under ``cfg``."""
        sparse = self.sparse_rows or (False,) * len(self.shapes)
        return tuple(is_matrix(s, cfg) and not r for s, r in zip(self.shapes, sparse))

    @functools.cached_property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @functools.cached_property
    def size(self) -> int:
        return sum(self.numels)

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The segments as runs of adjacent segments of one size: ``(count, numel)`` each."""
        out: list[list[int]] = []
        for n in self.numels:
            if out and out[-1][1] == n:
                out[-1][0] += 1
            else:
                out.append([1, n])
        return tuple((k, n) for k, n in out)

    @classmethod
    def of(cls, params: dict[str, Tensor], batch_dims: int = 0) -> FlatLayout:
        """Layout of a params dict (shapes after ``batch_dims`` leading dims)."""
        return cls(tuple(params), tuple(tuple(t.shape[batch_dims:]) for t in params.values()))

    @functools.lru_cache(maxsize=8)  # noqa: B019 - layouts are few, frozen and long-lived
    def segments(self, device=None) -> Tensor:
        """Segment id of every element, ``[P]``."""
        ids = torch.arange(len(self.shapes), device=device)
        return ids.repeat_interleave(torch.tensor(self.numels, device=device))

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def padded_index(self, device=None) -> Tensor:
        """Where each element goes when every segment is padded to the longest: ``[P]``
        indices into ``T * max(numels)``."""
        longest = max(self.numels, default=0)
        seg = self.segments(device)
        return seg * longest + torch.arange(self.size, device=device) - self._starts(device)[seg]

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def blocked_index(self, block: int, device=None) -> tuple[Tensor, Tensor, int, int]:
        """Indices for summing segments in blocks of ``block`` elements, each segment
        padded to whole blocks: ``(element -> slot in nb * block, block -> slot in
        T * most_blocks, nb, most_blocks)``."""
        blocks = [-(-n // block) for n in self.numels]
        most = max(blocks, default=0)
        first = torch.tensor([0, *itertools.accumulate(blocks)][:-1], device=device)
        seg = self.segments(device)
        element = (first[seg] * block) + torch.arange(self.size, device=device)
        element -= self._starts(device)[seg]
        block_seg = torch.arange(len(blocks), device=device).repeat_interleave(
            torch.tensor(blocks, device=device)
        )
        block_slot = block_seg * most + torch.arange(sum(blocks), device=device) - first[block_seg]
        return element, block_slot, sum(blocks), most

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def lengths(self) -> Tensor:
        """Elements per segment, ``[T]`` (CPU)."""
        return torch.tensor(self.numels)

    def _starts(self, device=None) -> Tensor:
        return torch.tensor([0, *itertools.accumulate(self.numels)][:-1], device=device)

    def flatten(self, params: dict[str, Tensor], batch_dims: int = 1) -> Tensor:
        """Concatenate ``params`` (with ``batch_dims`` leading dims) into ``[..., P]``."""
        lead = next(iter(params.values())).shape[:batch_dims]
        return torch.cat([params[k].reshape(*lead, -1) for k in self.names], dim=-1)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of ``flat`` (``[..., P]``) as the original tensors."""
        lead = flat.shape[:-1]
        parts = flat.split(self.numels, dim=-1)
        return {k: t.reshape((*lead, *s)) for k, t, s in zip(self.names, parts, self.shapes)}


#: Segment sums on accelerators pad every segment to the longest while the padded size is
#: at most this many times ``P``; beyond that they sum blocks of :data:`SUM_BLOCK` first.
MAX_PADDING = 4
SUM_BLOCK = 1024
#: On CPU, one row of segments averaging at least this many elements is summed a run of
#: same-size segments at a time (``"split"``), fewer with ``index_add``: a run's sum
#: costs about 2.6 us whatever its size, ``index_add`` about 3.5 ns an element (one
#: thread; a small MLP's 6 segments of 26k elements in all: 21 us against 95 us; 40
#: segments of 528 on average: 102 us against 74 us, a segment a run).
SPLIT_MIN_MEAN = 1024


def segment_sum(x: Tensor, layout: FlatLayout, method: str | None = None) -> Tensor:
    """Sum of ``x`` (``[..., P]``) over each segment (tensor): ``[..., T]``; differentiable.

    Every method is deterministic (bitwise repeatable); all but ``"split"`` take a few
    kernels whatever the number of segments. Segments of one size (one tensor, or
    same-shape tensors) are summed by a reshape on every device. ``method``:
    ``"reduce"`` (``torch.segment_reduce`` over one row: the default on CPU for one row
    of small segments where autograd does not record the step and no compiler traces it,
    as in the optimizer's eager step: 2-3x faster than ``index_add`` there, 9 us against
    19 us for a small MLP's 6 segments of 4.9k elements, 26 us against 73 us for 40 of
    528; it has no second derivative and no inductor lowering), ``"index_add"`` (the
    default on CPU for one row of small segments otherwise, where it adds in
    order; on CUDA it adds with atomics, in a varying order), ``"split"`` (a sum per
    segment, one call for each run of adjacent segments of one size
    (:attr:`FlatLayout.runs`), the same sums as each tensor's own: the default on CPU for more than
    one row, such as the 11 feature rows, where ``index_add`` along the last dim measured
    10x slower, and for one row of segments of :data:`SPLIT_MIN_MEAN` elements or more on
    average), ``"padded"`` (scatter into
    ``[..., T, longest]`` and sum; the default on accelerators while the padding stays
    below :data:`MAX_PADDING` times ``P``) or ``"blocked"`` (segments padded to whole
    blocks, block sums, then the padded method on the block sums; the default beyond).
    """
    num, lead = len(layout.shapes), x.shape[:-1]
    if method is None and len(set(layout.numels)) <= 1:
        method = "padded"  # segments of one size: already laid out so
    if method is None and x.device.type == "cpu":
        small = math.prod(lead) <= 1 and layout.size < SPLIT_MIN_MEAN * num
        method = "split" if not small else "index_add" if num == 0 or _traced() else "reduce"
    if method == "reduce":
        if x.shape[-1] != layout.size:  # the lengths go unchecked below
            raise ValueError(f"{x.shape[-1]} elements, the layout's segments hold {layout.size}")
        sums = torch.segment_reduce(x.reshape(-1), "sum", lengths=layout.lengths(), unsafe=True)
        return sums.view(*lead, num)
    elif method is None:
        padded_size = num * max(layout.numels, default=0)
        method = "padded" if padded_size <= MAX_PADDING * max(layout.size, 1) else "blocked"
    if method == "split":
        runs = layout.runs
        parts = x.split([k * n for k, n in runs], dim=-1)
        sums = [
            part.sum(-1, keepdim=True) if k == 1 else part.reshape(*lead, k, n).sum(-1)
            for part, (k, n) in zip(parts, runs)
        ]
        return sums[0] if len(sums) == 1 else torch.cat(sums, dim=-1)
    if method == "index_add":
        return x.new_zeros(*lead, num).index_add(-1, layout.segments(x.device), x)
    if method == "padded":
        longest = max(layout.numels, default=0)
        if len(set(layout.numels)) <= 1:  # segments of one size: already laid out so
            return x.reshape(*lead, num, longest).sum(-1)
        out = x.new_zeros(*lead, num * longest).index_copy(-1, layout.padded_index(x.device), x)
        return out.view(*lead, num, longest).sum(-1)
    if method == "blocked":
        element, block_slot, blocks, most = layout.blocked_index(SUM_BLOCK, x.device)
        padded = x.new_zeros(*lead, blocks * SUM_BLOCK).index_copy(-1, element, x)
        sums = padded.view(*lead, blocks, SUM_BLOCK).sum(-1)
        out = sums.new_zeros(*lead, num * most).index_copy(-1, block_slot, sums)
        return out.view(*lead, num, most).sum(-1)
    raise ValueError(f"unknown segment_sum method {method!r}")


def _traced() -> bool:
    """Whether autograd records the step or a compiler traces it: ``"reduce"`` has neither
    a second derivative nor an inductor lowering."""
    return torch.is_grad_enabled() or torch.compiler.is_compiling()


def segment_expand(t: Tensor, layout: FlatLayout) -> Tensor:
    """Per-segment values ``t`` (``[..., T]``) repeated over each segment's elements:
    ``[..., P]`` (a view without copying when there is one segment)."""
    if len(layout.shapes) == 1:
        return t.expand(*t.shape[:-1], layout.size)
    if math.prod(t.shape[:-1]) == 1:  # one row: index_select (21 us against 58 us on CPU)
        return (
            t.reshape(-1)
            .index_select(0, layout.segments(t.device))
            .view(*t.shape[:-1], layout.size)
        )
    return t[..., layout.segments(t.device)]  # rows: index_select along dim -1 is 7x slower


def segment_mean(x: Tensor, layout: FlatLayout) -> Tensor:
    """Mean of ``x`` (``[..., P]``) over each segment (tensor): ``[..., T]``; see
    :func:`segment_sum`."""
    sizes = tuple(max(n, 1) for n in layout.numels)  # an empty segment's mean is 0
    return segment_sum(x, layout) / constant(sizes, x.dtype, x.device)


def one_segment(shape, sparse_rows: bool = False) -> FlatLayout:
    """The layout of a single tensor of ``shape`` (a row-sparse matrix if ``sparse_rows``)."""
    return FlatLayout(("tensor",), (tuple(shape),), (sparse_rows,))
