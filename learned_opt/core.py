"""The functional core of the learned optimizer.

Given theta, per-parameter state, parameters and gradients, return new parameters and
state. Two paths share every formula (features, network pieces, output parameterisation):

* :func:`tensor_step` (here) - pure and differentiable; gradients flow to theta; works
  under ``torch.func.vmap`` (stacked workers) and ``grad``.
* :func:`learned_opt.chunked.tensor_steps_` - no-grad, in place, many tensors at once in
  cache-sized chunks on worker threads. Used by :class:`~learned_opt.LearnedOptimizer`.
  Agrees with the pure path to 1e-5.

Meta-training uses :func:`learned_opt.flat.flat_step`, the same math on flat, stacked
parameters. A tensor whose gradient holds NaN or Inf is left untouched.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NetConfig
from .features import (
    adam_direction,
    add_adam_direction_,
    element_features,
    feature_scales,
    mean_square,
    safe_sqrt,
    shape_stats,
    tensor_stats,
    time_features,
    update_moments,
)
from .network import Layers, Theta, element_layers, element_mlp, tensor_head


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


def tensor_context(theta, cfg, ms, v_mean, shapes, step, lr) -> tuple[Layers, Tensor]:
    """The per-tensor network's outputs for one tensor or a batch of tensors.

    ``ms`` (``(..., 11)``) are the feature mean squares, ``v_mean`` (``(...)``) the means of
    v and ``shapes`` the tensors' shapes (one per leading index; one shape when unbatched).
    Returns the per-element MLP's layers with normalisation and context folded in (see
    :func:`~learned_opt.network.element_layers`) and the step scale
    ``-lr * step_mult * exp(log_scale)`` (``(...)``).
    """
    shape = shape_stats(shapes, ms).reshape(*ms.shape[:-1], 2)
    time = time_features(step, cfg, ms)
    log_scale, bias = tensor_head(theta, cfg, tensor_stats(ms, v_mean, shape), time)
    layers = element_layers(theta, cfg, feature_scales(ms), bias, ms.dtype)
    return layers, (-lr * cfg.step_mult) * torch.exp(log_scale)


def element_update(cfg, layers, x, m1, v, step, mlp_out=None) -> tuple[Tensor, Tensor]:
    """``(direction, magnitude)`` per element; the update is ``scale * direction * magnitude``.

    ``direction = clamp(adam_dir + d)``: Adam's direction corrected by the learned ``d``.
    With ``mlp_out`` (the no-grad fast path) everything is computed in place: the MLP's
    output rows become direction and magnitude, and the first feature row is scratch once
    the MLP has run (the hidden layers may reuse the features' memory).
    """
    d, log_mag = element_mlp(layers, x, out=mlp_out)
    if mlp_out is None:
        direction = d + adam_direction(m1, v, step, cfg.eps)
        return direction.clamp(-cfg.max_direction, cfg.max_direction), torch.exp(log_mag)
    direction = add_adam_direction_(d, m1, v, step, cfg.eps, scratch=x[0])
    return direction.clamp_(-cfg.max_direction, cfg.max_direction), log_mag.exp_()


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
    layers, scale = tensor_context(theta, cfg, ms, v_new.mean(), [p.shape], step, lr)
    m1, v1 = m_new[0].reshape(-1), v_new.reshape(-1)
    direction, magnitude = element_update(cfg, layers, x, m1, v1, step)
    upd = (scale * direction * magnitude).reshape(p.shape)
    new_p = torch.where(finite, p32 + upd, p32).to(p.dtype)
    return new_p, torch.where(finite, m_new, m), torch.where(finite, v_new, v)
