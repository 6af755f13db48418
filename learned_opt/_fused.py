"""The fused layout of the learned step: one compiled pass per tensor.

:func:`fused_tensor_step_` composes the same formulas (:mod:`learned_opt.features`),
network (:mod:`learned_opt.network`) and stages (:mod:`learned_opt.stages`) as
:func:`learned_opt.flat.flat_step`, for one tensor seen flat, and writes the new
parameter and state in place. The per-element MLP is evaluated as straight-line math per
element (:func:`~learned_opt.network.element_mlp_rows`), so that ``torch.compile``
(inductor: C++ and OpenMP on CPU, Triton on GPU) turns the whole step into a few loops
over the elements: the sums of squares of g and p (the masking rule and rms(g)); the
moments and the feature statistics; the per-tensor network; and one pass that reads p, g
and the state, computes features, MLP and update in registers, and writes p and the
state once. Nothing of size ``F x n`` or ``H x n`` is materialised.

The function is compiled once per network config, with dynamic sizes, and step, lr and
the tensor's shape statistics passed as tensors: a new tensor size, step or lr never
recompiles it (a new parameter or state dtype does, once). Eagerly (``compiled=False``)
it is the same math, slow, used by the fast tests. If compilation fails, the dispatcher
(:func:`learned_opt.functional.learned_step`) logs why, once, and steps with the eager
layouts instead.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import Tensor

from .config import NetConfig
from .features import feature_rows, safe_sqrt, shape_stats, stepped, update_moments
from .network import Theta, element_layers, element_mlp_rows, layers_of
from .orthogonal import needs_whole_tensor
from .stages import apply_update, tensor_context

log = logging.getLogger("learned_opt")

#: Tensors with fewer elements take the other layouts (and the compiled code never sees
#: sizes 0 and 1, which torch.compile would specialise on).
MIN_FUSED_SIZE = 64


def fused_tensor_step_(
    theta: Theta,
    cfg: NetConfig,
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    shape: Tensor,
    step: Tensor,
    lr: Tensor,
) -> Tensor:
    """The learned step of one tensor, flat, in place; returns whether it was stepped.

    ``p`` and ``g`` are ``[n]`` in any floating dtype (bf16 included), ``m`` is ``[3, n]``
    and ``v`` ``[n]`` in the compute dtype; ``shape`` is the tensor's
    :func:`~learned_opt.features.shape_stats` ``(1, 2)``; ``step`` (1-based, after this
    update) and ``lr`` are 0-d tensors. Where the gradient or the parameter holds NaN or
    Inf, ``p``, ``m`` and ``v`` keep their values and the result (a 0-d bool) is False.
    """
    dtype = v.dtype
    p_c, g_c = p.to(dtype), g.to(dtype)
    g_ss, p_ss = torch.dot(g_c, g_c), torch.dot(p_c, p_c)
    ok = stepped(g_ss, p_ss)
    zero = torch.zeros((), dtype=dtype, device=v.device)
    g_in, p_in = torch.where(ok, g_c, zero), torch.where(ok, p_c, zero)
    m_new, v_new = update_moments(g_in, m, v)
    g_rms = safe_sqrt(torch.where(ok, g_ss, zero) / v.shape[-1])
    rows = feature_rows(p_in, g_in, m_new, v_new, g_rms, cfg)
    ms = torch.stack([torch.mean(r * r) for r in rows])
    scales, bias, scale = tensor_context(
        theta, cfg, ms.unsqueeze(0), v_new.mean().unsqueeze(0), shape, step, lr
    )
    layers = layers_of(element_layers(theta, cfg, dtype, bias.unsqueeze(-1), scales), 0)
    d, log_mag = element_mlp_rows(layers, rows)
    new_p = apply_update(cfg, p_in, d, log_mag, m_new[0], v_new, step, scale)
    p.copy_(torch.where(ok, new_p, p_c))
    m.copy_(torch.where(ok, m_new, m))
    v.copy_(torch.where(ok, v_new, v))
    return ok


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


def _compiled_for(cfg: NetConfig):
    with _lock:
        if cfg not in _compiled:

            def step_one(theta, p, g, m, v, shape, step, lr, _cfg=cfg):
                return fused_tensor_step_(theta, _cfg, p, g, m, v, shape, step, lr)

            _compiled[cfg] = torch.compile(step_one, dynamic=True)
        return _compiled[cfg]


def fusable(p: Tensor) -> bool:
    """Whether :func:`fused_step_` steps ``p`` (large enough, contiguous)."""
    return p.numel() >= MIN_FUSED_SIZE and p.is_contiguous()


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
) -> list[bool]:
    """The learned step of many tensors, in place, one fused pass each.

    ``params`` share a device and a compute dtype (theta's and the states'); each is
    contiguous with at least :data:`MIN_FUSED_SIZE` elements (:func:`fusable`). Returns,
    per tensor, False where the gradient or the parameter was not finite and nothing
    changed. With ``compiled`` the pass is the ``torch.compile``d one; if compiling fails,
    :class:`CompileFailed` is raised before any tensor was changed by the failing call,
    with the flags of the tensors already stepped in its ``done`` attribute.
    """
    if not params:
        return []
    whole = [tuple(p.shape) for p in params if needs_whole_tensor(cfg, p.shape)]
    if whole:
        raise ValueError(
            f"tensors of shapes {whole} need their whole tensor in the output stage "
            f"(output={cfg.output!r}, normalize={cfg.normalize}); the fused pass cannot step them"
        )
    like = states[0]["v"]
    step_t = torch.tensor(float(step), dtype=torch.float64, device=like.device)
    lr_t = torch.tensor(float(lr), dtype=torch.float64, device=like.device)
    fn = fused_tensor_step_ if not compiled else None
    if compiled:
        if _failure:
            raise CompileFailed(_failure[0])
        fn = _compiled_for(cfg)
    flags = []
    for p, g, s in zip(params, grads, states):
        args = (
            p.detach().view(-1),
            g.reshape(-1),
            s["m"].view(3, -1),
            s["v"].view(-1),
            shape_stats((tuple(p.shape),), like),
            step_t,
            lr_t,
        )
        if not compiled:
            flags.append(fn(theta, cfg, *args))
            continue
        try:
            flags.append(fn(theta, *args))
        except Exception as e:  # a compiler missing or failing: fall back, once
            if not _is_compile_error(e):
                raise
            _failure.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            err = CompileFailed(_failure[0])
            err.done = torch.stack(flags).tolist() if flags else []
            raise err from e
    return torch.stack(flags).tolist()


def _is_compile_error(e: Exception) -> bool:
    """Errors that torch.compile raises while building code (not the step's own errors)."""
    names = {"BackendCompilerFailed", "InductorError", "CppCompileError", "TorchRuntimeError"}
    return type(e).__name__ in names or type(e).__module__.startswith(
        ("torch._dynamo", "torch._inductor")
    )
