"""The functional core of the learned optimizer.

Given theta, per-parameter state, parameters and gradients, return new parameters and
state. Two paths share every formula (features, network pieces, output parameterisation):

* :func:`tensor_step` - pure and differentiable; gradients flow to theta; works under
  ``torch.func.vmap`` (stacked workers) and ``grad``. Used by meta-training.
* :func:`tensor_step_` - no-grad, in place, processed in cache-sized chunks. Used by
  :class:`~learned_opt.LearnedOptimizer`. Agrees with the pure path to 1e-5.

A tensor whose gradient holds NaN or Inf is left untouched (parameters and state).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NUM_ELEMENT_FEATURES, NetConfig
from .features import (
    adam_denominator,
    element_features,
    feature_scales,
    feature_sum_squares,
    mean_square,
    safe_sqrt,
    tensor_stats,
    time_features,
    update_moments,
    update_moments_,
)
from .network import Theta, element_layers, element_mlp, tensor_head

#: Elements per chunk on the fast path. The MLP activations of a chunk
#: (``(11 + 2 * width + 2) * CHUNK`` floats) stay in the L2 cache while per-op overhead
#: stays small; chosen by measurement with ``benchmarks/step_overhead.py``.
DEFAULT_CHUNK = 1 << 16
#: Pass 1 (moment update and sums of squares) works on chunks this many times larger.
PASS1_CHUNKS = 4


def compute_dtype(p: Tensor) -> torch.dtype:
    """float64 parameters compute in float64; everything else (bf16, fp16, fp32) in float32."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def init_state(p: Tensor) -> dict[str, Tensor]:
    """Zero state for parameter ``p``: momenta ``m`` of shape ``(3, *p.shape)`` and ``v``."""
    dtype = compute_dtype(p)
    return {
        "m": torch.zeros((3,) + tuple(p.shape), dtype=dtype, device=p.device),
        "v": torch.zeros(p.shape, dtype=dtype, device=p.device),
    }


def _tensor_context(theta, cfg, p, v, ms, step, lr):
    """The per-tensor network's outputs, from the feature mean squares ``ms``: the
    per-element MLP with normalisation and context folded in, and the step scale
    ``-lr * step_mult * exp(log_scale)``."""
    time = time_features(step, cfg, p)
    log_scale, bias = tensor_head(theta, cfg, tensor_stats(ms, v), time)
    layers = element_layers(theta, cfg, feature_scales(ms), bias, p.dtype)
    return layers, (-lr * cfg.step_mult) * torch.exp(log_scale)


def _element_update(cfg, layers, x, m1, v, step, mlp_out=None) -> tuple[Tensor, Tensor]:
    """``(direction, magnitude)`` per element; the update is ``scale * direction * magnitude``.

    ``direction = clamp(adam_dir + d)``: Adam's direction corrected by the learned ``d``.
    With ``mlp_out`` (the no-grad fast path) everything is computed in place: the MLP's
    output rows become direction and magnitude, and the first feature row (dead once the
    first layer has run) holds Adam's denominator.
    """
    d, log_mag = element_mlp(layers, x, out=mlp_out)
    if mlp_out is None:
        direction = torch.addcdiv(d, m1, adam_denominator(v, step, cfg.eps))  # d + adam_dir
        return direction.clamp(-cfg.max_direction, cfg.max_direction), torch.exp(log_mag)
    denom = adam_denominator(v, step, cfg.eps, out=x[0])
    direction = d.addcdiv_(m1, denom).clamp_(-cfg.max_direction, cfg.max_direction)
    return direction, log_mag.exp_()


def tensor_step(
    theta: Theta,
    cfg: NetConfig,
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    step: Tensor | float,
    lr: Tensor | float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure local step of one tensor. ``step`` is the 1-based step count after this update.

    Returns ``(new_p, new_m, new_v)``; differentiable in theta, p, g, m and v. A gradient
    holding NaN or Inf (or whose sum of squares overflows) leaves ``p``, ``m`` and ``v``
    unchanged.
    """
    dtype = compute_dtype(p)
    p32, g32 = p.to(dtype), g.to(dtype)
    finite = torch.isfinite(mean_square(g32))
    g32 = torch.where(finite, g32, torch.zeros_like(g32))
    m_new, v_new = update_moments(g32, m, v)
    g_rms = safe_sqrt(mean_square(g32))
    x = element_features(p32, g32, m_new, v_new, g_rms, cfg)
    ms = (x * x).sum(dim=1) / max(p.numel(), 1)
    layers, scale = _tensor_context(theta, cfg, p32, v_new, ms, step, lr)
    m1, v1 = m_new[0].reshape(-1), v_new.reshape(-1)
    direction, magnitude = _element_update(cfg, layers, x, m1, v1, step)
    upd = (scale * direction * magnitude).reshape(p.shape)
    new_p = torch.where(finite, p32 + upd, p32).to(p.dtype)
    return new_p, torch.where(finite, m_new, m), torch.where(finite, v_new, v)


def _scratch(workspace: dict | None, numel: int, dtype, device) -> Tensor:
    """A flat buffer of at least ``numel`` elements, reused across calls via ``workspace``."""
    key = (dtype, str(device))
    buf = workspace.get(key) if workspace is not None else None
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        if workspace is not None:
            workspace[key] = buf
    return buf


@torch.no_grad()
def tensor_step_(
    theta: Theta,
    cfg: NetConfig,
    p: Tensor,
    g: Tensor,
    state: dict[str, Tensor],
    step: int,
    lr: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    workspace: dict | None = None,
) -> bool:
    """In-place fast twin of :func:`tensor_step`. Returns False (and changes nothing) when
    the gradient is not finite.

    Two passes over chunks: pass 1 updates the moments and, while they are in cache, sums
    the squared features for the per-tensor normalisation (analytically, without building
    them); pass 2 builds the features of a cache-sized chunk and runs the MLP and the
    update, with the features and activations in one reused buffer (kept in ``workspace``
    if given). A tensor that fits in one chunk builds its features once and sums their
    squares directly.
    """
    dtype = compute_dtype(p)
    g32 = g.to(dtype)
    g_ms = mean_square(g32)
    if not torch.isfinite(g_ms):
        return False
    m, v = state["m"], state["v"]
    p32 = p.detach().to(dtype)
    n, width, g_rms = p.numel(), cfg.width, safe_sqrt(g_ms)
    # m and v are created contiguous by init_state, so these reshapes are views
    flat_p, flat_g, flat_m, flat_v = (
        p32.reshape(-1),
        g32.reshape(-1),
        m.reshape(3, -1),
        v.reshape(-1),
    )
    size = min(chunk, n)
    buf = _scratch(workspace, (NUM_ELEMENT_FEATURES + 2 * width + 2) * size, dtype, p.device)

    def piece(lo: int, hi: int) -> tuple:
        return flat_p[lo:hi], flat_g[lo:hi], flat_m[:, lo:hi], flat_v[lo:hi], g_rms, cfg

    x = None
    if n <= size:  # one chunk: build the features once, sum their squares directly
        update_moments_(flat_g, flat_m, flat_v)
        x = element_features(*piece(0, n), out=buf[: NUM_ELEMENT_FEATURES * n].view(-1, n))
        sq = (x * x).sum(dim=1)
    else:  # pass 1: update the moments and sum the squared features while in cache
        big, sq = PASS1_CHUNKS * size, 0
        for lo in range(0, n, big):
            args = piece(lo, min(lo + big, n))
            update_moments_(args[1], args[2], args[3])
            sq = sq + feature_sum_squares(*args)
    layers, scale = _tensor_context(theta, cfg, p32, v, sq / n, step, lr)
    aliases_p = flat_p.data_ptr() == p.data_ptr()
    in_place = aliases_p and p.is_contiguous()
    # write into p itself, or into a private float copy that is copied back at the end
    target = flat_p.clone() if aliases_p and not in_place else flat_p
    scale = float(scale)
    for lo in range(0, n, size):
        hi = min(lo + size, n)
        k = hi - lo
        parts = buf[: (NUM_ELEMENT_FEATURES + 2 * width + 2) * k].split(
            [NUM_ELEMENT_FEATURES * k, width * k, width * k, 2 * k]
        )
        if n > size:
            x = element_features(*piece(lo, hi), out=parts[0].view(-1, k))
        mlp_out = (parts[1].view(width, k), parts[2].view(width, k), parts[3].view(2, k))
        direction, magnitude = _element_update(
            cfg, layers, x, flat_m[0, lo:hi], flat_v[lo:hi], step, mlp_out
        )
        target[lo:hi].addcmul_(direction, magnitude, value=scale)
    if not in_place:
        p.copy_(target.view(p.shape))
    return True


def learned_update(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: Tensor | int,
    lr: Tensor | float = 1.0,
    differentiable: bool = True,
) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """Apply the learned optimizer to a list of tensors.

    ``differentiable=True`` returns new tensors built by :func:`tensor_step` (gradients flow
    to theta). ``differentiable=False`` updates ``params`` and ``states`` in place with the
    chunked fast path and returns them.
    """
    if differentiable:
        new_params, new_states = [], []
        for p, g, s in zip(params, grads, states):
            p2, m2, v2 = tensor_step(theta, cfg, p, g, s["m"], s["v"], step, lr)
            new_params.append(p2)
            new_states.append({"m": m2, "v": v2})
        return new_params, new_states
    workspace: dict = {}
    for p, g, s in zip(params, grads, states):
        tensor_step_(theta, cfg, p, g, s, int(step), float(lr), workspace=workspace)
    return params, states
