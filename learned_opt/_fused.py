"""The fused layout of the learned step: two compiled passes per tensor.

The same formulas (:mod:`learned_opt.features`), network (:mod:`learned_opt.network`) and
stages (:mod:`learned_opt.stages`) as :func:`learned_opt.flat.flat_step`, for each tensor
seen flat, in three steps:

1. :func:`tensor_sums`, the reduction pass: reads p, g and the state, and returns the
   masking flag, rms(g), the feature mean squares and mean(v) (nothing is written);
2. the per-tensor stage (:func:`~learned_opt.stages.tensor_context`) once for all tensors,
   which folds each tensor's feature normalisation and context into its first layer;
3. :func:`update_tensor_`, the update pass: reads p, g and the state once, updates the
   moments, computes the features, the per-element MLP and the output stage per element,
   and writes p and the state once.

The MLP is evaluated as straight-line math per element
(:func:`~learned_opt.network.element_mlp_rows`), so that ``torch.compile`` (inductor: C++ on
CPU, Triton on GPU) turns each pass into one loop over the elements that keeps features
and activations in registers: nothing of size ``F x n`` or ``H x n`` is materialised.

Both passes are compiled once per network config, with dynamic sizes and the step and
scales passed as tensors: a new tensor size, step or lr never recompiles them (a new
parameter dtype does, once). On CPU the kernels run on the calling thread
(:data:`COMPILE_OPTIONS`): no OpenMP team that a busy core could stall. Uncompiled
(``compiled=False``) it is the same math, slow, which the fast tests run. If compiling
fails, the dispatcher (:func:`learned_opt.functional.learned_step`) logs why, once, and
steps with the eager layouts instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .config import NetConfig
from .features import adapt_log_lr, feature_rows, safe_sqrt, stepped, update_moments
from .network import Layers, Theta, element_layers, element_mlp_rows
from .orthogonal import needs_whole_tensor
from .stages import apply_update, tensor_context
from .workers import machine_is_free

log = logging.getLogger("learned_opt")

#: The update pass of a tensor of at least this many elements runs on an OpenMP team of the
#: caller's threads when the machine is not busy (:func:`machine_is_free`); it is purely
#: elementwise, so the result is bitwise the same either way.
PARALLEL_SIZE = 1 << 15
#: Tensors with fewer elements take the other layouts (and the compiled code never sees
#: sizes 0 and 1, which torch.compile would specialise on).
MIN_FUSED_SIZE = 16
#: Tensors of at most this many elements are packed together (:class:`_Pack`) by the
#: dispatcher; larger ones take a call of each pass. A packed element costs more than one
#: of a tensor of its own (per-tensor sums by ``index_add``, per-tensor values gathered per
#: element, copies in and out); a call costs about 50 us, the time of a few thousand
#: packed elements.
PACK_SIZE = 1 << 10


def tensor_sums(
    p: Tensor,
    g: Tensor,
    m0: Tensor,
    m1: Tensor,
    m2: Tensor,
    v: Tensor,
    cfg: NetConfig,
    seg: Tensor | None = None,
    sizes: Tensor | None = None,
) -> Tensor:
    """The reduction pass of one tensor: ``(14,)`` = whether it is stepped (1 or 0), rms(g),
    the mean squares of the 11 features after this step's moment update, and mean(v); when
    ``cfg`` adapts step sizes, ``(17,)``: then ``g . m1`` and ``m1^2`` (the 0.9 momentum
    before the update) and ``g^2``, the sums :func:`~learned_opt.features.adapt_log_lr` reads.

    ``p`` and ``g`` are ``[n]`` in any floating dtype, the momentum rows ``m0, m1, m2`` and
    ``v`` ``[n]`` in the compute dtype; nothing is written. Where the gradient or the
    parameter holds NaN or Inf, the first entry is 0 (the tensor is skipped; the rest is
    then meaningless).

    With ``seg`` (``[n]``: the index of each element's tensor) and ``sizes`` (``[T]``: the
    tensors' sizes, in the compute dtype), the elements are ``T`` small tensors packed
    (:class:`_Pack`): the same sums per tensor, ``(T, 14)`` (or ``(T, 17)``).
    """
    dtype = v.dtype
    p_c, g_c = p.to(dtype), g.to(dtype)
    dot, mean, at = _reductions(seg, sizes)
    count = v.shape[-1] if sizes is None else sizes
    g_ss, p_ss = dot(g_c, g_c), dot(p_c, p_c)
    ok = stepped(g_ss, p_ss)
    m_new, v_new = update_moments(g_c, (m0, m1, m2), v)
    g_rms = safe_sqrt(g_ss / count)
    rows = feature_rows(p_c, g_c, m_new, v_new, at(g_rms), cfg)
    ms = torch.stack([mean(r * r) for r in rows], dim=-1)
    out = [torch.stack([ok.to(dtype), g_rms], dim=-1), ms, mean(v_new).unsqueeze(-1)]
    if cfg.adapts_lr:
        out.append(torch.stack([dot(g_c, m0), dot(m0, m0), g_ss], dim=-1))
    return torch.cat(out, dim=-1)


def _reductions(seg: Tensor | None, sizes: Tensor | None):
    """``(dot, mean, at)`` over one tensor (``seg`` None), or per tensor of the packed ones:
    ``dot(x, y)`` the sum of ``x * y``, ``mean(x)`` and ``at(t)``, which takes per-tensor
    values (``[..., T]``) to the elements (``[..., n]``). Per tensor the sums are
    ``index_add`` in element order (on the one thread of the compiled pass: repeatable)."""
    if seg is None:
        return torch.dot, torch.mean, lambda t: t

    def total(x: Tensor) -> Tensor:
        return torch.zeros_like(sizes).index_add(0, seg, x)

    return (lambda x, y: total(x * y)), (lambda x: total(x) / sizes), (lambda t: t[..., seg])


def update_tensor_(
    layers: Layers,
    p: Tensor,
    g: Tensor,
    m0: Tensor,
    m1: Tensor,
    m2: Tensor,
    v: Tensor,
    g_rms: Tensor,
    scale: Tensor,
    step: Tensor,
    cfg: NetConfig,
    scales: Tensor | None = None,
    keep: Tensor | None = None,
) -> None:
    """The update pass of one tensor, in place: read p, g, m and v once; update the
    moments, compute the features, the per-element MLP (``layers`` of the tensor, its
    feature normalisation and context folded in) and the output stage per element; write
    p, m and v once. ``g_rms``, ``scale`` (the step scale) and ``step`` are 0-d tensors.

    The momenta come as their three rows ``m0, m1, m2`` (``[n]`` each) and every formula
    is applied row by row, so that each op has the shape ``[n]`` and inductor fuses the
    whole pass into one loop that writes each row directly (a ``[3, n]`` intermediate
    would cost a loop of its own and a buffer of ``3n`` floats). The compiled caller
    passes rows that do not share a storage object (:func:`_operands`); rows of one storage
    would make the compiler treat the three writes as overlapping and copy through
    buffers.

    For packed tensors (:func:`update_packed_`) the per-tensor values come per element:
    ``g_rms``, ``scale`` and ``keep`` (where to write) ``[n]``, the first layer's bias
    ``(H, n)`` and the feature normalisers ``scales`` (``(11, n)``), which the first layer
    then does not fold in."""
    dtype = v.dtype
    p_c, g_c = p.to(dtype), g.to(dtype)
    m_new, v_new = update_moments(g_c, (m0, m1, m2), v)
    rows = feature_rows(p_c, g_c, m_new, v_new, g_rms, cfg)
    if scales is not None:
        rows = [r * s for r, s in zip(rows, scales.unbind(0))]
    d, log_mag = element_mlp_rows(layers, rows)
    new_p = apply_update(cfg, p_c, d, log_mag, m_new[0], v_new, step, scale)
    if keep is not None:  # a packed tensor that is skipped keeps its values
        new_p = torch.where(keep, new_p, p_c)
        m_new = [torch.where(keep, new, old) for new, old in zip(m_new, (m0, m1, m2))]
        v_new = torch.where(keep, v_new, v)
    p.copy_(new_p)
    for row, new in zip((m0, m1, m2), m_new):
        row.copy_(new)
    v.copy_(v_new)


def update_packed_(
    layers: Layers,
    p: Tensor,
    g: Tensor,
    m0: Tensor,
    m1: Tensor,
    m2: Tensor,
    v: Tensor,
    seg: Tensor,
    g_rms: Tensor,
    scale: Tensor,
    scales: Tensor,
    ok: Tensor,
    step: Tensor,
    cfg: NetConfig,
) -> None:
    """The update pass (:func:`update_tensor_`) of ``T`` small tensors packed into ``[n]``
    vectors (:class:`_Pack`), in place. Per-tensor values are tables that ``seg`` (``[n]``)
    indexes per element: ``g_rms``, ``scale`` and ``ok`` (whether to step) ``[T]``, the
    feature normalisers ``scales`` ``(11, T)`` and the first layer's bias ``(H, T)`` in
    ``layers``, whose first weight does not fold the normalisers in."""
    (w1, b1), *shared = layers
    at = _reductions(seg, None)[2]
    own = ((w1, at(b1)), *shared)
    update_tensor_(own, p, g, m0, m1, m2, v, at(g_rms), at(scale), step, cfg, at(scales), at(ok))


class CompileFailed(RuntimeError):
    """torch.compile could not build the fused step; the eager layouts take over."""


_lock = threading.Lock()
_compiled: dict[NetConfig, object] = {}
_failure: list[str] = []  # why compilation failed, once it did
_announced: set[tuple] = set()


def compile_failure() -> str | None:
    """Why the fused step could not be compiled in this process, or None."""
    return _failure[0] if _failure else None


def announce(path: str, device: torch.device, why: str = "") -> None:
    """Log, once per process for each path and device type, which path steps there."""
    key = (path, torch.device(device).type)
    if key in _announced:
        return
    _announced.add(key)
    text = {
        "fused": "fused step, compiled with torch.compile (inductor)",
        "eager": "eager chunked/packed step",
    }[path]
    level = logging.WARNING if why else logging.INFO
    log.log(level, "learned_opt: %s on %s%s", text, key[1], f" ({why})" if why else "")


#: Inductor options: kernels run on the calling thread (no OpenMP team whose barriers
#: would wait for a core that another process holds), and multiply-adds contract to FMAs.
COMPILE_OPTIONS = {"cpp.threads": 1, "cpp.enable_floating_point_contract_flag": "fast"}


def _compiled_for(cfg: NetConfig):
    """The passes compiled for ``cfg`` (built once per config, dynamic sizes): the reduction
    and update passes of one tensor, the update pass on an OpenMP team, and the reduction
    and update passes of packed small tensors."""
    with _lock:
        if cfg not in _compiled:

            def sums(p, g, m0, m1, m2, v, _cfg=cfg):
                return tensor_sums(p, g, m0, m1, m2, v, _cfg)

            def update(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg=cfg):
                update_tensor_(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg)

            def update_threaded(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg=cfg):
                update_tensor_(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg)

            def sums_packed(p, g, m0, m1, m2, v, seg, sizes, _cfg=cfg):
                return tensor_sums(p, g, m0, m1, m2, v, _cfg, seg, sizes)

            def update_packed(layers, p, g, m0, m1, m2, v, seg, g_rms, scale, scales, ok, step,
                              _cfg=cfg):  # fmt: skip
                update_packed_(layers, p, g, m0, m1, m2, v, seg, g_rms, scale, scales, ok, step,
                               _cfg)  # fmt: skip

            single = {**COMPILE_OPTIONS}
            threaded = {**COMPILE_OPTIONS, "cpp.threads": -1}  # the caller's thread count
            n, scalar, static = ("n",), (), (None, None)
            rows = (n,) * 6  # p, g, m0, m1, m2, v
            layers = (static,) * 6  # w1, b1, the hidden and the output layer
            one = (*layers, *rows, scalar, scalar, scalar)  # g_rms, scale, step
            _compiled[cfg] = _Passes(
                _Pass(sums, single, rows),
                _Pass(update, single, one, layered=True),
                _Pass(update_threaded, threaded, one, layered=True),
                _Pass(sums_packed, single, (*rows, n, ("T",))),  # seg, sizes
                _Pass(
                    update_packed, single, layered=True,
                    dims=(static, (None, "T"), *layers[2:], *rows, n, ("T",), ("T",), (None, "T"),
                          ("T",), scalar),  # seg, g_rms, scale, scales, ok, step
                ),
            )  # fmt: skip
        return _compiled[cfg]


class _Pass:
    """One pass of :func:`fused_step_`, compiled on its first call for each device type and
    argument dtypes, with symbolic sizes: a new size, step or lr never compiles again.

    On CPU the pass is traced to a graph (``make_fx``) and compiled by inductor's
    ``standalone_compile``; the result is called directly, without the frame evaluation
    and guard checks of ``torch.compile``, which cost about 30 us a call (the compiled call
    itself about 25 us). So nothing checks at a call what the graph assumed, and the graph
    is traced on stand-in arguments that let it assume nothing it should not: ``dims``
    names, per argument and dim, the sizes that vary (``"n"``: elements, ``"T"``: packed
    tensors; None: a size fixed by ``cfg``), and the stand-ins give them primes above every
    fixed size, so no varying size is taken for another or for a constant. Inductor's generated code still checks every fixed size and stride. Dtypes
    and the device type are part of the key. Elsewhere (GPU) the pass goes through
    ``torch.compile(dynamic=True)``, whose guards check it all. ``layered``: the first
    argument is the MLP's layers (pairs of tensors), passed on as flat tensors.
    """

    def __init__(self, fn: Callable, options: dict, dims: tuple, layered: bool = False):
        self.fn, self.options, self.dims, self.layered = fn, options, dims, layered
        self.pairs = 0  # the number of layers (set by the first layered call)
        self.built: dict[tuple, Callable] = {}

    def __call__(self, *args):
        if self.layered:
            layers, *rest = args
            self.pairs = len(layers)
            args = (*(t for pair in layers for t in pair), *rest)
        key = (args[0].device.type, self.pairs, *(a.dtype for a in args))
        run = self.built.get(key)
        if run is None:
            with _lock:
                run = self.built.get(key) or self._build(key, args)
        return run(*args)[0]

    def flat(self, *args) -> list[Tensor]:
        """The pass on flat tensors (the layers' tensors first); returns ``[its output]``,
        or ``[0-d tensor]`` for a pass that only writes (a compiled graph returns tensors)."""
        if self.layered:
            k = 2 * self.pairs
            out = self.fn(tuple(zip(args[0:k:2], args[1:k:2])), *args[k:])
        else:
            out = self.fn(*args)
        return [args[-1].new_zeros(()) if out is None else out]

    def _build(self, key: tuple, args: tuple) -> Callable:
        if key[0] != "cpu":
            run = torch.compile(self.flat, dynamic=True, options=self.options)
        else:
            from torch.fx.experimental.proxy_tensor import make_fx

            if len(args) != len(self.dims):
                raise ValueError(f"{len(args)} arguments for a pass of {len(self.dims)}")
            fixed = [s for a, dims in zip(args, self.dims) for d, s in zip(dims, a.shape) if not d]
            sizes = {"T": _prime_above(max(fixed, default=16))}
            sizes["n"] = _prime_above(4 * sizes["T"])
            stand_ins = [
                torch.zeros([sizes.get(d, s) for d, s in zip(dims, a.shape)], dtype=a.dtype)
                for a, dims in zip(args, self.dims)
            ]
            graph = make_fx(self.flat, tracing_mode="symbolic")(*stand_ins)
            run = torch._inductor.standalone_compile(
                graph, stand_ins, dynamic_shapes="from_graph",
                options={"config_patches": self.options},
            )  # fmt: skip
        self.built[key] = run
        return run


def _prime_above(k: int) -> int:
    """The smallest prime above ``k``."""
    k += 1
    while any(k % d == 0 for d in range(2, math.isqrt(k) + 1)):
        k += 1
    return k


class _Passes(NamedTuple):
    """The passes of :func:`fused_step_`, compiled (:func:`_compiled_for`) or not."""

    sums: Callable
    update: Callable
    update_threaded: Callable
    sums_packed: Callable
    update_packed: Callable


def _eager_passes(cfg: NetConfig) -> _Passes:
    """The same passes uncompiled (``compiled=False``)."""

    def sums_packed(p, g, m0, m1, m2, v, seg, sizes):
        return tensor_sums(p, g, m0, m1, m2, v, cfg, seg, sizes)

    sums = functools.partial(tensor_sums, cfg=cfg)
    update = functools.partial(update_tensor_, cfg=cfg)
    return _Passes(sums, update, update, sums_packed, functools.partial(update_packed_, cfg=cfg))


def fusable(p: Tensor) -> bool:
    """Whether :func:`fused_step_` steps ``p`` (large enough, contiguous)."""
    return p.numel() >= MIN_FUSED_SIZE and p.is_contiguous()


def packable(p: Tensor) -> bool:
    """Whether :func:`fused_step_` can step ``p`` packed with other small tensors
    (contiguous, not empty)."""
    return p.numel() > 0 and p.is_contiguous()


@torch.no_grad()
def fused_step_(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: int,
    lr: float = 1.0,
    *,
    compiled: bool = True,
    threads: int = 1,
    small_tensor_size: int = 0,
) -> list[bool]:
    """The learned step of many tensors, in place: per tensor the reduction pass, then the
    per-tensor stage for all tensors at once, then per tensor the update pass.

    ``params`` share a device and a compute dtype (theta's and the states'); each is
    contiguous with at least :data:`MIN_FUSED_SIZE` elements (:func:`fusable`), or has at
    most ``small_tensor_size`` elements (:func:`packable`): if there are at least two of
    those, they are packed into one vector (:class:`_Pack`) and each pass steps them all in
    one call, with per-tensor sums and per-tensor values gathered per element. Returns,
    per tensor, False where the gradient or the parameter was not finite and nothing
    changed. With ``compiled`` the passes are the ``torch.compile``d ones; if compiling
    fails, :class:`CompileFailed` is raised with ``done``: ``{index: flag}`` of the tensors
    already stepped or skipped (the others are unchanged). ``threads``: the intra-op threads
    the update pass of a large tensor may use (:data:`PARALLEL_SIZE`); the rest runs on the
    calling thread.
    """
    if not params:
        return []
    whole = [tuple(p.shape) for p in params if needs_whole_tensor(cfg, p.shape)]
    if whole:
        raise ValueError(
            f"tensors of shapes {whole} need their whole tensor in the output stage "
            f"(output={cfg.output!r}, normalize={cfg.normalize}); the fused pass cannot step them"
        )
    small = [i for i, p in enumerate(params) if 0 < p.numel() <= small_tensor_size]
    small = small if len(small) > 1 and all(packable(params[i]) for i in small) else []
    large = [i for i in range(len(params)) if i not in set(small)]
    like = states[0]["v"]
    flat = [_operands(params[i], grads[i], states[i]) for i in large]
    pack = _Pack.of([params[i] for i in small], [states[i] for i in small]) if small else None
    if compiled and _failure:
        raise _failed({})
    passes = _compiled_for(cfg) if compiled else _eager_passes(cfg)
    if threads > 1 and any(params[i].numel() >= PARALLEL_SIZE for i in large):
        threads = threads if machine_is_free(threads) else 1
    order = large + small  # the rows of the per-tensor tables
    done: dict[int, bool] = {}
    try:
        parts = [torch.stack([passes.sums(*f) for f in flat])] if flat else []
        if pack is not None:
            packed = pack.operands([grads[i] for i in small])
            parts.append(passes.sums_packed(*packed[:6], pack.seg, pack.sizes))
        sums = torch.cat(parts) if len(parts) > 1 else parts[0]
        oks = (sums[:, 0] > 0).tolist()  # one sync
        flags = [False] * len(params)
        for i, ok in zip(order, oks):
            flags[i] = ok
        done.update((i, False) for i, ok in zip(order, oks) if not ok)
        if not any(oks):
            return flags
        log_lr = None
        if cfg.adapts_lr:  # written to the states as each tensor is stepped
            old = torch.stack([states[i]["log_lr"] for i in order])
            numel = torch.tensor([float(params[i].numel()) for i in order], dtype=like.dtype)
            log_lr = adapt_log_lr(
                old, sums[:, 14], sums[:, 16], sums[:, 15], sums[:, 13], numel, step, cfg
            )
        # every row: a skipped tensor's values stay in its own row, which is never used
        scales, bias, scale = tensor_context(
            theta, cfg, sums[:, 2:13], sums[:, 13], [params[i].shape for i in order], step, lr,
            log_lr,
        )  # fmt: skip
        step_t = torch.tensor(float(step), dtype=torch.float64, device=like.device)
        todo = [(j, i) for j, i in enumerate(large) if oks[j]]
        if todo:
            layers = element_layers(theta, cfg, like.dtype, bias.unsqueeze(-1), scales)
            _update_each(passes, layers, todo, flat, params, states, sums, scale, step_t,
                         log_lr, threads, done)  # fmt: skip
        if pack is not None and any(oks[len(large) :]):
            rows = slice(len(large), None)
            layers = element_layers(theta, cfg, like.dtype, bias[rows].T.contiguous())
            ok = sums[rows, 0] > 0
            passes.update_packed(layers, *packed[:6], pack.seg, sums[rows, 1].contiguous(),
                                 scale[rows].contiguous(), scales[rows].T.contiguous(), ok,
                                 step_t)  # fmt: skip
            pack.write_back(packed, None if log_lr is None else log_lr[rows], ok,
                            [states[i] for i in small])  # fmt: skip
            done.update((i, flags[i]) for i in small)
    except Exception as e:  # a compiler missing or failing: fall back, once
        if not compiled or not _is_compile_error(e):
            raise
        _failure.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise _failed(done) from e
    return flags


def _update_each(passes, layers, todo, flat, params, states, sums, scale, step_t, log_lr,
                 threads, done) -> None:  # fmt: skip
    """The update pass of each large tensor ``i`` (row ``j``) in ``todo``: those of at
    least :data:`PARALLEL_SIZE` elements first, under one change of the thread count."""
    (w1, b1), *shared = layers
    # per row: views on CPU (the standalone-compiled passes take any offset), copies for
    # torch.compile elsewhere (a view of a batch would be guarded on the batch's size)
    w1, b1, g_rms, scale = (t.unbind(0) for t in (w1, b1, sums[:, 1], scale))
    own = (lambda t: t) if sums.device.type == "cpu" else torch.clone
    big = {j: threads > 1 and params[i].numel() >= PARALLEL_SIZE for j, i in todo}
    for use_team in (True, False):
        now = [(j, i) for j, i in todo if big[j] == use_team]
        if not now:
            continue
        fn = passes.update_threaded if use_team else passes.update
        with _threads(threads) if use_team else contextlib.nullcontext():
            for j, i in now:
                layers = ((own(w1[j]), own(b1[j])), *shared)
                fn(layers, *flat[j], own(g_rms[j]), own(scale[j]), step_t)
                torch.autograd.graph.increment_version(params[i])  # written via an alias
                if log_lr is not None:
                    states[i]["log_lr"].copy_(log_lr[j])
                done[i] = True


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: ``id(state["m"]) -> (weakref to m, key, (p, m0, m1, m2, v))``: each tensor's flat
#: operands, built once (:func:`_operands`); an entry goes when its ``m`` is freed.
_operand_cache: dict[int, tuple] = {}


def _operands(p: Tensor, g: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """``(p, g, m0, m1, m2, v)`` of one tensor, each ``[n]`` on the tensor's memory.

    The momentum rows are tensors on storage objects of their own (through DLPack, on the
    same memory): they do not overlap, and so the compiler may write all three in the
    update pass's one loop (rows of one storage object are treated as aliases that might
    overlap, and the writes then go through copies). Built once per tensor and cached
    while the parameter, ``m`` and ``v`` keep their memory; only ``g`` is aliased anew.
    """
    m, v = state["m"], state["v"]
    key = (p.data_ptr(), m.data_ptr(), v.data_ptr(), id(p), id(v), p.dtype, p.numel())
    hit = _operand_cache.get(id(m))
    if hit is None or hit[0]() is not m or hit[1] != key:
        rows = tuple(torch.from_dlpack(row.detach().reshape(-1)) for row in m.unbind(0))
        ops = (_alias(p, -1), *rows, _alias(v, -1))
        _operand_cache[id(m)] = hit = (weakref.ref(m, _forget(id(m))), key, ops)
    p_flat, m0, m1, m2, v_flat = hit[2]
    return p_flat, _alias(g, -1), m0, m1, m2, v_flat


class _Pack:
    """Small tensors packed for :func:`fused_step_`: each operand as one ``[n]`` vector, the
    segment index of each element (``seg``) and the tensors' sizes (``sizes``).

    Built once per set of tensors (:meth:`of`) and cached while their parameters and states
    keep their memory (the flat views that the results are copied back into hold it);
    each step then copies the tensors in (:meth:`operands`) and back (:meth:`write_back`)
    with a few calls whatever their number."""

    def __init__(self, params: list[Tensor], states: list[dict[str, Tensor]]):
        like = states[0]["v"]
        self.dtype, self.numels = like.dtype, [p.numel() for p in params]
        counts = torch.tensor(self.numels, device=like.device)
        self.seg = torch.arange(len(params), device=like.device).repeat_interleave(counts)
        self.sizes = counts.to(like.dtype)
        self.params = [p.detach().view(-1) for p in params]
        self.m = [s["m"].view(3, -1) for s in states]
        self.v = [s["v"].view(-1) for s in states]

    @classmethod
    def of(cls, params: list[Tensor], states: list[dict[str, Tensor]]) -> _Pack:
        key = tuple(
            (p.data_ptr(), p.numel(), p.dtype, s["m"].data_ptr(), s["v"].data_ptr())
            for p, s in zip(params, states)
        )
        pack = _packs.get(key)
        if pack is None:
            while len(_packs) >= MAX_PACKS:
                _packs.pop(next(iter(_packs)))
            pack = _packs[key] = cls(params, states)
        return pack

    def operands(self, grads: list[Tensor]) -> tuple[Tensor, ...]:
        """``(p, g, m0, m1, m2, v, m)`` packed, in the compute dtype (copies); the momentum
        rows each on a storage of its own (as :func:`_operands`), on the memory of ``m``
        (``[3, n]``)."""
        p = torch.cat(self.params).to(self.dtype)
        g = torch.cat([g.reshape(-1) for g in grads]).to(self.dtype)
        m = torch.cat(self.m, dim=1)
        return (p, g, *(torch.from_dlpack(row) for row in m.unbind(0)), torch.cat(self.v), m)

    def write_back(self, packed, log_lr: Tensor | None, ok: Tensor, states) -> None:
        """Copy the stepped ``packed`` operands back into the tensors and states, and
        ``log_lr`` (``[T]``) into the states of the tensors stepped (``ok``)."""
        p, v, m = packed[0], packed[5], packed[6]  # m: the memory of the rows
        dst = [*self.params, *self.m, *self.v]
        src = [*p.split(self.numels), *m.split(self.numels, 1), *v.split(self.numels)]
        if log_lr is not None:
            dst += [s["log_lr"] for s in states]
            src += list(torch.where(ok, log_lr, torch.stack(dst[-len(states) :])).unbind())
        torch._foreach_copy_(dst, src)


#: At most this many sets of packed tensors are cached (:class:`_Pack`).
MAX_PACKS = 4
_packs: dict[tuple, _Pack] = {}


def _forget(key: int):
    """The weakref callback that drops the cache entry ``key`` (and the memory it holds)."""
    return lambda _: _operand_cache.pop(key, None)


def _alias(t: Tensor, *shape: int) -> Tensor:
    """``t`` reshaped to ``shape`` as a new tensor on the same memory, not a view: the
    compiled code would otherwise guard on the rank of the view's base and compile again
    for every rank. A non-contiguous ``t`` (a gradient) is copied."""
    t = t.detach()
    if not t.is_contiguous():
        return t.reshape(shape)
    shape = tuple(t.numel() // 3 if (d == -1 and len(shape) == 2) else d for d in shape)
    shape = (t.numel(),) if shape == (-1,) else shape
    strides = (shape[1], 1) if len(shape) == 2 else (1,)
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), shape, strides)


def _failed(done: dict) -> CompileFailed:
    err = CompileFailed(_failure[0])
    err.done = done
    return err


def _is_compile_error(e: Exception) -> bool:
    """Errors that torch.compile raises while building code (not the step's own errors)."""
    names = {"BackendCompilerFailed", "InductorError", "CppCompileError", "TorchRuntimeError"}
    return type(e).__name__ in names or type(e).__module__.startswith(
        ("torch._dynamo", "torch._inductor")
    )
