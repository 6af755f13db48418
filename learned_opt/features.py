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


def safe_sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` with a finite gradient at 0 (``x`` is a mean square, never negative)."""
    return torch.sqrt(x + _TINY * _TINY)


def rms(x: Tensor) -> Tensor:
    """Root mean square over all elements (a 0-d tensor)."""
    return safe_sqrt(mean_square(x))


def mean_square(x: Tensor) -> Tensor:
    """``mean(x^2)`` as a dot product (no temporary the size of ``x``)."""
    flat = x.reshape(-1)
    return torch.dot(flat, flat) / max(flat.numel(), 1)


def element_features(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    g_rms: Tensor,
    cfg: NetConfig,
    out: Tensor | None = None,
) -> Tensor:
    """Unnormalised per-element features, shape ``(11, n)`` for ``n = p.numel()``.

    Rows: g, clip(g), p, m_1..m_3, m_k * rsqrt(v + eps) (3), g * rsqrt(v + eps), rsqrt(v + eps).
    ``clip(g)`` is ``g / rms(g)`` clipped to ``+-cfg.clip_value``; ``g_rms`` is the rms of
    the whole tensor, so the features of a chunk equal those of the full tensor.
    ``out`` (contiguous, ``(11, n)``) receives the rows on the no-grad fast path.
    """
    g = g.reshape(1, -1)
    m = m.reshape(3, -1)
    if out is not None:  # no-grad fast path: each row written once, no temporaries
        r = torch.add(v.reshape(1, -1), cfg.eps, out=out[10:11]).rsqrt_()
        torch.div(g, g_rms + _TINY, out=out[1:2]).clamp_(-cfg.clip_value, cfg.clip_value)
        torch.mul(m, r, out=out[6:9])
        torch.mul(g, r, out=out[9:10])
        out[0:1].copy_(g)
        out[2:3].copy_(p.reshape(1, -1))
        out[3:6].copy_(m)
        return out
    r = torch.rsqrt(v.reshape(1, -1) + cfg.eps)
    clip_g = (g / (g_rms + _TINY)).clamp(-cfg.clip_value, cfg.clip_value)
    return torch.cat([g, clip_g, p.reshape(1, -1), m, m * r, g * r, r])


def feature_sum_squares(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, g_rms: Tensor, cfg: NetConfig
) -> Tensor:
    """Per-row sums of squares of :func:`element_features`, shape ``(11,)``, computed
    without building the rows (``(m r)^2 = m^2 / (v + eps)``), so the fast path's first pass
    over a tensor is cheap. Sums over chunks add up; divided by the tensor's size they are
    the mean squares that :func:`feature_scales` normalises by."""
    g = g.reshape(-1)
    p = p.reshape(-1)
    m2 = m.reshape(3, -1).square()
    g2 = g * g
    inv = torch.reciprocal(v.reshape(-1) + cfg.eps)  # rsqrt(v + eps) ** 2
    clip_g = (g / (g_rms + _TINY)).clamp(-cfg.clip_value, cfg.clip_value)
    return torch.cat(
        [
            g2.sum().reshape(1),
            torch.dot(clip_g, clip_g).reshape(1),
            torch.dot(p, p).reshape(1),
            m2.sum(dim=1),
            torch.mv(m2, inv),
            torch.dot(g2, inv).reshape(1),
            inv.sum().reshape(1),
        ]
    )


def feature_scales(mean_squares: Tensor) -> Tensor:
    """Per-feature normalisers ``rsqrt(NORM_EPS + mean(x^2))`` from per-row mean squares."""
    return torch.rsqrt(NORM_EPS + mean_squares)


def tensor_stats(ms: Tensor, v: Tensor) -> Tensor:
    """Per-tensor statistics, shape ``(8,)``, for the per-tensor network.

    0.1 * log rms of g, p, m_1..m_3 and sqrt(mean v); 0.1 * log(numel); 0.5 * rank. ``ms``
    holds the feature mean squares (rows 0 and 2-5 of the features are g, p and m).
    """
    moments = torch.cat([ms[0:1], ms[2:6], v.mean().reshape(1)])
    logs = torch.log(safe_sqrt(moments) + _TINY)
    shape_stats = torch.tensor(
        [0.1 * math.log(max(v.numel(), 1)), 0.5 * v.dim()], dtype=logs.dtype, device=logs.device
    )
    return torch.cat([0.1 * logs, shape_stats])


def time_features(step: Tensor | float, cfg: NetConfig, like: Tensor) -> Tensor:
    """``tanh(step / tau - 1)`` for each ``tau`` in ``cfg.time_taus``, shape ``(T,)``."""
    taus = torch.tensor(cfg.time_taus, dtype=like.dtype, device=like.device)
    step = torch.as_tensor(step, dtype=like.dtype, device=like.device)
    return torch.tanh(step / taus - 1.0)


def adam_denominator(
    v: Tensor, step: Tensor | float, eps: float, out: Tensor | None = None
) -> Tensor:
    """``bc1 * (sqrt(v / bc2) + eps)``: Adam's direction is ``m_1 / adam_denominator``.

    ``step`` may be a Python number (bias corrections in float64) or a tensor. ``out``
    (shaped like ``v``) receives the result in place on the no-grad fast path.
    """
    if isinstance(step, Tensor):
        step = step.to(dtype=v.dtype, device=v.device)
    bc1, bc2 = 1.0 - MOMENTUM_DECAYS[0] ** step, 1.0 - SECOND_MOMENT_DECAY**step
    if out is not None:
        return torch.mul(v, bc1 * bc1 / bc2, out=out).sqrt_().add_(eps * bc1)
    return torch.sqrt(v * (bc1 * bc1 / bc2)) + eps * bc1


def adam_direction(m1: Tensor, v: Tensor, step: Tensor | float, eps: float) -> Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)`` from the 0.9 momentum."""
    return m1 / adam_denominator(v, step, eps)


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
