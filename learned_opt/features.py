"""Input features of the learned optimizer: per element, per tensor, per edge, and time.

All functions are pure (tensors in, tensors out) and work under ``torch.func.vmap``,
so meta-training, ``LearnedOptimizer`` and the distributed workers share them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import MOMENTUM_DECAYS, SECOND_MOMENT_DECAY, NetConfig

#: Added inside the per-tensor normalisation x * rsqrt(NORM_EPS + mean(x^2)).
NORM_EPS = 1e-5
_TINY = 1e-12


def update_moments(g: Tensor, m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """New momenta ``m`` (shape ``(3, *g.shape)``) and second moment ``v`` after gradient ``g``."""
    decays = torch.tensor(MOMENTUM_DECAYS, dtype=m.dtype, device=m.device)
    decays = decays.reshape((3,) + (1,) * g.dim())
    m_new = m * decays + (1.0 - decays) * g.unsqueeze(0)
    v_new = v * SECOND_MOMENT_DECAY + (1.0 - SECOND_MOMENT_DECAY) * g * g
    return m_new, v_new


def update_moments_(g: Tensor, m: Tensor, v: Tensor) -> None:
    """In-place twin of :func:`update_moments` for the no-grad fast path."""
    for k, beta in enumerate(MOMENTUM_DECAYS):
        m[k].mul_(beta).add_(g, alpha=1.0 - beta)
    v.mul_(SECOND_MOMENT_DECAY).addcmul_(g, g, value=1.0 - SECOND_MOMENT_DECAY)


def rms(x: Tensor) -> Tensor:
    """Root mean square over all elements (a 0-d tensor)."""
    return x.square().mean().sqrt()


def element_features(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, g_rms: Tensor, cfg: NetConfig
) -> Tensor:
    """Unnormalised per-element features, shape ``(11, n)`` for ``n = p.numel()``.

    Rows: g, clip(g), p, m_1..m_3, m_k * rsqrt(v + eps) (3), g * rsqrt(v + eps), rsqrt(v + eps).
    ``clip(g)`` is ``g / rms(g)`` clipped to ``+-cfg.clip_value``; ``g_rms`` is the rms of
    the whole tensor, so the features of a chunk equal those of the full tensor.
    """
    g = g.reshape(-1)
    p = p.reshape(-1)
    m = m.reshape(3, -1)
    r = torch.rsqrt(v.reshape(-1) + cfg.eps)
    clip_g = (g / (g_rms + _TINY)).clamp(-cfg.clip_value, cfg.clip_value)
    return torch.cat(
        [
            g.unsqueeze(0),
            clip_g.unsqueeze(0),
            p.unsqueeze(0),
            m,
            m * r,
            (g * r).unsqueeze(0),
            r.unsqueeze(0),
        ]
    )


def feature_scales(mean_squares: Tensor) -> Tensor:
    """Per-feature normalisers ``rsqrt(NORM_EPS + mean(x^2))`` from per-row mean squares."""
    return torch.rsqrt(NORM_EPS + mean_squares)


def tensor_stats(p: Tensor, g: Tensor, m: Tensor, v: Tensor) -> Tensor:
    """Per-tensor statistics, shape ``(8,)``, for the per-tensor network.

    0.1 * log rms of g, p, m_1..m_3 and sqrt(v); 0.1 * log(numel); 0.5 * rank.
    """
    rms_m = m.reshape(3, -1).square().mean(dim=1).sqrt()
    logs = torch.log(
        torch.stack([rms(g), rms(p), rms_m[0], rms_m[1], rms_m[2], v.mean().sqrt()]) + _TINY
    )
    shape_stats = torch.tensor(
        [0.1 * math.log(max(p.numel(), 1)), 0.5 * p.dim()], dtype=logs.dtype, device=logs.device
    )
    return torch.cat([0.1 * logs, shape_stats])


def time_features(step: Tensor | float, cfg: NetConfig, like: Tensor) -> Tensor:
    """``tanh(step / tau - 1)`` for each ``tau`` in ``cfg.time_taus``, shape ``(T,)``."""
    taus = torch.tensor(cfg.time_taus, dtype=like.dtype, device=like.device)
    step = torch.as_tensor(step, dtype=like.dtype, device=like.device)
    return torch.tanh(step / taus - 1.0)


def adam_direction(m1: Tensor, v: Tensor, step: Tensor | float, eps: float) -> Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)`` from the 0.9 momentum."""
    step = torch.as_tensor(step, dtype=m1.dtype, device=m1.device)
    bc1 = 1.0 - MOMENTUM_DECAYS[0] ** step
    bc2 = 1.0 - SECOND_MOMENT_DECAY**step
    return (m1 / bc1) / ((v / bc2).sqrt() + eps)


def edge_features(
    y_a: Tensor,
    y_b: Tensor,
    loss_a: Tensor | None,
    loss_b: Tensor | None,
    max_degree: int | Tensor,
) -> Tensor:
    """Symmetric features of the edge between two workers for one tensor, shape ``(5,)``.

    Callers pass the pair ordered by rank (lower rank first) so both ends run bitwise the
    same float operations; every feature is also symmetric in (a, b) by construction.
    Rows: ||y_a - y_b|| / (||y_a|| + ||y_b||), log of the mean loss, relative loss gap,
    a loss-present flag (the loss rows are 0 when absent), log(max degree).
    """
    dist = torch.linalg.vector_norm(y_a - y_b) / (
        torch.linalg.vector_norm(y_a) + torch.linalg.vector_norm(y_b) + _TINY
    )
    zero = torch.zeros((), dtype=dist.dtype, device=dist.device)
    if loss_a is None or loss_b is None:
        loss_mean, loss_gap, present = zero, zero, zero
    else:
        la = torch.as_tensor(loss_a, dtype=dist.dtype, device=dist.device)
        lb = torch.as_tensor(loss_b, dtype=dist.dtype, device=dist.device)
        total = la.abs() + lb.abs()
        loss_mean = 0.1 * torch.log(0.5 * total + _TINY)
        loss_gap = (la - lb).abs() / (total + _TINY)
        present = torch.ones((), dtype=dist.dtype, device=dist.device)
    deg = torch.log(torch.as_tensor(max_degree, dtype=dist.dtype, device=dist.device))
    return torch.stack([dist, loss_mean, loss_gap, present, deg])
