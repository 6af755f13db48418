"""The differentiable learned step on flat, segmented, stacked parameters.

All parameter tensors of a model are concatenated into one flat vector of length ``P``,
and rows (workers) are stacked in front: ``p`` is ``[B, P]``, and a
:class:`~learned_opt.segments.FlatLayout` records which segment (tensor) each element
belongs to. :func:`flat_step` composes the formulas of :mod:`learned_opt.features`, the
network of :mod:`learned_opt.network` and the stages of :mod:`learned_opt.stages` on that
view, with segment reductions: a few dozen large ops per inner step, pure and
differentiable in theta. Meta-training unrolls it; :func:`tensor_step` is the same step
for one tensor (one segment, one row), and the in-place stacked and packed paths of
:mod:`learned_opt.functional` call it under ``no_grad``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NetConfig
from .features import (
    adapt_log_lr,
    compute_dtype,
    constant,
    element_features,
    safe_sqrt,
    shape_stats,
    stepped,
    update_moments,
)
from .network import Theta, element_layers, element_mlp
from .segments import FlatLayout, one_segment, segment_expand, segment_mean, segment_sum
from .stages import apply_update, tensor_context


def init_flat_state(p: Tensor, layout: FlatLayout | None = None) -> dict[str, Tensor]:
    """Zero state for flat parameters ``[B, P]``: ``m`` ``[B, 3, P]`` and ``v`` ``[B, P]``,
    and with ``layout`` the per-tensor log step multipliers ``log_lr`` ``[B, T]``."""
    b, n = p.shape
    state = {"m": p.new_zeros(b, 3, n), "v": p.new_zeros(b, n)}
    if layout is not None:
        state["log_lr"] = p.new_zeros(b, len(layout.shapes))
    return state


def flat_step(
    theta: Theta,
    cfg: NetConfig,
    layout: FlatLayout,
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    step: int | Tensor,
    lr: float | Tensor = 1.0,
    *,
    log_lr: Tensor | None = None,
    return_finite: bool = False,
) -> tuple[Tensor, ...]:
    """Learned step of every segment of ``p`` (``[B, P]``; ``m`` is ``[B, 3, P]``); returns
    ``(new_p, new_m, new_v)``, then ``new_log_lr`` if ``log_lr`` is given, then the
    ``[B, T]`` mask of segments that were stepped if ``return_finite``. ``step`` is the
    1-based step count after this update.

    ``log_lr`` (``[B, T]``) are the segments' adapted log step multipliers
    (:func:`~learned_opt.features.adapt_log_lr`); a config that adapts them needs them, and
    one that does not passes them through unchanged.

    A segment whose gradient or parameter holds NaN or Inf is left unchanged (parameter
    and state; see :func:`~learned_opt.features.stepped`), and its values never reach the
    other segments or, through autograd, theta.
    """

    def expand(t: Tensor) -> Tensor:
        return segment_expand(t, layout)

    if cfg.adapts_lr and log_lr is None:
        raise ValueError("this config adapts per-tensor step sizes: flat_step needs log_lr")
    g_sum_squares = segment_sum(g * g, layout)  # [B, T]
    ok = stepped(g_sum_squares, segment_sum(p * p, layout))
    keep = expand(ok)
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    g_in, p_in = torch.where(keep, g, zero), torch.where(keep, p, zero)
    m_new, v_new = update_moments(g_in, m, v)

    sizes = constant(tuple(max(n, 1) for n in layout.numels), p.dtype, p.device)
    g_sum_squares = torch.where(ok, g_sum_squares, zero)
    g_rms = safe_sqrt(g_sum_squares / sizes)
    v_mean = segment_mean(v_new, layout)
    stats = shape_stats(layout.shapes, cfg, p)  # once, for the adaptation and the context
    new_log_lr = log_lr
    if cfg.adapts_lr:
        m1 = m[..., 0, :]  # before this step's update
        g_dot_m, m_sum_squares = segment_sum(g_in * m1, layout), segment_sum(m1 * m1, layout)
        adapted = adapt_log_lr(
            log_lr, g_dot_m, g_sum_squares, m_sum_squares, v_mean, sizes, step, cfg, lr, stats[:, 3]
        )
        new_log_lr = torch.where(ok, adapted, log_lr)
    x = element_features(p_in, g_in, m_new, v_new, expand(g_rms), cfg)  # [B, 11, P]
    ms = segment_mean(x * x, layout).transpose(-1, -2)  # [B, T, 11]
    scales, bias, scale = tensor_context(theta, cfg, ms, v_mean, stats, step, lr, new_log_lr)
    layers = element_layers(theta, cfg, p.dtype, expand(bias.transpose(-1, -2)))
    d, log_mag = element_mlp(layers, x * expand(scales.transpose(-1, -2)))
    new_p = apply_update(
        cfg, p_in, d, log_mag, m_new[..., 0, :], v_new, step, expand(scale), shapes=layout.shapes
    )
    out = (
        torch.where(keep, new_p, p),
        torch.where(keep.unsqueeze(-2), m_new, m),
        torch.where(keep, v_new, v),
    )
    if log_lr is not None:
        out = (*out, new_log_lr)
    return (*out, ok) if return_finite else out


def tensor_step(
    theta: Theta,
    cfg: NetConfig,
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    step: Tensor | float,
    lr: Tensor | float = 1.0,
    log_lr: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Pure learned step of one tensor: :func:`flat_step` on a one-segment view.

    ``m`` is ``(3, *p.shape)``; computes in :func:`~learned_opt.features.compute_dtype`.
    Returns ``(new_p, new_m, new_v)``, and the new ``log_lr`` (a scalar) after them if
    ``log_lr`` is given (a config that adapts step sizes needs it); differentiable in
    theta, p, g, m and v, and works under ``torch.func.vmap`` (stacked workers). A
    gradient or parameter holding NaN or Inf leaves ``p``, ``m``, ``v`` and ``log_lr``
    unchanged.
    """
    dtype = compute_dtype(p)
    out = flat_step(
        theta,
        cfg,
        one_segment(p.shape),
        p.to(dtype).reshape(1, -1),
        g.to(dtype).reshape(1, -1),
        m.reshape(1, 3, -1),
        v.reshape(1, -1),
        step,
        lr,
        log_lr=None if log_lr is None else log_lr.reshape(1, 1),
    )
    new_p, new_m, new_v = out[:3]
    new = (new_p.reshape(p.shape).to(p.dtype), new_m.reshape(m.shape), new_v.reshape(v.shape))
    return new if log_lr is None else (*new, out[3].reshape(log_lr.shape))
