"""Input features of the learned optimizer: per element, per tensor, per edge, and time.

All functions are pure (tensors in, tensors out) and work under ``torch.func.vmap``,
so meta-training, ``LearnedOptimizer`` and the distributed workers share them.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .config import MOMENTUM_DECAYS, SECOND_MOMENT_DECAY, NetConfig

#: Added inside the per-tensor normalisation x * rsqrt(NORM_EPS + mean(x^2)).
NORM_EPS = 1e-5
_TINY = 1e-12


@functools.lru_cache(maxsize=256)
def constant(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A cached tensor of ``values`` (nested tuples) on ``device``: building it again on
    every call would cost an accelerator a host-to-device copy each time. Never modify it."""
    return torch.tensor(values, dtype=dtype, device=device)


def update_moments(g: Tensor, m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """New momenta ``m`` (shape ``(3, *g.shape)``) and second moment ``v`` after gradient ``g``."""
    decays = constant(MOMENTUM_DECAYS, m.dtype, m.device).reshape((3,) + (1,) * g.dim())
    m_new = m * decays + (1.0 - decays) * g.unsqueeze(0)
    v_new = v * SECOND_MOMENT_DECAY + (1.0 - SECOND_MOMENT_DECAY) * g * g
    return m_new, v_new


def update_moments_(g: Tensor, m: Tensor, v: Tensor) -> None:
    """In-place twin of :func:`update_moments` for the no-grad fast path (``m`` is ``(3, n)``,
    ``g`` and ``v`` are ``(n,)``): one interpolation over all three momenta."""
    weights = constant(tuple((1.0 - b,) for b in MOMENTUM_DECAYS), m.dtype, m.device)
    m.lerp_(g.expand_as(m), weights)
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
    g, p, m = g.reshape(-1), p.reshape(-1), m.reshape(3, -1)
    inv = torch.reciprocal(v.reshape(-1) + cfg.eps)  # rsqrt(v + eps) ** 2
    clip_g = (g / (g_rms + _TINY)).clamp_(-cfg.clip_value, cfg.clip_value)
    g_inv = g * inv
    sums = [torch.dot(g, g), torch.dot(clip_g, clip_g), torch.dot(p, p)]
    sums += [torch.dot(m[k], m[k]) for k in range(3)]
    return torch.cat(
        [
            torch.stack(sums),
            torch.mv(m * m, inv),
            torch.dot(g_inv, g).reshape(1),
            inv.sum().reshape(1),
        ]
    )


def feature_scales(mean_squares: Tensor) -> Tensor:
    """Per-feature normalisers ``rsqrt(NORM_EPS + mean(x^2))`` from per-row mean squares."""
    return torch.rsqrt(NORM_EPS + mean_squares)


def shape_stats(shapes, like: Tensor) -> Tensor:
    """``(len(shapes), 2)``: 0.1 * log(numel) and 0.5 * rank of each tensor shape."""
    rows = tuple((0.1 * math.log(max(math.prod(s), 1)), 0.5 * len(s)) for s in shapes)
    return constant(rows, like.dtype, like.device)


def tensor_stats(ms: Tensor, v_mean: Tensor, shape: Tensor) -> Tensor:
    """Per-tensor statistics, shape ``(..., 8)``, for the per-tensor network.

    0.1 * log rms of g, p, m_1..m_3 and sqrt(mean v); 0.1 * log(numel); 0.5 * rank. ``ms``
    (``(..., 11)``) holds the feature mean squares (rows 0 and 2-5 of the features are g, p
    and m), ``v_mean`` (``(...)``) the mean of v and ``shape`` (``(..., 2)``) the
    :func:`shape_stats`. Leading dims batch over tensors.
    """
    moments = torch.cat([ms[..., 0:1], ms[..., 2:6], v_mean.unsqueeze(-1)], dim=-1)
    logs = torch.log(safe_sqrt(moments) + _TINY)
    return torch.cat([0.1 * logs, shape.to(logs.dtype)], dim=-1)


def time_features(step: Tensor | float, cfg: NetConfig, like: Tensor) -> Tensor:
    """``tanh(step / tau - 1)`` for each ``tau`` in ``cfg.time_taus``, shape ``(T,)``."""
    taus = constant(cfg.time_taus, like.dtype, like.device)
    step = torch.as_tensor(step, dtype=like.dtype, device=like.device)
    return torch.tanh(step / taus - 1.0)


def bias_corrections(step, like: Tensor) -> tuple:
    """Adam's ``(1 - 0.9^step, 1 - 0.999^step)``; Python floats (computed in float64) for a
    Python ``step``, tensors for a tensor ``step``."""
    if isinstance(step, Tensor):
        step = step.to(dtype=like.dtype, device=like.device)
    return 1.0 - MOMENTUM_DECAYS[0] ** step, 1.0 - SECOND_MOMENT_DECAY**step


def adam_direction(m1: Tensor, v: Tensor, step: Tensor | float, eps: float) -> Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)`` from the 0.9 momentum."""
    bc1, bc2 = bias_corrections(step, v)
    return m1 / (torch.sqrt(v * (bc1 * bc1 / bc2)) + eps * bc1)


def add_adam_direction_(d: Tensor, m1: Tensor, v: Tensor, step: int, eps: float, scratch: Tensor):
    """``d += adam_direction(m1, v, step, eps)`` in place, for the no-grad fast path
    (``scratch``, shaped like ``v``, is overwritten). Uses
    ``m_hat / (sqrt(v_hat) + eps) = (sqrt(bc2) / bc1) * m1 / (sqrt(v) + eps * sqrt(bc2))``,
    which takes two passes fewer."""
    bc1, bc2 = bias_corrections(step, v)
    denom = torch.sqrt(v, out=scratch).add_(eps * math.sqrt(bc2))
    return d.addcdiv_(m1, denom, value=math.sqrt(bc2) / bc1)


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
