"""Every formula of the learned step that comes before the network, written once.

The formulas act on a layout-neutral view: element tensors are ``[..., n]`` (momenta
``[..., 3, n]``, features ``[..., F, n]``) and per-tensor values reach the elements by
broadcasting (see :mod:`learned_opt.segments` and :mod:`learned_opt.step`).

All of them work under ``torch.func.vmap``, autograd and ``torch.compile``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .config import MOMENTUM_DECAYS, SECOND_MOMENT_DECAY, NetConfig
from .orthogonal import is_matrix

#: Added inside the per-tensor normalisation x * rsqrt(NORM_EPS + mean(x^2)).
NORM_EPS = 1e-5
#: Keeps logs and divisions finite at exactly zero.
TINY = 1e-12


def constant(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A cached tensor of ``values`` (nested tuples) on ``device``: building it again on
    every call would cost an accelerator a host-to-device copy each time. Never modify it.
    (Under ``torch.compile`` the tensor is built in the graph, where it is a constant.)"""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    return _cached_constant(values, dtype, device)


@functools.lru_cache(maxsize=256)
def _cached_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def compute_dtype(p: Tensor) -> torch.dtype:
    """float64 parameters compute in float64; everything else (bf16, fp16, fp32) in float32."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def init_state(p: Tensor, rows: int = 3) -> dict[str, Tensor]:
    """Zero state for parameter ``p``: momenta ``m`` of shape ``(rows, *p.shape)`` (the
    first ``rows`` of :data:`MOMENTUM_DECAYS`: those the step reads, see
    :func:`~learned_opt.step.moment_rows`) and ``v``, contiguous, and the tensor's adapted
    log step multiplier ``log_lr`` (a scalar; see :func:`adapt_log_lr`), in
    :func:`compute_dtype`."""
    dtype = compute_dtype(p)
    return {
        "m": torch.zeros((rows,) + tuple(p.shape), dtype=dtype, device=p.device),
        "v": torch.zeros(p.shape, dtype=dtype, device=p.device),
        "log_lr": torch.zeros((), dtype=dtype, device=p.device),
    }


def stepped(g_sum_squares: Tensor, p_sum_squares: Tensor) -> Tensor:
    """The masking rule: a tensor is stepped only where the sums of squares of its gradient
    and of its parameter are finite (no NaN or Inf in either, and no overflow). Elsewhere
    the parameter and its state stay as they are, and the skip is counted."""
    return torch.isfinite(g_sum_squares + p_sum_squares)


def update_moments(g: Tensor, m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """New momenta ``m`` (``[..., k, n]``: the first ``k`` of the decays
    :data:`MOMENTUM_DECAYS`) and second moment ``v`` (``[..., n]``) after gradient ``g``
    (``[..., n]``)."""
    decays = MOMENTUM_DECAYS[: m.shape[-2]]
    weights = constant(tuple((1.0 - b,) for b in decays), m.dtype, m.device)
    m_new = torch.lerp(m, g.unsqueeze(-2), weights)
    v_new = torch.addcmul(v * SECOND_MOMENT_DECAY, g, g, value=1.0 - SECOND_MOMENT_DECAY)
    return flush_subnormal(m_new), flush_subnormal(v_new)


def flush_subnormal(x: Tensor) -> Tensor:
    """``x`` with its subnormal entries (nonzero, below the dtype's smallest normal
    magnitude) set to zero.

    The momentum of a unit whose gradient is exactly zero (a dead unit) decays
    geometrically and turns subnormal after several hundred steps; on CPUs every op that
    reads a subnormal number runs several times slower (the held-out conv net's step went
    from 12 ms to 43 ms by step 1000). Such values are below anything a step can resolve.
    """
    return torch.nn.functional.hardshrink(x, torch.finfo(x.dtype).tiny)  # one pass


def adapt_log_lr(
    log_lr: Tensor,
    g_dot_m: Tensor,
    g_sum_squares: Tensor,
    m_sum_squares: Tensor,
    v_mean: Tensor,
    numel: Tensor,
    step: Tensor | float,
    cfg: NetConfig,
    lr: Tensor | float = 1.0,
    ceiling: Tensor | float | None = None,
) -> Tensor:
    """The per-tensor step-size adaptation: each tensor's new log step multiplier.

    A hypergradient step on the log learning rate. The loss's derivative with respect to
    the last step's size is ``-g_t . u_{t-1}``; the 0.9 momentum before this step's update,
    ``m1``, stands in for the last update's direction, and the scale-free cosine for the
    dot product:

        c = cos(g_t, m1_{t-1}),   brake = min(1, rms(g_t) / (lr_adapt_brake * rms_v))
        log_lr <- clamp(log_lr + lr_adapt_rate * c * (brake if c > 0 else 1), lo, hi)

    The bounds hold the whole multiplier ``lr * exp(log_lr)`` (``lr``: the user's step
    multiplier) within ``[exp(lr_adapt_min), exp(ceiling)]``, widened to contain ``lr``
    itself: ``lo = min(lr_adapt_min - log lr, 0)``, ``hi = max(ceiling - log lr, 0)``.
    ``ceiling`` is each tensor's :func:`adapt_ceiling` (the fourth column of its
    :func:`shape_stats`; ``lr_adapt_max`` when not given). ``lr`` thus sets where the
    adaptation starts and not how far it may go: with the bounds on ``log_lr`` alone, a multiplier of 0.3 kept logistic regression below its
    tuned step (e^6.9 times the base).

    While successive gradients agree (a consistent slope, as in a convex problem) the
    step grows geometrically; when they oscillate it shrinks, an automatic annealing. The
    brake slows the growth once gradients fall well below their running RMS (``rms_v``,
    the root of the mean bias-corrected second moment after this step's update): a model
    that has fitted its data sees tiny gradients that still agree, and growing the
    normalised step there would blow its weights up (a conv net with batch norm did,
    after reaching zero training loss). The sums are over each tensor of
    ``g * m1``, ``g^2`` and ``m1^2``, ``v_mean`` the mean of ``v`` and ``numel`` the
    tensor's size; all broadcast (per-tensor values, leading dims stack rows). Zero
    momentum (the first step) gives a zero cosine.
    """
    norms = safe_sqrt(g_sum_squares) * safe_sqrt(m_sum_squares)
    cosine = g_dot_m / (norms + TINY)
    v_hat = corrected_v_mean(v_mean, step)
    rms_v = cfg.lr_adapt_brake * safe_sqrt(v_hat)
    brake = torch.clamp(safe_sqrt(g_sum_squares / numel) / (rms_v + TINY), max=1.0)
    rate = torch.where(cosine > 0, cfg.lr_adapt_rate * brake, cfg.lr_adapt_rate)
    mult = torch.as_tensor(lr, dtype=log_lr.dtype, device=log_lr.device)
    log_mult = torch.log(torch.clamp(mult, min=TINY))
    lo = torch.clamp(cfg.lr_adapt_min - log_mult, max=0.0)
    top = cfg.lr_adapt_max if ceiling is None else ceiling
    hi = torch.clamp(top - log_mult, min=0.0)
    return torch.minimum(torch.maximum(log_lr + rate * cosine, lo), hi)


def safe_sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` with a finite gradient at 0 (``x`` is a mean square, never negative)."""
    return torch.sqrt(x + TINY * TINY)


def element_features(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, g_rms: Tensor | float, cfg: NetConfig
) -> Tensor:
    """The 11 unnormalised per-element features, ``[..., 11, n]``.

    Rows: g, clip(g), p, m_1..m_3, m_k * rsqrt(v + eps) (3), g * rsqrt(v + eps),
    rsqrt(v + eps). ``clip(g)`` is ``g / rms(g)`` clipped to ``+-cfg.clip_value``; ``g_rms``
    (broadcastable to ``g``) is the rms over the whole tensor. ``m`` is ``[..., 3, n]``.
    """
    r = torch.rsqrt(v + cfg.eps)
    clip_g = torch.clamp(g / (g_rms + TINY), -cfg.clip_value, cfg.clip_value)
    m_rows = m.unbind(-2)
    rows = [g, clip_g, p, *m_rows, *(m_k * r for m_k in m_rows), g * r, r]
    return torch.stack(rows, dim=-2)


def feature_scales(mean_squares: Tensor) -> Tensor:
    """Per-feature normalisers ``rsqrt(NORM_EPS + mean(x^2))`` from per-row mean squares."""
    return torch.rsqrt(NORM_EPS + mean_squares)


def width_log_factor(shape, cfg: NetConfig, matrix: bool | None = None) -> float:
    """The log of a tensor's width factor on its step (:attr:`NetConfig.adam_max_width`):
    ``log(adam_max_width / min(shape))`` for a 2-D matrix that is not orthogonalised and
    whose smaller dimension exceeds ``adam_max_width`` (when that is > 0), else 0.

    It shrinks the step of a wide matrix on the Adam form (muP's 1 / width rate for
    hidden layers) and of nothing else: vectors, convolution kernels, thin heads and
    orthogonalised matrices (their step's RMS is fixed and spread over every direction,
    not concentrated in the gradient's few) keep their step. An
    embedding table wider than ``adam_max_width`` is shrunk too (a shape does not tell
    it from a linear layer).
    """
    shape = tuple(shape)
    width = cfg.adam_max_width
    matrix = is_matrix(shape, cfg) if matrix is None else matrix
    if width <= 0 or len(shape) != 2 or matrix or min(shape) <= width:
        return 0.0
    return math.log(width / min(shape))


def adapt_ceiling(shape, cfg: NetConfig, matrix: bool | None = None) -> float:
    """The ceiling of a tensor's adapted log step multiplier (:func:`adapt_log_lr`):
    ``cfg.lr_adapt_max``, lowered to ``cfg.lr_adapt_max_ortho`` (when set) for a matrix
    that takes the orthogonalised step.

    The adaptation reads the cosine of the gradient with the momentum, whose top singular
    directions dominate it; an orthogonalised step moves all directions alike, so that
    cosine cannot see the damage a grown step does in the weakly-driven ones.
    """
    top = float(cfg.lr_adapt_max)
    matrix = is_matrix(tuple(shape), cfg) if matrix is None else matrix
    if cfg.lr_adapt_max_ortho is not None and matrix:
        return min(top, float(cfg.lr_adapt_max_ortho))
    return top


def shape_stats(shapes, cfg: NetConfig, like: Tensor, matrices=None, tables=None) -> Tensor:
    """``(len(shapes), 4)``: 0.1 * log(numel) and 0.5 * rank of each tensor shape (the
    per-tensor network's shape inputs), the log factor on its base step (its
    :func:`width_log_factor`, plus ``log(cfg.table_step_mult)`` for a row-sparse table) and
    its :func:`adapt_ceiling`. ``matrices`` (one bool per shape; default :func:`is_matrix`)
    says which take the orthogonalised step, ``tables`` (one bool per shape; default none)
    which are row-sparse tables."""
    matrices = [None] * len(shapes) if matrices is None else matrices
    tables = tables or (False,) * len(shapes)
    table_log = math.log(cfg.table_step_mult)
    rows = tuple(
        (
            0.1 * math.log(max(math.prod(s), 1)),
            0.5 * len(s),
            width_log_factor(s, cfg, matrix) + (table_log if table else 0.0),
            adapt_ceiling(s, cfg, matrix),
        )
        for s, matrix, table in zip(shapes, matrices, tables)
    )
    return constant(rows, like.dtype, like.device)


def tensor_stats(ms: Tensor, v_mean: Tensor, shape: Tensor) -> Tensor:
    """Per-tensor statistics, shape ``(..., 8)``, for the per-tensor network.

    0.1 * log rms of g, p, m_1..m_3 and sqrt(mean v); 0.1 * log(numel); 0.5 * rank. ``ms``
    (``(..., 11)``) holds the feature mean squares (rows 0 and 2-5 of the features are g, p
    and m), ``v_mean`` (``(...)``) the mean of v and ``shape`` (``(..., 2)``) the first two
    columns of the :func:`shape_stats`. Leading dims batch over tensors.
    """
    moments = torch.cat([ms[..., 0:1], ms[..., 2:6], v_mean.unsqueeze(-1)], dim=-1)
    logs = torch.log(safe_sqrt(moments) + TINY)
    return torch.cat([0.1 * logs, shape.to(logs.dtype)], dim=-1)


def time_features(step: Tensor | float, cfg: NetConfig, like: Tensor) -> Tensor:
    """``tanh(step / tau - 1)`` for each ``tau`` in ``cfg.time_taus``: shape ``(n,)`` for one
    step count, ``(..., n)`` for a tensor of them (a stack of tensors, each with its own)."""
    taus = constant(cfg.time_taus, like.dtype, like.device)
    step = torch.as_tensor(step, dtype=like.dtype, device=like.device)
    return torch.tanh(step.unsqueeze(-1) / taus - 1.0)


def bias_correction(decay: float, step: Tensor | float, like: Tensor) -> Tensor | float:
    """``1 - decay^step``, the bias correction of a moment with ``decay`` after ``step`` steps.
    A tensor ``step`` (moved to ``like``'s dtype and device) gives ``-expm1(step * log(decay))``:
    ``1 - 0.999^t`` cancels in float32."""
    if isinstance(step, Tensor):
        step = step.to(dtype=like.dtype, device=like.device)
        return -torch.expm1(step * math.log(decay))
    return 1.0 - decay**step


def corrected_v_mean(v_mean: Tensor, step: Tensor | float) -> Tensor:
    """The mean of the bias-corrected second moment ``v_hat`` from the mean of ``v``
    after ``step`` steps: the squared RMS of the gradient that the step-size adaptation
    brakes against and the momentum's signal-to-noise ratio divides by."""
    return v_mean / bias_correction(SECOND_MOMENT_DECAY, step, v_mean)


def adam_direction(m1: Tensor, v: Tensor, step: Tensor | float, eps: float) -> Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)`` from the 0.9 momentum,
    as ``(sqrt(bc2) / bc1) * m1 / (sqrt(v) + eps * sqrt(bc2))``. ``step`` is a Python
    number or a tensor (broadcastable)."""
    bc1 = bias_correction(MOMENTUM_DECAYS[0], step, v)
    bc2 = bias_correction(SECOND_MOMENT_DECAY, step, v)
    root_bc2 = bc2**0.5
    return m1 / (torch.sqrt(v) + eps * root_bc2) * (root_bc2 / bc1)


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
        torch.linalg.vector_norm(y_a) + torch.linalg.vector_norm(y_b) + TINY
    )
    zero = torch.zeros((), dtype=dist.dtype, device=dist.device)
    if loss_a is None or loss_b is None:
        loss_mean, loss_gap, present = zero, zero, zero
    else:
        la = torch.as_tensor(loss_a, dtype=dist.dtype, device=dist.device)
        lb = torch.as_tensor(loss_b, dtype=dist.dtype, device=dist.device)
        total = la.abs() + lb.abs()
        loss_mean = 0.1 * torch.log(0.5 * total + TINY)
        loss_gap = (la - lb).abs() / (total + TINY)
        present = torch.ones((), dtype=dist.dtype, device=dist.device)
    deg = torch.log(torch.as_tensor(max_degree, dtype=dist.dtype, device=dist.device))
    return torch.stack([dist, loss_mean, loss_gap, present, deg])
