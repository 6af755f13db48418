"""The two stages of the learned step around the per-element MLP, each written once.

* :func:`tensor_context`: per-tensor statistics -> the per-tensor network -> the feature
  normalisers, the context bias of the per-element MLP and the step scale.
* :func:`apply_update`: the output parameterisation, from the MLP's outputs (direction
  ``d``, log magnitude) and the step scale to the new parameter.

Every path (:mod:`learned_opt.flat` for meta-training, the one-tensor pure step, the
stacked and packed in-place steps, and the chunked CPU path) calls these, so a change of
the output parameterisation or of the per-tensor network's inputs is made here once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NetConfig
from .features import adam_direction, feature_scales, shape_stats, tensor_stats, time_features
from .network import Theta, tensor_head
from .orthogonal import shape_direction


def tensor_context(
    theta: Theta,
    cfg: NetConfig,
    ms: Tensor,
    v_mean: Tensor,
    shapes,
    step,
    lr,
    log_lr: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The per-tensor stage for a batch of tensors.

    ``ms`` (``(..., T, 11)``) are the feature mean squares, ``v_mean`` (``(..., T)``) the
    means of v and ``shapes`` the ``T`` tensors' shapes; leading dims stack rows (workers).
    ``shapes`` may instead be their :func:`~learned_opt.features.shape_stats` as a tensor
    (``(T, 4)``), which a compiled caller passes so that no shape is baked into its code.
    Returns ``(feature_scales (..., T, 11), context_bias (..., T, H), scale (..., T))``:
    the normalisers of the features, the full first-layer bias of the per-element MLP, and
    the step scale ``-lr * step_mult * exp(log_scale)``, times ``exp(log_lr)`` (``(..., T)``,
    the adapted step multipliers of :func:`~learned_opt.features.adapt_log_lr`) when the
    config adapts them, and times each tensor's width factor
    (:func:`~learned_opt.features.width_log_factor`).
    """
    stats = shapes if isinstance(shapes, Tensor) else shape_stats(shapes, cfg, ms)
    stats = stats.expand(*ms.shape[:-1], 4)
    time = time_features(step, cfg, ms)
    log_scale, bias = tensor_head(theta, cfg, tensor_stats(ms, v_mean, stats[..., :2]), time)
    log_scale = log_scale + stats[..., 2].to(log_scale.dtype)
    if cfg.adapts_lr:
        log_scale = log_scale + log_lr
    return feature_scales(ms), bias, (-lr * cfg.step_mult) * torch.exp(log_scale)


def apply_update(
    cfg: NetConfig,
    p: Tensor,
    d: Tensor,
    log_mag: Tensor,
    m1: Tensor,
    v: Tensor,
    step,
    scale: Tensor | float,
    scratch: Tensor | None = None,
    shapes=None,
) -> Tensor:
    """The output parameterisation: the new parameter

        p + scale * clamp(adam_dir + d, +-max_direction) * exp(log_mag)

    where ``adam_dir`` is Adam's bias-corrected direction from ``m1`` (the 0.9 momentum)
    and ``v``, ``d`` and ``log_mag`` (``exp_mult * a``) are the per-element MLP's outputs
    and ``scale`` the per-tensor step scale, broadcast to the elements by the caller. Zero
    heads give exactly Adam with learning rate ``lr * step_mult``.

    With ``scratch`` (shaped like ``v``), the no-grad fast path: everything is computed in
    place, ``d`` and ``log_mag`` are overwritten and ``p`` is updated and returned.

    With ``shapes`` (the segments of the last dim: whole tensors), the direction of each
    tensor is then shaped by :func:`~learned_opt.orthogonal.shape_direction` (the "ortho"
    matrices, ``cfg.normalize``). Without, the elements are a chunk of one tensor that
    needs no shaping (:func:`~learned_opt.orthogonal.needs_whole_tensor` is False for it).

    A per-tensor reduction here (for example a unit-RMS normalisation of the direction)
    needs the whole tensor's ``d``: every caller but the chunked path holds it; the chunked
    path would keep its chunks' outputs and apply this stage per tensor.
    """
    inplace = scratch is not None

    def into(t: Tensor) -> Tensor | None:
        return t if inplace else None

    adam = adam_direction(m1, v, step, cfg.eps, out=scratch)
    direction = torch.add(d, adam, out=into(d))
    direction = torch.clamp(direction, -cfg.max_direction, cfg.max_direction, out=into(d))
    if shapes is not None:
        direction = shape_direction(cfg, shapes, direction, m1, d)
    magnitude = step_magnitude(log_mag, scale, out=into(log_mag))
    return torch.addcmul(p, direction, magnitude, out=into(p))


def step_magnitude(log_mag: Tensor, scale: Tensor | float, out: Tensor | None = None) -> Tensor:
    """The per-element step magnitude ``exp(log_mag) * scale`` that
    :func:`apply_update` multiplies the direction by (into ``out`` if given)."""
    magnitude = torch.exp(log_mag, out=out)
    return torch.mul(magnitude, scale, out=out)
