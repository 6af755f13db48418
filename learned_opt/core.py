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

from .config import NetConfig
from .features import (
    adam_direction,
    element_features,
    feature_scales,
    rms,
    tensor_stats,
    time_features,
    update_moments,
    update_moments_,
)
from .network import Theta, element_mlp, tensor_head

#: Elements per chunk on the fast path (features are ``11 x CHUNK`` floats).
DEFAULT_CHUNK = 1 << 16


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


def _scaled_update(cfg, log_scale, lr, adam_dir, d, a):
    direction = (adam_dir + d).clamp(-cfg.max_direction, cfg.max_direction)
    return (-lr * cfg.step_mult) * torch.exp(log_scale) * direction * torch.exp(cfg.exp_mult * a)


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

    Returns ``(new_p, new_m, new_v)``; differentiable in theta, p, g, m and v.
    """
    dtype = compute_dtype(p)
    p32, g32 = p.to(dtype), g.to(dtype)
    finite = torch.isfinite(g32).all()
    g32 = torch.where(finite, g32, torch.zeros_like(g32))
    m_new, v_new = update_moments(g32, m, v)
    time = time_features(step, cfg, p32)
    log_scale, bias = tensor_head(theta, cfg, tensor_stats(p32, g32, m_new, v_new), time)
    x = element_features(p32, g32, m_new, v_new, rms(g32), cfg)
    w_in = theta["elem_in.weight"].to(dtype) * feature_scales(x.square().mean(dim=1))
    d, a = element_mlp(theta, w_in, bias, x)
    adam_dir = adam_direction(m_new[0].reshape(-1), v_new.reshape(-1), step, cfg.eps)
    upd = _scaled_update(cfg, log_scale, lr, adam_dir, d, a).reshape(p.shape)
    new_p = torch.where(finite, p32 + upd, p32).to(p.dtype)
    return new_p, torch.where(finite, m_new, m), torch.where(finite, v_new, v)


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
) -> bool:
    """In-place fast twin of :func:`tensor_step`. Returns False (and changes nothing) when
    ``g`` is not finite."""
    dtype = compute_dtype(p)
    g32 = g.to(dtype)
    g_rms = rms(g32)
    if not torch.isfinite(g_rms):
        return False
    m, v = state["m"], state["v"]
    update_moments_(g32, m, v)
    p32 = p.detach().to(dtype)
    time = time_features(step, cfg, p32)
    log_scale, bias = tensor_head(theta, cfg, tensor_stats(p32, g32, m, v), time)
    n = p.numel()
    flat = (p32.reshape(-1), g32.reshape(-1), m.reshape(3, -1), v.reshape(-1))
    # m and v are created contiguous by init_state, so these reshapes are views

    def chunk_features(lo: int, hi: int) -> Tensor:
        pc, gc, mc, vc = flat[0][lo:hi], flat[1][lo:hi], flat[2][:, lo:hi], flat[3][lo:hi]
        return element_features(pc, gc, mc, vc, g_rms, cfg)

    bounds = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    if len(bounds) == 1:
        x_full = chunk_features(0, n)
        sq = x_full.square().mean(dim=1)
    else:
        x_full = None
        sq = sum(chunk_features(lo, hi).square().sum(dim=1) for lo, hi in bounds) / n
    w_in = theta["elem_in.weight"].to(dtype) * feature_scales(sq)
    scale = float(-lr * cfg.step_mult) * torch.exp(log_scale)
    in_place = p32.data_ptr() == p.data_ptr() and p.is_contiguous()
    out = None if in_place else p32.reshape(-1).clone()
    for lo, hi in bounds:
        x = x_full if x_full is not None else chunk_features(lo, hi)
        d, a = element_mlp(theta, w_in, bias, x)
        adam_dir = adam_direction(flat[2][0, lo:hi], flat[3][lo:hi], step, cfg.eps)
        direction = (adam_dir + d).clamp_(-cfg.max_direction, cfg.max_direction)
        upd = direction.mul_(torch.exp(cfg.exp_mult * a)).mul_(scale)
        target = out if out is not None else p.view(-1)
        target[lo:hi].add_(upd)
    if out is not None:
        p.copy_(out.reshape(p.shape))
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
    for p, g, s in zip(params, grads, states):
        tensor_step_(theta, cfg, p, g, s, int(step), float(lr))
    return params, states
