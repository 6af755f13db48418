"""The reference's fast path on CPU: :func:`step_tensors` steps a list of tensors in place.

Eagerly it packs the small tensors into one flat vector (:class:`_Pack`, whose flat state is
kept between steps) and steps the tensors of one shape as the rows of one call
(:func:`_step_stacked`); traced for a kernel (:mod:`.export`) it is :func:`_step_stacked` of
one tensor. Every tensor takes :func:`~learned_opt.step.tensor_step`'s step.
"""

from __future__ import annotations

import itertools
import sys

import torch
from torch import Tensor

from ..config import NetConfig
from ..features import compute_dtype
from ..network import Theta
from ..orthogonal import gram_layout, is_matrix
from ..segments import FlatLayout, one_segment
from ..step import Parts, flat_step, moment_rows

#: the package, whose settings (:data:`~learned_opt.kernel.PACK_NUMEL`) are read at each call
knobs = sys.modules[__package__]


def step_tensors(
    theta: Theta,
    cfg: NetConfig,
    parts: Parts,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    lr: Tensor,
    packs: dict | None = None,
    decay: Tensor | None = None,
) -> Tensor:
    """Step every tensor of ``params`` in place (parameter and state); returns, per tensor,
    whether it was stepped (False where its gradient or the parameter held NaN or Inf).

    ``states`` hold ``m``, ``v``, ``log_lr`` and ``step`` (a float tensor: the tensor's own
    step count, which its bias correction and time features read, and which only a
    stepped tensor advances), and may hold ``sparse_rows`` (a bool: a row-sparse matrix,
    never orthogonalised) and ``q`` (the Gram polynomial that a matrix keeps between
    Newton-Schulz iterations: every matrix that keeps one under ``cfg`` must hold it; see
    :func:`~learned_opt.orthogonal.gram_layout`). ``lr`` is the step multiplier, a 0-d
    tensor or one per tensor (``[N]``), and ``decay`` None (``cfg.weight_decay`` serves)
    or one weight decay per tensor in its place (see :func:`~learned_opt.step.flat_step`):
    a kernel takes both per tensor, as inputs, so that a scheduler may change ``lr`` and
    the tensors of several param groups share a kernel.

    Every tensor takes :func:`~learned_opt.step.tensor_step`'s step. Eagerly on CPU the host
    reads each tensor's finite flag, to mask only where needed, and the tensors of at most
    :data:`~learned_opt.kernel.PACK_NUMEL` elements with the same dtypes, step count and ``sparse_rows`` mark
    are stepped in one call (:func:`_step_packed`). Then the tensors of one shape, dtypes
    and mark step as the rows of one call (:func:`_step_stacked`; a tensor alone, as a
    view). ``packs``: where the packs' flat state is kept between eager steps (a dict the
    caller keeps; see :class:`_Pack`), which may then replace the state entries of
    ``states`` with views of it; None: a pack gathers and scatters its state each step."""
    # eagerly on CPU: the host reads flags and step counts, and small tensors are packed
    eager_cpu = bool(params) and params[0].device.type == "cpu"
    eager_cpu = eager_cpu and not torch.compiler.is_compiling()
    oks: list[Tensor | None] = [None] * len(params)
    singles = list(range(len(params)))
    if eager_cpu:
        small = [i for i, p in enumerate(params) if p.numel() <= knobs.PACK_NUMEL]
        counts = torch.stack([states[i]["step"] for i in small]).tolist() if small else []
        groups: dict[tuple, list[int]] = {}
        for i, count in zip(small, counts):
            groups.setdefault((params[i].dtype, grads[i].dtype, count), []).append(i)
        for (*_, count), index in groups.items():
            if len(index) < 2:
                continue
            # same sizes adjacent (fewer sums), matrices last (the Adam form spans the rest)
            index.sort(
                key=lambda i: (_orthogonalised(params[i], states[i], cfg), params[i].numel())
            )
            flags = _step_packed(
                theta, cfg, parts, [params[i] for i in index], [grads[i] for i in index],
                [states[i] for i in index], _per(lr, index), count, packs,
                _per(decay, index),
            )  # fmt: skip
            for i, ok in zip(index, flags.unbind()):
                oks[i] = ok
        singles = [i for i in singles if oks[i] is None]
    stacks: dict[tuple, list[int]] = {}  # the tensors of one shape step as rows of one call
    for i in singles:
        stacks.setdefault(_stack_key(params[i], grads[i], states[i]), []).append(i)
    for index in stacks.values():
        flags = _step_stacked(
            theta, cfg, parts, [params[i] for i in index], [grads[i] for i in index],
            [states[i] for i in index], _per(lr, index, rows=True), read_mask=eager_cpu,
            decay=_per(decay, index, rows=True),
        )  # fmt: skip
        for i, ok in zip(index, flags.unbind()):
            oks[i] = ok
    return torch.stack(oks) if oks else torch.ones(0, dtype=torch.bool)


def _step_packed(
    theta,
    cfg: NetConfig,
    parts: Parts,
    params,
    grads,
    states,
    lr,
    count: float,
    packs: dict | None = None,
    decay: Tensor | None = None,
) -> Tensor:
    """:func:`step_tensors` of tensors of one dtype and step count, as the segments of one
    flat vector: one :func:`~learned_opt.step.flat_step` call for all of them (the same
    step as one call each: the same sums, bitwise, where the tensors average at least
    :data:`~learned_opt.segments.SPLIT_MIN_MEAN` elements, else up to their rounding),
    on the flat state of a :class:`_Pack` (kept in ``packs`` between steps). ``count``:
    their step count (read on the host), which the step takes as a number, so that its
    bias corrections are computed on the host.

    Row-sparse tables (``sparse_rows``) keep a second momentum
    (:func:`~learned_opt.step.moment_rows`) and step in the pack of the other tensors,
    whose buffer then carries that row for every tensor, a row the others' step never
    reads: one call instead of two (about 150 torch ops fewer), for one more pass over the
    pack's elements. Returns their stepped flags."""
    rows = moment_rows(parts, any(bool(s.get("sparse_rows")) for s in states))
    matrices = tuple(_orthogonalised(p, s, cfg) for p, s in zip(params, states))
    keeping = gram_layout(cfg, tuple(tuple(p.shape) for p in params), matrices)
    key = (tuple(map(id, states)), rows, keeping)
    pack = packs.get(key) if packs is not None else None
    if pack is None:
        pack = _Pack(params, states, rows, keeping)
        if packs is not None:
            if len(packs) >= knobs.MAX_PACKS:  # packs that change step after step
                packs.clear()
            packs[key] = pack
    pack.load(states, install=packs is not None)
    layout = pack.layout
    for view, t in zip(pack.p_views, params):  # no concatenation, no split: a copy each
        view.copy_(t)
    for view, t in zip(pack.g_views, grads):
        view.copy_(t)
    log_lr = pack.log_lr.unsqueeze(0) if cfg.adapts_lr else None
    q = pack.q.unsqueeze(0) if keeping else None
    out = flat_step(
        theta, cfg, layout, pack.p.unsqueeze(0), pack.g.unsqueeze(0), pack.m.unsqueeze(0),
        pack.v.unsqueeze(0), count + 1, lr, log_lr=log_lr, q=q, return_finite=True,
        parts=parts, read_mask=True, decay=decay,
    )  # fmt: skip
    pack.p.copy_(out[0][0])
    for t, view in zip(params, pack.p_views):
        t.copy_(view)
    ok = out[-1][0]
    pack.store(out[1][0], out[2][0], out[3][0] if log_lr is not None else None,
               out[-2][0] if keeping else None, ok)  # fmt: skip
    pack.unload(states)
    return ok


class _Pack:
    """The flat state of a pack of small tensors (:func:`_step_packed`), kept between
    eager steps: one buffer per state entry (``m`` ``[rows, P]``, ``v`` ``[P]``,
    ``log_lr`` and ``step`` ``[T]``, and ``q`` over the matrices that keep a Gram
    polynomial), whose views replace the tensors' own state entries (``install``), so that
    a step copies only the parameters and gradients in and the parameters out (measured
    with ``benchmarks/step_ab.py``), into and out of buffers ``p`` and ``g`` through
    views shaped as the tensors (``p_views``, ``g_views``), one ``copy_`` a tensor instead
    of concatenating and splitting (17 us against 42 us for a small MLP's 6 tensors, at
    one thread; torch's private ``_foreach_copy_`` took 9 us). A tensor's momenta are a contiguous
    view only where it has one (``m`` ``[1, ...]``, the shipped rule's for every tensor but
    a row-sparse table), so the momenta of a tensor with more (a table, or any tensor
    under a rule with networks) are copied into ``m`` before each step and back after it
    (:meth:`load`, :meth:`unload`). A state entry replaced from outside (a loaded state
    dict, a rule that reads other momenta) is seen at the next step, which gathers the
    state again."""

    def __init__(self, params, states, rows: int, keeping: tuple[int, ...]):
        self.layout = FlatLayout(
            tuple(str(i) for i in range(len(params))), tuple(tuple(p.shape) for p in params),
            tuple(bool(s.get("sparse_rows", False)) for s in states),
        )  # fmt: skip
        self.rows, self.keeping = rows, keeping
        self.views: list[tuple] | None = None  # each tensor's installed entries
        self.copied: list[int] = []  # the tensors whose momenta are copied every step
        self.starts = list(itertools.accumulate(self.layout.numels, initial=0))
        # the parameters and gradients, copied in (and the parameters out) by one call each
        self.p = params[0].new_empty(self.layout.size, dtype=compute_dtype(params[0]))
        self.g = torch.empty_like(self.p)
        self.p_views = _shaped(self.p, params, self.starts)
        self.g_views = _shaped(self.g, params, self.starts)

    @property
    def installed(self) -> bool:
        return self.views is not None

    def current(self, states) -> bool:
        """Whether every installed state entry of ``states`` is still this pack's view."""
        if self.views is None:
            return False
        return all(
            (m is None or s["m"] is m) and s["v"] is v and s["log_lr"] is lr
            and s["step"] is n and s.get("q") is q
            for s, (m, v, lr, n, q) in zip(states, self.views)
        )  # fmt: skip

    def load(self, states, install: bool) -> None:
        """Before a step: the state of ``states`` in the buffers, gathered anew (and with
        ``install`` made views of them) unless it still is, the momenta that are not views
        copied in."""
        if not self.current(states):
            self.gather(states, install)
        else:
            for k in self.copied:
                buffer, own = self._own_momenta(k, states[k]["m"])
                buffer.copy_(own)

    def unload(self, states) -> None:
        """After a step: the buffers back in the state entries that are not their views."""
        if not self.installed:
            self.scatter(states)
            return
        for k in self.copied:
            buffer, own = self._own_momenta(k, states[k]["m"])
            own.copy_(buffer)

    def _momenta(self, k: int) -> Tensor:
        """Tensor ``k``'s momenta in ``m``: ``[rows, n]`` (a slice, which may be written)."""
        return self.m[:, self.starts[k] : self.starts[k + 1]]

    def _own_momenta(self, k: int, m: Tensor) -> tuple[Tensor, Tensor]:
        """The momenta of tensor ``k`` that its state entry ``m`` holds (the rows past them
        are never read): in the buffer, shaped as ``m``'s, and in ``m``."""
        own = min(self.rows, m.shape[0])
        return self._momenta(k)[:own].view(own, *m.shape[1:]), m[:own]

    def gather(self, states, install: bool) -> None:
        """Copy the state of ``states`` into new buffers, and with ``install`` make each
        entry of ``states`` a view of them (the momenta of a tensor that has one)."""
        rows, numels = self.rows, self.layout.numels
        self.m = torch.cat([_padded_momenta(s["m"], rows) for s in states], dim=1)
        self.v = torch.cat([s["v"].reshape(-1) for s in states])
        self.log_lr = torch.stack([s["log_lr"] for s in states])
        self.step = torch.stack([s["step"] for s in states])
        qs = [states[k]["q"] for k in self.keeping]
        self.q = torch.cat([q.reshape(-1) for q in qs]) if qs else None
        self.views = None
        if not install:
            return
        self.copied = [k for k, s in enumerate(states) if s["m"].shape[0] != 1]
        for k, (s, v) in enumerate(zip(states, self.v.split(numels))):
            if k not in self.copied:  # its one momentum: the buffer's first row, contiguous
                s["m"] = self._momenta(k)[:1].view(s["m"].shape)
            s["v"], s["log_lr"], s["step"] = v.view(s["v"].shape), self.log_lr[k], self.step[k]
        if qs:
            for k, q in zip(self.keeping, self.q.split([q.numel() for q in qs])):
                states[k]["q"] = q.view(states[k]["q"].shape)
        self.views = [
            (None if k in self.copied else s["m"], s["v"], s["log_lr"], s["step"], s.get("q"))
            for k, s in enumerate(states)
        ]  # fmt: skip

    def store(self, m: Tensor, v: Tensor, log_lr: Tensor | None, q: Tensor | None, ok) -> None:
        """Write a step's new state (``m`` ``[rows, P]``, ``v`` ``[P]``, ``log_lr`` ``[T]``
        or None where the rule keeps it, ``q``) into the buffers, and count the step of
        each tensor that ``ok`` says was stepped."""
        self.m.copy_(m)
        self.v.copy_(v)
        if log_lr is not None:
            self.log_lr.copy_(log_lr)
        if q is not None:
            self.q.copy_(q)
        self.step.add_(ok.to(self.step.dtype))

    def scatter(self, states) -> None:
        """Copy the buffers back into the state entries of ``states`` (a pack whose
        entries are not its views)."""
        for k, (s, v) in enumerate(zip(states, self.v.split(self.layout.numels))):
            buffer, own = self._own_momenta(k, s["m"])
            own.copy_(buffer)
            s["v"].copy_(v.view(s["v"].shape))
        for s, lr, n in zip(states, self.log_lr.unbind(), self.step.unbind()):
            s["log_lr"].copy_(lr)
            s["step"].copy_(n)
        if self.q is not None:
            qs = [states[k]["q"] for k in self.keeping]
            for q, new in zip(qs, self.q.split([q.numel() for q in qs])):
                q.copy_(new.view(q.shape))


def _padded_momenta(m: Tensor, rows: int) -> Tensor:
    """A tensor's first ``rows`` momenta flat (``[rows, n]``), zeros for those it lacks."""
    own = m[:rows].reshape(min(rows, m.shape[0]), -1)
    if own.shape[0] == rows:
        return own
    return torch.cat([own, own.new_zeros(rows - own.shape[0], own.shape[1])])


def _shaped(flat: Tensor, like: list[Tensor], starts: list[int]) -> list[Tensor]:
    """Views of ``flat`` shaped as the tensors ``like``, which start at ``starts`` (slices,
    not ``split``'s views, which autograd forbids writing into)."""
    return [flat[i : i + t.numel()].view(t.shape) for i, t in zip(starts, like)]


def _per(values: Tensor | None, index: list[int], rows: bool = False) -> Tensor | None:
    """The entries of the tensors ``index`` of per-tensor ``values`` (``[N]``; a 0-d tensor
    or None serves every tensor as it is): ``[T]`` for a pack's segments, ``[T, 1]`` for
    the rows of a stack (``rows``)."""
    if values is None or values.dim() == 0:
        return values
    picked = values[index]
    return picked.unsqueeze(1) if rows else picked


def _orthogonalised(p: Tensor, state: dict, cfg: NetConfig) -> bool:
    """Whether ``p`` takes the orthogonalised step (a row-sparse matrix does not)."""
    return is_matrix(tuple(p.shape), cfg) and not state.get("sparse_rows")


def _stack_key(p: Tensor, g: Tensor, s: dict) -> tuple:
    """What the tensors that :func:`_step_stacked` steps together share."""
    return (tuple(p.shape), p.dtype, g.dtype, s["v"].dtype, bool(s.get("sparse_rows")))


def _as_rows(tensors: list[Tensor]) -> Tensor:
    """The tensors as the rows of one: a view of a tensor alone, else a stacked copy."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _step_stacked(
    theta, cfg: NetConfig, parts: Parts, params, grads, states, lr, read_mask=False, decay=None
) -> Tensor:
    """:func:`step_tensors` of tensors of one :func:`_stack_key` (shape, dtypes and
    ``sparse_rows`` mark) as the rows of one :func:`~learned_opt.step.flat_step` call on a
    one-segment layout, each row with its own step count: the same step as one
    :func:`~learned_opt.step.tensor_step` call each, with one batched Newton-Schulz
    iteration for matrices (measured at 2 threads: the reference's step 8.4x AdamW's
    instead of 10.2x on the 0.5M transformer, 12.4x instead of 15.2x on the 10M one). A
    kernel is this function of one tensor (:mod:`.export`). ``read_mask``: see
    :func:`~learned_opt.step.flat_step`;
    then a step count shared by every row is also read on the host and taken as a number
    (the bias corrections computed on the host). Returns their stepped flags."""
    shape, sparse = params[0].shape, bool(states[0].get("sparse_rows"))
    dtype = compute_dtype(params[0])
    rows = moment_rows(parts, sparse)
    p = _as_rows([t.reshape(-1) for t in params]).to(dtype)
    g = _as_rows([t.reshape(-1) for t in grads]).to(dtype)
    m = _as_rows([s["m"][:rows].reshape(rows, -1) for s in states])
    v = _as_rows([s["v"].reshape(-1) for s in states])
    step = _as_rows([s["step"] for s in states]).reshape(-1, 1) + 1
    if read_mask:  # eagerly on CPU: one count for every row is taken as a number
        counts = step.reshape(-1).tolist()
        step = counts[0] if len(set(counts)) == 1 else step
    log_lr = _as_rows([s["log_lr"] for s in states]).reshape(-1, 1) if cfg.adapts_lr else None
    q = _as_rows([s["q"].reshape(-1) for s in states]) if "q" in states[0] else None
    out = flat_step(
        theta, cfg, one_segment(shape, sparse), p, g, m, v, step, lr, log_lr=log_lr, q=q,
        return_finite=True, parts=parts, read_mask=read_mask, decay=decay,
    )  # fmt: skip
    ok = out[-1][:, 0]
    for j, (t, s) in enumerate(zip(params, states)):
        t.copy_(out[0][j].view(shape))
        if q is not None:
            s["q"].copy_(out[-2][j].view(s["q"].shape))
        s["m"][:rows].copy_(out[1][j].view(rows, *shape))
        s["v"].copy_(out[2][j].view(s["v"].shape))
        if log_lr is not None:
            s["log_lr"].copy_(out[3][j, 0])
        s["step"].add_(ok[j].to(s["step"].dtype))
    return ok
