"""The compiled path of the learned step: :func:`step_tensors`, compiled ahead of time.

:func:`step_tensors` steps a list of tensors in place with :func:`learned_opt.step.tensor_step`,
the differentiable reference. Eagerly it is the reference itself; exported by the public
``torch.export`` and compiled ahead of time by AOTInductor (one package per kind of
bucket of tensors) it is the kernel, whose elementwise work inductor fuses into a few
loops over each tensor. Kernels are built for CPU tensors only (:data:`KERNEL_DEVICES`):
on a GPU the reference steps.

``step()`` never waits for a compile. A :class:`Kernels` steps the tensors in buckets of
one shape and holds one kernel per kind of bucket (device, dtypes, shapes, strides); the
first steps of a new kind run the reference, and once the optimizer's eager steps have
taken :data:`COMPILE_AFTER_SECONDS` in all (and the kind has stepped at least
:data:`COMPILE_AFTER` times) one process-wide worker thread has the kernels built on copies
of the tensors by a child process at low priority: one child for all the kinds queued
together (torch's and the compiler's start-up are paid once), building them in turn and
writing each package to :func:`kernel_dir`. The worker thread loads each package as it
appears (milliseconds: nothing is traced in this process), and the steps after that run
its kernel. If building fails, one
warning says why and the reference keeps stepping that kind. While a build runs, a CPU
training process steps and trains with one thread fewer (:data:`YIELD_THREADS`), so that
the child has a core.

A package is built once per host and user: the worker holds a file lock while it builds,
so the other ranks of a ``torchrun`` job wait (stepping eagerly meanwhile) and then load
the same file, and a later run of the same model loads it after :data:`COMPILE_AFTER`
steps, without waiting for :data:`COMPILE_AFTER_SECONDS`. The file's name hashes all the
kernel depends on (:func:`package_path`), so new code, another torch or other shapes
build another.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib
import itertools
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from .config import NetConfig, with_weight_decay
from .features import compute_dtype
from .network import Theta
from .orthogonal import gram_layout, is_matrix
from .segments import FlatLayout, one_segment
from .step import Parts, flat_step, moment_rows

#: A kind of bucket is compiled once it has stepped eagerly at least this many times, and
#: the optimizer's eager steps have taken :data:`COMPILE_AFTER_SECONDS` in all: a
#: short-lived optimizer (a quick check, a two-step test) or a small model's short run
#: never pays for a compile it would not use.
COMPILE_AFTER = 3
#: The eager seconds an optimizer steps for before its kinds of bucket are compiled (all
#: its kinds together: counted per kind, a model's small tensors stepped eagerly for
#: good, a few milliseconds of every step, because their share never reached it). A
#: compile takes tens of seconds to minutes of a core and slows the training thread meanwhile (by
#: about 1.8x on 2 cores, with the compile in a child process), so a run whose whole
#: eager optimizer cost is a few seconds finishes sooner without a kernel, and a model
#: whose eager step is slow reaches the threshold in a few steps. Chosen on the validation
#: family by ``benchmarks/wallclock.py`` (compile-included wall clock: median 0.69x tuned
#: AdamW at 10 s, 0.64x at 2 s, 0.17x compiling in this process after 3 steps; docs:
#: *Results*).
COMPILE_AFTER_SECONDS = 10.0
#: Environment variable that turns compiling off (``0``): every step runs the reference.
COMPILE_ENV = "LEARNED_OPT_COMPILE"


#: On CPU outside compiling, the tensors of at most this many elements are stepped
#: together, as the segments of one flat vector (:func:`~learned_opt.step.flat_step`): each
#: eager call costs about 170 torch ops whatever the tensor's size, which is most of a
#: bias's or a small matrix's step, while packing costs a copy of each parameter and
#: gradient in and of each parameter out (the state stays flat between steps: see
#: :class:`_Pack`) and gathers over the packed elements. First chosen at 16384 with
#: ``benchmarks/eager_step.py --pack-numel 4096 65536 1000000000``, when the state was
#: copied in and out too (the 0.4M transformer's step 19.9 ms against 28.3 ms up to 65536);
#: with the state kept flat, chosen again at 65536 on the validation family's models
#: (2026-12-06, against 16384 at one thread): ``eager_step.py --tasks``
#: (``eager_step_pack_bound_validation.json``, medians, beside a meta-training run)
#: attention's step 11% shorter, the LSTM language model's 3% and the 256-wide MLP's 4%,
#: the larger LSTM's 4% longer, the others unchanged; the fastest of 15 rounds taken in
#: turns, once: the LSTM models' 10% shorter, the 256-wide MLP's 5%; ``step_ab.py``
#: (``step_ab_pack_bound.json``): the LSTM models' and the recommender's 9-11% shorter,
#: attention's 3% longer, the rest unchanged;
#: ``eager_step_pack_bound.json``: the 0.4M transformer's 7% shorter, the MLPs unchanged.
PACK_NUMEL = 65536


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
    :data:`PACK_NUMEL` elements with the same dtypes, step count and ``sparse_rows`` mark
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
        small = [i for i, p in enumerate(params) if p.numel() <= PACK_NUMEL]
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
            if len(packs) >= MAX_PACKS:  # packs that change step after step
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


#: At most this many packs' flat state is kept per optimizer (:class:`_Pack`).
MAX_PACKS = 16


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
    :func:`~learned_opt.step.tensor_step` call each, traced as one graph for all of them,
    and one batched Newton-Schulz iteration for matrices. Measured on the 0.5M
    transformer (2 threads, side by side with AdamW in one process): its two kernels
    built in 48 s instead of 69 s (the first, 16 tensors of two shapes, from 774 graph
    nodes instead of 2594), and the kernel's step took 3.9x AdamW's instead of 5.5x, the
    reference's 8.4x instead of 10.2x; on the 10M transformer (12 layers) the kernel's
    step 11.6x instead of 13.0x, the reference's 12.4x instead of 15.2x, and its kernels
    built in 190 s instead of 300 s. ``read_mask``: see :func:`~learned_opt.step.flat_step`;
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


@contextlib.contextmanager
def compile_after_seconds(seconds: float):
    """Within the block, queue compiles once an optimizer has stepped eagerly for
    ``seconds`` (:data:`COMPILE_AFTER_SECONDS` again after it): ``0`` for a benchmark or
    test that times or checks the kernel itself after :data:`COMPILE_AFTER` steps."""
    global COMPILE_AFTER_SECONDS
    previous, COMPILE_AFTER_SECONDS = COMPILE_AFTER_SECONDS, float(seconds)
    try:
        yield
    finally:
        COMPILE_AFTER_SECONDS = previous


#: The devices whose tensors step through compiled kernels; others step the reference.
#: Not CUDA: on an H200 with torch 2.11.0+cu130, loading any CUDA AOTInductor package (a
#: one-line ``x * 2 + 1`` too, on the main thread or another) ended the process with a
#: segmentation fault inside ``aoti_load_package``, where an error or the reference was
#: owed (``benchmarks/results/cuda_aoti_probe.json``, ``cuda_check.json``).
KERNEL_DEVICES = frozenset({"cpu"})


def compiling_enabled() -> bool:
    """False where :data:`COMPILE_ENV` is ``0`` (or ``false``)."""
    value = os.environ.get(COMPILE_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise ValueError(f"Invalid {COMPILE_ENV}={value!r} (must be 0 or 1, or unset)")
    return value not in ("0", "false")


class Group(NamedTuple):
    """One param group's tensors on one device and dtype, as :meth:`Kernels.step_groups`
    takes them: its config (with its weight decay) and its step multiplier ``lr``."""

    cfg: NetConfig
    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    states: Sequence[dict]
    lr: float


def _shared_config(groups: Sequence[Group]) -> NetConfig:
    """The config of ``groups`` without weight decay, which a bucket's kernel takes per
    tensor; a ``ValueError`` where they differ in more."""
    cfg = with_weight_decay(groups[0].cfg, 0.0)
    if any(with_weight_decay(g.cfg, 0.0) != cfg for g in groups[1:]):
        raise ValueError("param groups stepped together must differ at most in weight_decay")
    return cfg


def _per_tensor(groups: Sequence[Group]) -> tuple[list[float], list[float]]:
    """Each tensor's ``lr`` and weight decay (its group's), over the groups' tensors in
    turn."""
    lrs = [float(g.lr) for g in groups for _ in g.params]
    return lrs, [g.cfg.weight_decay for g in groups for _ in g.params]


class _Plan(NamedTuple):
    """The buckets of a set of tensors (tensor indices, and the entry of each bucket's
    kind), and each bucket's ``lr`` and ``decay`` inputs by the groups' values."""

    buckets: list[tuple[list[int], _Entry]]
    inputs: dict


class KernelCache:
    """The kernels of one user (an optimizer, a communicator), one :class:`_Entry` per
    kind of input, and when to queue their builds: a kind's compile is queued once it
    has run eagerly :data:`COMPILE_AFTER` times and all the user's eager calls have taken
    :data:`COMPILE_AFTER_SECONDS` (at once where its package is on disk already)."""

    def __init__(self, compile: bool = True):
        self.compile = compile
        self._entries: dict[tuple, _Entry] = {}
        #: host seconds of all the eager calls (not synchronised on CUDA): what the
        #: reference has cost this user, which decides when its kinds compile
        self.eager_seconds = 0.0

    def compiles(self, device: torch.device) -> bool:
        """Whether this user's kinds on ``device`` compile: ``compile`` set, compiling not
        turned off (:data:`COMPILE_ENV`), and a device of :data:`KERNEL_DEVICES`."""
        return self.compile and compiling_enabled() and device.type in KERNEL_DEVICES

    def _entry(self, key: tuple) -> _Entry:
        """The entry of the kind ``key`` (made at its first call)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        return entry

    def _queue_if_due(
        self, entry: _Entry, args_of: Callable[[], tuple], recipe: Recipe | None = None
    ) -> None:
        """Count an eager call of a kind, and queue its compile once due; ``args_of``
        gives the kind's kernel arguments (of ``recipe``, the step's by default), built
        only on the calls that need them."""
        recipe = recipe or STEP
        entry.eager_steps += 1
        if entry.eager_steps == 1:  # a package built before (another rank, an earlier run)
            entry.built = _is_built(recipe, args_of())
        if (not entry.queued and entry.eager_steps >= COMPILE_AFTER
                and (entry.built or self.eager_seconds >= COMPILE_AFTER_SECONDS)):  # fmt: skip
            entry.queued = True
            _worker().submit(entry, args_of(), recipe)

    def ready(self) -> bool:
        """Whether every kind run so far runs its compiled kernel."""
        return bool(self._entries) and all(e.fn is not None for e in self._entries.values())

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued compile has finished (or failed); returns
        :meth:`ready`. For benchmarks and tests: a step or a mix never waits."""
        for entry in list(self._entries.values()):
            if entry.queued and not entry.done.wait(timeout):
                return False
        _worker().join_if_idle(timeout)
        if not _worker().busy():
            _yield_threads(False)
        return self.ready()


class Kernels(KernelCache):
    """The compiled kernels of one optimizer (see the module).

    Tensors are stepped in buckets of at most :data:`BUCKET`, ordered by shape, and every
    bucket of the same shapes runs the same compiled function: a small model steps in
    one call, and a model of many layers compiles each kind of bucket once (a 10M-parameter
    transformer of 124 tensors compiles a few graphs instead of one of 124 tensors). The
    buckets without a kernel yet step together, in one call of the reference (whose
    packs and stacks then span buckets), and the eager packs keep their flat state in the
    optimizer's :class:`_Pack` cache."""

    def __init__(self, compile: bool = True):
        super().__init__(compile)
        self._plans: dict[tuple, list] = {}  # see _plan
        self._lr: dict[tuple, Tensor] = {}  # (value, dtype, device): its 0-d tensor
        self._packs: dict[tuple, _Pack] = {}  # the eager packs' flat state (see _Pack)

    def step(self, theta, cfg: NetConfig, parts: Parts, params, grads, states, lr) -> list[bool]:
        """:func:`step_tensors` over every bucket of tensors, each with its kernel if it is
        ready, else with the reference (and the compile queued once the eager steps have
        taken :data:`COMPILE_AFTER_SECONDS`); returns, per tensor, whether it
        was stepped. ``states`` are the tensors' optimizer states, whose entries an eager
        step may replace with views of a pack's flat state (see :class:`_Pack`)."""
        return self.step_groups(theta, parts, [Group(cfg, params, grads, states, lr)])[0]

    def step_groups(self, theta, parts: Parts, groups: Sequence[Group]) -> list[list[bool]]:
        """:meth:`step` of several param groups on one device and dtype, whose configs
        differ at most in ``weight_decay``; returns each group's flags. The tensors of
        all groups are bucketed together, and each tensor steps with its group's ``lr``
        and weight decay: a kernel takes both per tensor (a model split into the usual
        decay and no-decay groups builds and calls the kernels of one group), and the
        buckets without one step in one reference call (``benchmarks/step_ab.py``)."""
        device = groups[0].params[0].device
        dtype = groups[0].states[0]["v"].dtype
        if device.type == "cpu":
            _yield_threads(_worker().busy())
        kernels = self.compiles(device)
        cfg = _shared_config(groups)
        # the kernel and the reference step outside autocast, which would otherwise cast
        # the matrix products of a step() called inside it
        outside = contextlib.nullcontext()
        if torch.is_autocast_enabled(device.type):
            outside = torch.autocast(device.type, enabled=False)
        if len(groups) == 1:
            params, grads, states = groups[0].params, groups[0].grads, groups[0].states
        else:
            params, grads, states = (
                [t for g in groups for t in getattr(g, name)]
                for name in ("params", "grads", "states")
            )
        flags: list = [False] * len(params)
        eager: list[tuple[list[int], _Entry | None]] = []  # (tensors, bucket)
        with outside:
            if not kernels:
                eager.append((list(range(len(params))), None))
            else:
                plan = self._plan(cfg, parts, params, grads, states)
                inputs = self._inputs(plan, groups, dtype, device)
                for (index, entry), (lr, decay) in zip(plan.buckets, inputs):
                    args = functools.partial(
                        _bucket_args, theta, cfg, parts, params, grads, states, index, lr, decay
                    )
                    if entry.fn is None:
                        self._queue_if_due(entry, lambda args=args: _kernel_args(args()))
                        eager.append((index, entry))
                        continue
                    for i, ok in zip(index, entry.fn(*_kernel_args(args())).tolist()):
                        flags[i] = ok
            if eager:  # the buckets without a kernel: one reference call for all of them
                start = time.perf_counter()
                picked = [i for index, _ in eager for i in index]
                oks = self._reference(theta, parts, cfg, groups, picked, params, grads, states)
                if kernels:
                    self._count_eager(time.perf_counter() - start, params, eager)
                for i, ok in zip(picked, oks.tolist()):
                    flags[i] = ok
        out, at = [], 0
        for g in groups:
            out.append(flags[at : at + len(g.params)])
            at += len(g.params)
        return out

    def _reference(self, theta, parts, shared, groups, picked, params, grads, states) -> Tensor:
        """:func:`step_tensors` of the tensors ``picked`` (indices into ``groups``' tensors
        in turn) in one call: under the groups' config (``shared``, their
        :func:`_shared_config`, where they differ in weight decay, each tensor's then
        handed over as ``decay``), with the groups' ``lr`` where they share one, else one
        per tensor."""
        dtype, device = states[0]["v"].dtype, params[0].device
        owner = [k for k, g in enumerate(groups) for _ in g.params]
        used = [groups[k] for k in dict.fromkeys(owner[i] for i in picked)]
        cfg, decay = used[0].cfg, None
        lr = self._lr_tensor(float(used[0].lr), dtype, device)
        lrs_differ = len({float(g.lr) for g in used}) > 1
        decays_differ = len({g.cfg for g in used}) > 1
        if lrs_differ or decays_differ:  # one value per tensor (a single group needs none)
            lrs, decays = _per_tensor(groups)
            if lrs_differ:
                lr = torch.tensor([lrs[i] for i in picked], dtype=dtype, device=device)
            if decays_differ:
                cfg = shared
                decay = torch.tensor([decays[i] for i in picked], dtype=dtype, device=device)
        params, grads, states = ([t[i] for i in picked] for t in (params, grads, states))
        return step_tensors(theta, cfg, parts, params, grads, states, lr, self._packs, decay)

    def _inputs(self, plan: _Plan, groups, dtype, device) -> list[tuple[Tensor, Tensor]]:
        """Each bucket's ``lr`` and ``decay`` kernel inputs (one per tensor, ``[T]``: a
        bucket may hold tensors of several groups), made again only when a group's ``lr``
        or weight decay changes."""
        key = (tuple(float(g.lr) for g in groups), tuple(g.cfg.weight_decay for g in groups))
        inputs = plan.inputs.get(key)
        if inputs is None:
            lrs, decays = _per_tensor(groups)
            inputs = [
                (torch.tensor([lrs[i] for i in index], dtype=dtype, device=device),
                 torch.tensor([decays[i] for i in index], dtype=dtype, device=device))
                for index, _ in plan.buckets
            ]  # fmt: skip
            if len(plan.inputs) >= MAX_PLANS:  # values that change step after step
                plan.inputs.clear()
            plan.inputs[key] = inputs
        return inputs

    def _lr_tensor(self, value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``lr`` as the reference's 0-d input where the groups share one, made again only
        when it changes (one per param group's value)."""
        key = (value, dtype, device)
        lr = self._lr.get(key)
        if lr is None:
            if len(self._lr) >= MAX_PLANS:  # values that change step after step
                self._lr.clear()
            lr = self._lr[key] = torch.tensor(value, dtype=dtype, device=device)
        return lr

    def _plan(self, cfg, parts, params, grads, states) -> _Plan:
        """The buckets of these tensors (:func:`_buckets`) and each bucket's entry, kept
        by the :func:`_signature` of all of them, which holds everything that decides them
        (a step only builds this key; a model whose tensors change layout gets a plan of
        its own)."""
        key = _signature(cfg, parts, params, grads, states)
        plan = self._plans.get(key)
        if plan is None:
            plan = _Plan([], {})
            for index in _buckets(params, grads, states):
                sig = _signature(
                    cfg, parts, *([t[i] for i in index] for t in (params, grads, states))
                )
                plan.buckets.append((index, self._entry(sig)))
            if len(self._plans) >= MAX_PLANS:  # layouts that change step after step
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _count_eager(self, seconds: float, params, eager: list) -> None:
        """Add an eager call's ``seconds`` to the optimizer's and, by their share of the
        elements, to each of its ``(index, entry)`` buckets'."""
        self.eager_seconds += seconds
        sizes = [sum(params[i].numel() for i in index) for index, _ in eager]
        total = max(sum(sizes), 1)
        for (_, entry), size in zip(eager, sizes):
            entry.eager_seconds += seconds * size / total


#: At most this many tensors are stepped by one compiled call. Each call costs tens of
#: microseconds whatever its size, which is most of a small model's step; more tensors per
#: call make larger graphs to compile. Measured side by side at one thread against
#: buckets of one shape: a 3-layer MLP's step took 0.99 ms in one call against 1.38 ms in
#: four, a 0.5M transformer's 23.8 ms in 2 calls against 26.0 ms in 7, and compiling took
#: no longer; ``benchmarks/step_overhead.py`` measures the step this gives.
BUCKET = 16


def _buckets(params, grads, states) -> list[list[int]]:
    """Indices of the tensors stepped together: the same dtypes, layout and
    ``sparse_rows`` mark, ordered by shape (so that the layers of a deep model give
    buckets of the same kind, compiled once), at most :data:`BUCKET` each."""
    kinds: dict[tuple, list[int]] = {}
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        key = (p.dtype, g.dtype, p.is_contiguous(), s.get("sparse_rows"))
        kinds.setdefault(key, []).append(i)
    out = []
    for idx in kinds.values():
        idx = sorted(idx, key=lambda i: (params[i].dim(), tuple(params[i].shape)))
        out += [idx[k : k + BUCKET] for k in range(0, len(idx), BUCKET)]
    return out


#: At most this many bucket plans are kept per optimizer (:meth:`Kernels._plan`).
MAX_PLANS = 16


class _Entry:
    """One set of tensors: its compiled function once ready."""

    def __init__(self):
        self.fn: Callable | None = None
        self.eager_steps = 0
        self.eager_seconds = 0.0  # what the reference has cost this kind
        self.queued = False
        self.built = False  # its package was on disk at its first step
        self.done = threading.Event()


def _signature(cfg, parts, params, grads, states) -> tuple:
    """The kind of a bucket: its config, parts and tensors (a kernel is built for their
    exact shapes and strides, and checks none of them), and torch's thread count, which a
    kernel's loops are parallelised for (at a new count the reference steps until that
    kind has its own kernel)."""
    tensors = tuple(
        (p.device, p.dtype, tuple(p.shape), p.stride(), g.dtype, g.stride(),
         s.get("sparse_rows"))
        for p, g, s in zip(params, grads, states)
    )  # fmt: skip
    return cfg, parts, tensors, kernel_threads()


#: While a kernel builds, a CPU training process steps and trains with this many fewer
#: intra-op threads (never fewer than one), so that the build, a child process at low
#: priority, has a core of its own instead of the slices the training threads leave it.
#: Measured on 2 cores, training the 0.5M transformer at 2 threads from an empty cache
#: (``benchmarks/build_race.py``): the kernel was ready after 81 s instead of not within
#: the 300 s of the run; training did 3% fewer steps in the first minute and 26% more by
#: 300 s. A training at one thread has none to yield.
YIELD_THREADS = 1
_YIELDED: list[tuple[int, int]] = []  # (the training's thread count, the count while yielding)


def kernel_threads() -> int:
    """The thread count a kernel is built for and keyed by: the training process's own,
    also while it yields threads to a build (:data:`YIELD_THREADS`)."""
    return _YIELDED[0][0] if _YIELDED else torch.get_num_threads()


def _yield_threads(building: bool) -> None:
    """On the training thread, at a step: while ``building`` set torch's thread count
    :data:`YIELD_THREADS` lower, and once no build is left restore it (unless the
    program set another count meanwhile, which then stands)."""
    if building and not _YIELDED and YIELD_THREADS > 0:
        threads = torch.get_num_threads()
        if threads > 1:
            _YIELDED.append((threads, max(1, threads - YIELD_THREADS)))
            torch.set_num_threads(_YIELDED[0][1])
    elif not building and _YIELDED:
        threads, during = _YIELDED.pop()
        if torch.get_num_threads() == during:
            torch.set_num_threads(threads)


class _Worker:
    """The process-wide compiler: one thread finds or builds the kernels of the queued sets
    of tensors, all those queued together at once (:meth:`_build_and_load`), and exits
    once the queue is empty (a later job starts a fresh thread).

    The thread never traces or runs a kernel: a child process builds the package
    (:func:`build_package`) and the thread loads it (:func:`load_package`). Tracing in
    this process would hold the interpreter lock between the training thread's eager ops
    (an eager step 10-15 times slower for as long as it took), and a kernel's first call on
    this thread would give the thread an OpenMP team of its own, after which the runtime
    counts more threads than cores and every torch op of the training thread waits on a
    futex wake-up (measured: AdamW's step 5x slower)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.child: subprocess.Popen | None = None  # see _build_in_child
        self.closed = False

    def submit(self, entry: _Entry, args: tuple, recipe: Recipe | None = None) -> None:
        """Queue the kernel of ``args`` (the step's, or another ``recipe``'s) for
        ``entry``."""
        # the job holds copies (the live tensors keep changing) and only a weak reference
        # to the entry, so a dropped optimizer's compile is skipped
        recipe = recipe or STEP
        copies = recipe.copy(args)
        with self.lock:
            if self.closed:  # the interpreter is exiting: the reference keeps stepping
                entry.done.set()
                return
            self.jobs.put((weakref.ref(entry), recipe, copies))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="learned-opt-compile", daemon=True
                )
                self.thread.start()

    def busy(self) -> bool:
        """Whether a build is queued or in progress (the thread is alive)."""
        return self.thread is not None

    def join_if_idle(self, timeout: float | None = None) -> None:
        """Wait for the thread to exit if no job is left (it is about to)."""
        with self.lock:
            thread = self.thread if self.jobs.empty() else None
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        """At interpreter exit: drop the queued jobs, stop the child that is building a
        package and wait for the thread."""
        with self.lock:
            self.closed = True
            while not self.jobs.empty():
                entry = self.jobs.get_nowait()[0]()
                if entry is not None:
                    entry.done.set()
            thread = self.thread
            if self.child is not None:
                self.child.kill()
        if thread is not None:
            thread.join()

    def _take(self) -> list:
        """Every job queued within :data:`GATHER_SECONDS`, or ``[]`` (and the thread
        marked gone) when the queue is empty."""
        time.sleep(GATHER_SECONDS)  # the other kinds of the same step, or other optimizers
        with self.lock:
            jobs = []
            while not self.jobs.empty():
                jobs.append(self.jobs.get_nowait())
            if not jobs:
                self.thread = None
            return jobs

    def _build_in_child(
        self,
        builds: list[tuple[tuple, Path]],
        built: Callable[[int], None] = lambda i: None,
        recipe: Recipe | None = None,
    ) -> None:
        """Build the packages of ``builds`` (``(args, path)`` each, of one ``recipe``: the
        step's by default), in order, in one child process at low priority
        (:data:`CHILD_NICE`; the training process keeps the cores it needs): the child
        pays torch's and the compiler's start-up once for all of them. ``built(i)`` is
        called as the package of ``builds[i]`` appears, while the child goes on with the
        next. Raises a ``RuntimeError`` that says why when a package was not built (those
        before it were).

        The child trusts the CPU's flags for inductor's vector instruction set
        (:data:`ISA_ENV`) instead of having inductor compile a probe for each (9 s of a
        build on an empty cache, about 1 s on a warm one); where that child fails (a
        compiler that lacks an instruction set the CPU has), a second child that probes
        builds the packages the first left. Where :data:`ISA_ENV` is set, it stands."""
        if ISA_ENV in os.environ:
            return self._run_child(builds, built, recipe, {})
        done: list[int] = []
        try:
            self._run_child(builds, lambda i: (done.append(i), built(i)), recipe, {ISA_ENV: "1"})
        except _ChildFailed:
            if self.closed:
                raise
            first = len(done)
            self._run_child(builds[first:], lambda i: built(first + i), recipe, {})

    def _run_child(self, builds, built, recipe, extra_env: dict[str, str]) -> None:
        """:meth:`_build_in_child`'s one child, with ``extra_env`` in its environment."""
        recipe = recipe or STEP
        jobs = [recipe.payload(args) | {"out": str(path)} for args, path in builds]
        job = {"builds": jobs, "recipe": recipe.name, "module": recipe.module,
               "threads": kernel_threads(), "nice": CHILD_NICE,
               "parent": os.getpid()}  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
               **extra_env}  # fmt: skip
        paths, seen = [path for _, path in builds], 0
        with tempfile.TemporaryDirectory() as folder:
            job_path, log_path = os.path.join(folder, "job.pt"), os.path.join(folder, "log")
            torch.save(job, job_path)
            with open(log_path, "wb") as log:
                with self.lock:
                    if self.closed:
                        raise RuntimeError("the interpreter is exiting")
                    try:
                        self.child = subprocess.Popen(
                            [sys.executable, "-c", _CHILD, job_path], env=env,
                            stdout=subprocess.DEVNULL, stderr=log,
                        )  # fmt: skip
                    except OSError as e:
                        raise RuntimeError(f"cannot start a compile process: {e}") from None
                deadline = time.monotonic() + CHILD_COMPILE_TIMEOUT * len(builds)
                try:
                    code = None
                    while code is None and time.monotonic() < deadline:
                        code = self._wait_child(BUILT_POLL_SECONDS)
                        while seen < len(paths) and paths[seen].is_file():
                            built(seen)
                            seen += 1
                    exited = code is not None
                    if code is None:
                        code = f"timeout after {CHILD_COMPILE_TIMEOUT} s a package"
                finally:
                    self.child.kill()  # no-op once it has exited
                    self.child.wait()
                    for path in paths:
                        for partial in path.parent.glob(f".partial-{self.child.pid}-*"):
                            partial.unlink(missing_ok=True)  # what a stopped child left
                    self.child = None
            if seen < len(paths):
                with open(log_path, errors="replace") as log:
                    lines = [line.strip() for line in log if line.strip()]
                why = lines[-1] if lines else f"exit status {code}"
                failure = _ChildFailed if exited else RuntimeError
                raise failure(f"the compile process failed: {why}")

    def _wait_child(self, seconds: float):
        """The child's exit status, or None if it still runs after ``seconds``."""
        try:
            return self.child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def _run(self) -> None:
        while jobs := self._take():
            entries = [(ref(), recipe, args) for ref, recipe, args in jobs]
            entries = [job for job in entries if job[0] is not None]
            entries.sort(key=lambda job: -job[0].eager_seconds)  # the costliest kind first
            del jobs
            try:
                self._build_and_load(entries)
            finally:
                for entry, _, _ in entries:
                    entry.done.set()
                del entries

    def _build_and_load(self, entries: list) -> None:
        """Load the kernel of every ``(entry, recipe, args)``: from its package if one is
        on disk, else built first, those of one recipe in one child; a failure warns once
        per entry and leaves it the reference."""
        failed: dict[int, Exception] = {}

        def load(i: int, path: Path) -> None:
            try:
                entries[i][0].fn = entries[i][1].load(path)
            except Exception as e:  # a package that does not load: the reference steps
                failed[i] = e

        def keep_reference(ids, e: Exception) -> None:  # those not loaded already
            failed.update({i: e for i in ids if entries[i][0].fn is None and i not in failed})

        todo: dict[Path, list[int]] = {}  # a package to build, and the entries it serves
        by_recipe: dict[str, list[Path]] = {}  # the packages to build, by recipe
        try:
            with _host_lock():  # one process of the host builds, the others load
                for i, (_, recipe, args) in enumerate(entries):
                    path = recipe.path(args)
                    if path.is_file():
                        load(i, path)
                        continue
                    if path not in todo:  # entries of two optimizers of one model share one
                        by_recipe.setdefault(recipe.name, []).append(path)
                    todo.setdefault(path, []).append(i)
                for paths in by_recipe.values():  # one child per recipe
                    if self.closed:
                        break
                    first = [todo[path][0] for path in paths]
                    builds = [(entries[i][2], path) for i, path in zip(first, paths)]

                    def built(k: int, paths=paths) -> None:
                        for i in todo[paths[k]]:
                            load(i, paths[k])

                    try:
                        self._build_in_child(builds, built, recipe=entries[first[0]][1])
                    except Exception as e:  # this recipe's entries keep the reference
                        keep_reference([i for path in paths for i in todo[path]], e)
                    finally:
                        prune_packages(paths[0].parent, keep=list(todo))
        except Exception as e:  # the kernel folder or its lock: every build keeps the reference
            keep_reference([i for ids in todo.values() for i in ids], e)
        if self.closed:  # cut short by the exit
            return
        for i, e in failed.items():
            what, fallback = entries[i][1].what
            warnings.warn(
                f"learned_opt: compiling {what} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); {fallback} (correct, slower)",
                RuntimeWarning,
                stacklevel=1,
            )


#: Seconds a child process may compile one kind of bucket before it is stopped (the
#: reference then keeps stepping that kind).
CHILD_COMPILE_TIMEOUT = 1800
#: How often the compile thread looks for the next package of its child (seconds).
BUILT_POLL_SECONDS = 0.2
#: Seconds the compile thread waits for more jobs before it takes the queue: the kinds of
#: bucket of one step (and of an optimizer's other dtypes) are queued within it, and one
#: child builds them all.
GATHER_SECONDS = 0.5
#: The child's niceness: the training process keeps the cores it needs, and the child
#: builds on the one it yields (:data:`YIELD_THREADS`). Without that, on 2
#: cores busy with training at 2 threads the 0.5M transformer's kernel was ready after
#: 1023 s (``step_overhead_aot.json``); at niceness 0 after 158 s, but training ran at
#: 0.4-0.6 times its speed while gcc compiled, so that it was behind until about 400 s
#: and ahead from then on (steps at 300 s: 5747 against about 6600; at 600 s: 16043
#: against about 13200; one run each).
CHILD_NICE = 10
_CHILD = "import sys; from learned_opt.kernel import compile_job; compile_job(sys.argv[1])"
#: Inductor's environment variable that, at ``1``, trusts the CPU's flags for the vector
#: instruction set of its kernels instead of compiling a probe for each
#: (:meth:`_Worker._build_in_child`).
ISA_ENV = "TORCHINDUCTOR_VEC_ISA_OK"
#: The inductor option that :data:`ISA_ENV` sets, as ``(section, name)``.
ISA_OPTION = ("cpp", "vec_isa_ok")


@contextlib.contextmanager
def _cpu_flags_trusted():
    """Inductor trusts the CPU's flags for its vector instruction set (:data:`ISA_ENV`)
    within, unless the user set :data:`ISA_ENV`. Loading a package asks inductor for the
    instruction set only to warn where it differs from the package's; probing for it
    compiles a program per instruction set (7-8 s on an empty cache) and loads each in a
    new Python process (about 1 s on a warm one). Inductor keeps the answer for the
    process."""
    from torch._inductor import config

    section, option = ISA_OPTION
    if ISA_ENV in os.environ or not hasattr(getattr(config, section, None), option):
        yield  # the user's choice, or a torch without the option: inductor decides
        return
    with config.patch({f"{section}.{option}": True}):
        yield


class _ChildFailed(RuntimeError):
    """A compile child exited with a failure before it built all its packages."""


#: Environment variable naming the folder of the compiled kernels (see :func:`kernel_dir`).
KERNEL_DIR_ENV = "LEARNED_OPT_KERNEL_DIR"


#: The state tensors of a tensor that a kernel reads and writes, in the order it takes them,
#: then ``q`` (a matrix's kept Gram polynomial) where the tensor has one.
STATE_KEYS = ("m", "v", "log_lr", "step")


def state_keys(state: dict) -> tuple[str, ...]:
    """The state tensors of ``state`` that a kernel takes, in order."""
    return STATE_KEYS + (("q",) if "q" in state else ())


def _bucket_args(theta, cfg, parts, params, grads, states, index, lr, decay) -> tuple:
    """The kernel arguments of the tensors ``index``: :func:`step_tensors`'s, with
    ``lr`` and ``decay`` one per tensor."""
    params, grads, states = ([t[i] for i in index] for t in (params, grads, states))
    return theta, cfg, parts, params, grads, states, lr, decay


def _kernel_args(args: tuple) -> tuple:
    """A bucket's arguments (:func:`_bucket_args`) as its kernel takes them: plain
    tensors sharing the parameters' and gradients' memory (as the copies the kernel was
    built on), and of each state the :func:`kernel_state`."""
    theta, cfg, parts, params, grads, states, lr, decay = args
    params, grads = [p.detach() for p in params], [g.detach() for g in grads]
    return theta, cfg, parts, params, grads, [kernel_state(s) for s in states], lr, decay


def kernel_state(state: dict) -> dict:
    """What a kernel steps of a tensor's optimizer state: its :func:`state_keys` and its
    ``sparse_rows`` mark."""
    keys = state_keys(state)
    return {k: state[k] for k in keys} | {"sparse_rows": bool(state.get("sparse_rows"))}


def theta_inputs(theta) -> list[Tensor]:
    """Theta's tensors in the order a kernel takes them: by sorted name."""
    return [theta[name].detach() for name in sorted(theta)]


def flat_inputs(theta: list[Tensor], params, grads, states, lr, decay) -> list[Tensor]:
    """The inputs of a kernel as one list, in the order the package takes them: theta's
    tensors (:func:`theta_inputs`), the parameters, the gradients, each tensor's
    :data:`STATE_KEYS`, then ``lr`` and ``decay`` (one per tensor each). A flat list is
    what the package's loader runs on, so that a call builds no nested structure and
    parses no call spec."""
    out = list(theta)
    out += params
    out += grads
    for s in states:
        out += [s[k] for k in state_keys(s)]
    out.append(lr)
    out.append(decay)
    return out


class _Step(torch.nn.Module):
    """:func:`step_tensors` under one config and parts, as the module that is exported: a
    function of :func:`flat_inputs`'s list (``names``: theta's sorted names; ``sparse``:
    each tensor's ``sparse_rows`` mark, fixed in the kernel)."""

    def __init__(
        self, cfg: NetConfig, parts: Parts, names: list[str], sparse: list[bool], keys: list
    ):
        super().__init__()
        self.cfg, self.parts, self.names, self.sparse = cfg, parts, names, sparse
        self.keys = keys  # each tensor's state_keys

    def forward(self, tensors: list[Tensor]) -> Tensor:
        k, n = len(self.names), len(self.sparse)
        theta = dict(zip(self.names, tensors[:k]))
        params, grads = tensors[k : k + n], tensors[k + n : k + 2 * n]
        rest, states = iter(tensors[k + 2 * n : -2]), []
        for sparse, keys in zip(self.sparse, self.keys):
            states.append({key: next(rest) for key in keys} | {"sparse_rows": sparse})
        lr, decay = tensors[-2:]
        return step_tensors(theta, self.cfg, self.parts, params, grads, states, lr, decay=decay)


def build_package(args: tuple, path: Path) -> None:
    """Export :func:`step_tensors` for the tensors of ``args`` (``torch.export``, their
    shapes, dtypes and strides) and compile it ahead of time into an AOTInductor package
    at ``path`` (:func:`export_package`). The package steps the tensors in place and
    returns their stepped flags."""
    theta, cfg, parts, params, grads, states, lr, decay = args
    with torch.no_grad(), torch.autocast(params[0].device.type, enabled=False):
        sparse = [bool(s.get("sparse_rows")) for s in states]
        module = _Step(cfg, parts, sorted(theta), sparse, [state_keys(s) for s in states])
        inputs = flat_inputs(theta_inputs(theta), params, grads, states, lr, decay)
        export_package(module, inputs, path)


def export_package(module: torch.nn.Module, inputs: list[Tensor], path: Path) -> None:
    """Export ``module``, a function of one flat list of tensors, for ``inputs``
    (``torch.export``: their shapes, dtypes and strides) and compile it ahead of time into
    an AOTInductor package at ``path`` (written under another name, then renamed, so that
    no reader sees half of it)."""
    program = torch.export.export(module, (inputs,))
    partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
    try:
        from torch._inductor import aoti_compile_and_package  # the documented AOT entry

        aoti_compile_and_package(program, package_path=str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_runner(path: Path) -> Callable[[list[Tensor]], list[Tensor]]:
    """The function of a package built by :func:`export_package`: its flat list of
    input tensors to its list of outputs. Loading maps its shared library into this
    process: the package must be this user's and not writable by others
    (:func:`kernel_dir`). A package of this user's that does not load (written by a full
    disk, say) is removed before the error is raised, so that the next run builds it
    again."""
    from torch._inductor import aoti_load_package

    _check_private(path)
    try:
        with _cpu_flags_trusted():  # the load only compares the ISA with the package's
            runner = aoti_load_package(str(path))
    except Exception:
        path.unlink(missing_ok=True)
        raise
    os.utime(path)  # marks it used: prune_packages removes the longest unused first
    # The package's own __call__ parses its call spec (JSON) and flattens its arguments on
    # every call: 0.04-0.06 ms, 15-20% of a small model's kernel call (kernel_call.json).
    # The loader it then runs takes the flat list itself; where a torch has no such
    # loader, the call goes through __call__ (the same list, the same result).
    run = getattr(getattr(runner, "loader", None), "boxed_run", None)
    if run is None:
        return lambda flat: [runner(flat)]
    return run


def load_package(path: Path) -> Callable:
    """The kernel of a package built by :func:`build_package`, as a function of
    :func:`step_tensors`'s arguments (loaded by :func:`load_runner`)."""
    run = load_runner(path)
    last = [None, []]  # theta's dict, and its tensors in order (an optimizer's is cached)

    def kernel(theta, cfg, parts, params, grads, states, lr, decay):
        if theta is not last[0]:
            last[:] = theta, theta_inputs(theta)
        return run(flat_inputs(last[1], params, grads, states, lr, decay))[0]

    return kernel


def package_path(args: tuple) -> Path:
    """The file of the package that steps the tensors of ``args``: its name hashes all
    the kernel depends on (torch's version, this package's source, the names and shapes
    of theta, the bucket's :func:`_signature` with its config, parts, tensors and thread
    count, and the state tensors' dtypes, shapes and strides), so a change of any of
    them builds another."""
    theta, cfg, parts, params, grads, states, lr, decay = args
    _, _, tensors, threads = _signature(cfg, parts, params, grads, states)
    state = [
        sorted((k, (t.dtype, tuple(t.shape), t.stride()) if isinstance(t, Tensor) else t)
               for k, t in s.items())
        for s in states
    ]  # fmt: skip
    key = (
        sorted(cfg.to_dict().items()), tuple(parts),
        [(k, t.dtype, tuple(t.shape)) for k, t in sorted(theta.items())], tensors, state,
        (lr.dtype, decay.dtype, str(lr.device)), threads,
    )  # fmt: skip
    return package_file(key, source_digest(Path(__file__).parent))


def package_file(key, digest: str) -> Path:
    """The package file in :func:`kernel_dir` whose name hashes ``key`` (what a kernel is
    built for), torch's version and ``digest`` (:func:`source_digest` of the code it
    runs)."""
    key = (torch.__version__, digest, key)
    return kernel_dir() / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:40]}.pt2"


class Recipe(NamedTuple):
    """What the compile worker builds for one kind of kernel, and how: the step's
    (:data:`STEP`), or another module's (:func:`register`), whose kernels then share the
    worker, its child process, the host lock and the kernel folder.

    Each function takes the kernel's ``args`` (a tuple of the recipe's own): ``copy``
    copies the tensors to build on (the live ones keep changing); ``payload`` gives what
    the child receives (``torch.save``-able, loaded with ``weights_only``); ``build``
    runs in the child on that payload and writes the package at a path; ``path`` names
    the package (:func:`package_file`); ``load`` loads it as the kernel."""

    name: str  #: its key in the registry
    module: str  #: the module that registers it, imported by the child
    what: tuple[str, str]  #: for a failure's warning: what failed, what runs instead
    copy: Callable[[tuple], tuple]
    payload: Callable[[tuple], dict]
    build: Callable[[dict, Path], None]
    path: Callable[[tuple], Path]
    load: Callable[[Path], Callable]


_RECIPES: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Make ``recipe`` known to the compile worker's child (which imports its module)."""
    _RECIPES[recipe.name] = recipe
    return recipe


def _copy_step(args: tuple) -> tuple:
    theta, cfg, parts, params, grads, states, lr, decay = args
    return (
        theta, cfg, parts,
        [p.detach().clone() for p in params], [g.detach().clone() for g in grads],
        [{k: t.clone() if isinstance(t, Tensor) else t for k, t in s.items()} for s in states],
        lr.clone(), decay.clone(),
    )  # fmt: skip


def _step_payload(args: tuple) -> dict:
    theta, cfg, parts, params, grads, states, lr, decay = args
    return {
        "theta": dict(theta), "cfg": cfg.to_dict(), "parts": list(parts), "params": params,
        "grads": grads, "states": states, "lr": lr, "decay": decay,
    }  # fmt: skip


def _build_step(build: dict, path: Path) -> None:
    args = (
        build["theta"], NetConfig.from_dict(build["cfg"]), Parts(*build["parts"]),
        build["params"], build["grads"], build["states"], build["lr"], build["decay"],
    )  # fmt: skip
    build_package(args, path)


#: The step's kernels (the module's functions, looked up when called).
STEP = register(Recipe(
    "step", __name__, ("the step kernel", "this model keeps the eager reference step"),
    lambda args: _copy_step(args), lambda args: _step_payload(args),
    lambda build, path: _build_step(build, path), lambda args: package_path(args),
    lambda path: load_package(path),
))  # fmt: skip


#: The most packages :func:`prune_packages` leaves in the kernel folder (about 2.5 MB each
#: for a CPU model of 30 tensors): a new build removes the longest unused beyond it.
KEEP_PACKAGES = 64


def prune_packages(
    folder: Path, keep: Sequence[Path] = (), limit: int = KEEP_PACKAGES
) -> list[Path]:
    """Remove the packages of ``folder`` beyond the ``limit`` most recently used (a load
    touches its file), never those in ``keep``; returns the removed paths. Each model,
    torch version and source revision builds packages of its own, and without this they
    would pile up in the folder for good."""
    found = []
    for path in folder.glob("*.pt2"):
        try:
            found.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # removed meanwhile
            continue
    kept = set(keep)
    others = [path for _, path in sorted(found, reverse=True) if path not in kept]
    room = limit - (len(found) - len(others))  # the kept ones take their places
    removed = others[max(room, 0) :]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def _is_built(recipe: Recipe, args: tuple) -> bool:
    """Whether the package of ``recipe`` for ``args`` is on disk already (False where the
    kernel folder cannot be used: the worker's build then says why)."""
    try:
        return recipe.path(args).is_file()
    except OSError:
        return False


@functools.cache
def source_digest(folder: Path) -> str:
    """A hash of the Python sources of ``folder`` (this package's, for the step): a
    kernel built by other code is not used."""
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.py")):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


def kernel_dir() -> Path:
    """The folder of the compiled kernels, shared by this user's processes on the host:
    ``$LEARNED_OPT_KERNEL_DIR``, else ``learned_opt_kernels`` in ``$TORCHINDUCTOR_CACHE_DIR``,
    else ``learned_opt_kernels_<uid>`` in the temporary folder. Created private (``0700``);
    one owned by another user, or writable by others, is refused (``PermissionError``):
    a package there is code this process would run."""
    folder = os.environ.get(KERNEL_DIR_ENV)
    if not folder and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        folder = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "learned_opt_kernels")
    if not folder:
        user = os.getuid() if hasattr(os, "getuid") else "user"
        folder = os.path.join(tempfile.gettempdir(), f"learned_opt_kernels_{user}")
    path = Path(folder)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(path)
    return path


def _check_private(path: Path) -> None:
    """Raise ``PermissionError`` unless ``path`` is this user's and not writable by others
    (POSIX; nothing is checked elsewhere)."""
    if not hasattr(os, "getuid"):
        return
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"{path} is not private to this user (owner uid {info.st_uid}, mode "
            f"{oct(info.st_mode & 0o777)}); set {KERNEL_DIR_ENV} to a folder of your own"
        )


#: The package a job's module must belong to: ``learned_opt``, or the name a copy of it
#: was imported under (``benchmarks/step_ab.py`` imports another revision apart).
_PACKAGE = __name__.rpartition(".")[0]


def compile_job(path: str) -> None:
    """The child of :meth:`_Worker._build_in_child`: its recipe's ``build`` of each saved
    set of tensors in turn (a file it owns; loaded with ``weights_only``), at low priority."""
    job = torch.load(path, weights_only=True)
    if not job["module"].startswith(_PACKAGE + "."):
        raise ValueError(f"not a {_PACKAGE} module: {job['module']!r}")
    _exit_with_parent(job["parent"])
    if hasattr(os, "nice"):
        os.nice(job["nice"])
    torch.set_num_threads(job["threads"])
    importlib.import_module(job["module"])  # registers its recipe
    recipe = _RECIPES[job["recipe"]]
    for build in job["builds"]:
        recipe.build(build, Path(build["out"]))


def _exit_with_parent(parent: int, poll: float = 1.0) -> None:
    """In the child: a daemon thread that ends the process once its parent (process id
    ``parent``) is gone (a training process killed without its exit handlers), instead
    of compiling on for nobody. POSIX: on Windows a process keeps its dead parent's id,
    and the child compiles on until :data:`CHILD_COMPILE_TIMEOUT`."""

    def watch():
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    threading.Thread(target=watch, name="learned-opt-parent-watch", daemon=True).start()


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> _Worker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _Worker()
            atexit.register(_WORKER.close)
        return _WORKER


@contextlib.contextmanager
def _host_lock():
    """An exclusive lock shared by the processes of this host and user that use the same
    :func:`kernel_dir` (``fcntl``; none where that is missing): one of them builds a
    package, the others then load it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: each process compiles for itself
        yield
        return
    with open(kernel_dir() / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
