"""The fused layout of the learned step: two compiled passes per tensor, or per pack.

The same formulas (:mod:`learned_opt.features`), network (:mod:`learned_opt.network`) and
stages (:mod:`learned_opt.stages`) as :func:`learned_opt.flat.flat_step`, for each tensor
seen flat, in three steps:

1. the reduction pass (:func:`~learned_opt._passes.tensor_sums`) of each tensor: the
   masking flag, rms(g), the feature mean squares and mean(v) (nothing is written);
2. the per-tensor stage (:func:`~learned_opt.stages.tensor_context`) once for all tensors,
   which folds each tensor's feature normalisation and context into its first layer;
3. the update pass (:func:`~learned_opt._passes.update_tensor_`) of each tensor: reads p,
   g and the state once, updates the moments, computes the features, the per-element MLP
   and the output stage per element, and writes p and the state once.

Small tensors (biases, norms: at most :data:`PACK_SIZE` elements) are packed into one
vector (:class:`~learned_opt._operands.Pack`), and each pass steps them all in one call,
with per-tensor sums and per-tensor values gathered per element: the calls per step do
not grow with the number of small tensors.

The MLP is evaluated as straight-line math per element
(:func:`~learned_opt.network.element_mlp_rows`), so that inductor (C++ on CPU, Triton on
GPU) turns each pass into one loop over the elements that keeps features and activations
in registers: nothing of size ``F x n`` or ``H x n`` is materialised.

The passes are compiled once per network config (:mod:`learned_opt._compiled`), with
symbolic sizes and the step and scales passed as tensors: a new tensor size, step or lr
never compiles them again (a new parameter dtype does, once). On CPU they are called
without ``torch.compile``'s per-call guard checks, and the kernels run on the calling
thread, except the update pass of a large tensor (:data:`PARALLEL_SIZE`), which takes an
OpenMP team only while :func:`~learned_opt.workers.machine_is_free`. Uncompiled
(``compiled=False``) it is the same math, slow, which the fast tests run. If compiling
fails, the dispatcher (:func:`learned_opt.functional.learned_step`) logs why, once, and
steps with the eager layouts instead.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import Tensor

from ._compiled import compiled_for as _compiled_for
from ._compiled import eager_passes
from ._operands import Pack, operands
from .config import NetConfig
from .features import shape_stats
from .network import Theta, element_layers
from .orthogonal import is_matrix, needs_whole_tensor, ortho_direction
from .workers import machine_is_free

log = logging.getLogger("learned_opt")

#: The update pass of a tensor of at least this many elements runs on an OpenMP team of the
#: caller's threads when the machine is not busy (:func:`machine_is_free`); it is purely
#: elementwise, so the result is bitwise the same either way.
PARALLEL_SIZE = 1 << 15
#: Tensors with fewer elements are not stepped alone (the compiled code never sees sizes 0
#: and 1, which a compiler specialises on); small ones are packed.
MIN_FUSED_SIZE = 16
#: The dispatcher packs tensors of at most this many elements together
#: (:class:`~learned_opt._operands.Pack`); larger ones take a call of each pass. A packed
#: element costs more than one of a tensor of its own (per-tensor sums by ``index_add``,
#: per-tensor values gathered per element, copies in and out), and a call costs about
#: 25 us on CPU, about the time of a thousand packed elements.
PACK_SIZE = 1 << 10


class CompileFailed(RuntimeError):
    """torch.compile could not build the fused step; the eager layouts take over."""


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
    those, they are packed into one vector (:class:`~learned_opt._operands.Pack`) and each pass steps them all in
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
    whole = [tuple(p.shape) for p in params if not fuses_whole(cfg, p.shape)]
    if whole:
        raise ValueError(
            f"tensors of shapes {whole} need their whole tensor in the output stage "
            f"(output={cfg.output!r}, normalize={cfg.normalize}); the fused pass cannot step them"
        )
    small = [
        i for i, p in enumerate(params)
        if 0 < p.numel() <= small_tensor_size and not is_matrix(tuple(p.shape), cfg)
    ]  # fmt: skip
    small = small if len(small) > 1 and all(packable(params[i]) for i in small) else []
    large = [i for i in range(len(params)) if i not in set(small)]
    like = states[0]["v"]
    flat = [operands(params[i], grads[i], states[i]) for i in large]
    pack = Pack.of([params[i] for i in small], [states[i] for i in small]) if small else None
    if compiled and _failure:
        raise _failed({})
    passes = _compiled_for(cfg) if compiled else eager_passes(cfg)
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
        # every row: a skipped tensor's values stay in its own row, which is never used
        step_t, lr_t = (torch.tensor(float(x), dtype=torch.float64) for x in (step, lr))
        step_t, lr_t = step_t.to(like.device), lr_t.to(like.device)
        stats = shape_stats([params[i].shape for i in order], cfg, like)
        log_lr, numel = sums[:, 0], sums[:, 0]  # not read unless the config adapts log_lr
        if cfg.adapts_lr:  # written to the states as each tensor is stepped
            log_lr = torch.stack([states[i]["log_lr"] for i in order])
            numel = torch.tensor([float(params[i].numel()) for i in order], dtype=like.dtype)
        scales, bias, scale, log_lr = passes.tables(theta, sums, stats, log_lr, numel, step_t, lr_t)
        log_lr = log_lr if cfg.adapts_lr else None
        todo = [(j, i) for j, i in enumerate(large) if oks[j]]
        if todo:
            layers = element_layers(theta, cfg, like.dtype, bias.unsqueeze(-1), scales)
            _update_each(passes, cfg, layers, todo, flat, params, states, sums, scale, step_t,
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


def fuses_whole(cfg: NetConfig, shape) -> bool:
    """Whether :func:`fused_step_` can step a tensor of ``shape`` under ``cfg``: every
    tensor but those whose output stage needs the whole tensor, except "ortho" matrices
    (their direction pass, then Newton-Schulz on the whole matrix)."""
    return not needs_whole_tensor(cfg, shape) or is_matrix(tuple(shape), cfg)


def _update_each(passes, cfg, layers, todo, flat, params, states, sums, scale, step_t,
                 log_lr, threads, done) -> None:  # fmt: skip
    """The update pass of each large tensor ``i`` (row ``j``) in ``todo``: those of at
    least :data:`PARALLEL_SIZE` elements first, under one change of the thread count. An
    "ortho" matrix takes the direction pass, and then (with the others of its shape or of
    its transposed shape, in one batch taken wide, before the thread count changes back)
    Newton-Schulz and its step."""
    (w1, b1), *shared = layers
    # per row: views on CPU (the standalone-compiled passes take any offset), copies for
    # torch.compile elsewhere (a view of a batch would be guarded on the batch's size)
    w1, b1, g_rms, scale, m1_ms = (t.unbind(0) for t in (w1, b1, sums[:, 1], scale, sums[:, -1]))
    own = (lambda t: t) if sums.device.type == "cpu" else torch.clone
    big = {j: threads > 1 and params[i].numel() >= PARALLEL_SIZE for j, i in todo}
    for use_team in (True, False):
        now = [(j, i) for j, i in todo if big[j] == use_team]
        if not now:
            continue
        fn = passes.update_threaded if use_team else passes.update
        matrix_fn = passes.direction_threaded if use_team else passes.direction
        matrices: dict[tuple, list] = {}  # wide shape -> [(i, j, z, magnitude, wide)]
        with _threads(threads) if use_team else contextlib.nullcontext():
            for j, i in now:
                layers = ((own(w1[j]), own(b1[j])), *shared)
                shape = tuple(params[i].shape)
                if is_matrix(shape, cfg):
                    z, magnitude = torch.empty_like(flat[j][5]), torch.empty_like(flat[j][5])
                    matrix_fn(layers, *flat[j], own(g_rms[j]), own(scale[j]), own(m1_ms[j]),
                              z, magnitude)  # fmt: skip
                    wide = shape[0] <= shape[1]  # Newton-Schulz takes a tall one transposed
                    z = z if wide else z.view(shape).t().reshape(-1)
                    matrices.setdefault(tuple(sorted(shape)), []).append((i, j, z, magnitude, wide))
                    continue
                fn(layers, *flat[j], own(g_rms[j]), own(scale[j]), step_t)
                _stepped(params, states, log_lr, i, j, done)
            # the matrices whose state this loop wrote: stepped before another pass could
            # fail to compile (a fallback then steps only the tensors not ``done``)
            for shape, batch in matrices.items():
                directions = ortho_direction(cfg, shape, torch.stack([b[2] for b in batch]))
                for (i, j, _, magnitude, wide), direction in zip(batch, directions):
                    direction = direction if wide else direction.view(shape).t().reshape(-1)
                    p = flat[j][0]
                    if p.dtype == direction.dtype:
                        p.addcmul_(direction, magnitude)
                    else:
                        p.copy_(torch.addcmul(p.to(direction.dtype), direction, magnitude))
                    _stepped(params, states, log_lr, i, j, done)


def _stepped(params, states, log_lr, i: int, j: int, done: dict) -> None:
    """Tensor ``i`` (row ``j``) was written: its version, its adapted log step size."""
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


def _failed(done: dict) -> CompileFailed:
    err = CompileFailed(_failure[0])
    err.done = done
    return err


def _is_compile_error(e: Exception) -> bool:
    """Errors that tracing and compiling raise while building code (not the step's own
    errors): torch.compile's, inductor's, and make_fx's with its fake tensors."""
    names = {"BackendCompilerFailed", "InductorError", "CppCompileError", "TorchRuntimeError"}
    return type(e).__name__ in names or type(e).__module__.startswith(
        ("torch._dynamo", "torch._inductor", "torch.fx", "torch._subclasses", "torch._functorch")
    )
