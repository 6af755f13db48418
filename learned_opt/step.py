"""The learned step, written once: reduce per tensor, then the per-tensor context, then the
per-element update.

The step acts on the layout-neutral view of :mod:`learned_opt.segments`: element tensors
``[B, P]`` whose last dim concatenates ``T`` parameter tensors (segments) and whose rows
``B`` are independent (workers). :func:`flat_step` runs the skeleton on that view:

1. **reduce**: the per-tensor sums of a :class:`TensorSums` record (masking, rms of the
   gradient, mean of ``v``, the step-size adaptation's dot products);
2. **context**: the per-tensor network (:func:`tensor_context`): feature normalisers, the
   per-element MLP's first-layer bias and each tensor's step scale;
3. **update**: the per-element MLP and the output parameterisation (:func:`apply_update`;
   matrices take the orthogonalised direction of :mod:`learned_opt.orthogonal`).

It is pure and differentiable in theta: meta-training unrolls it over a flat vector of all
tensors, and :func:`tensor_step` is the same step on a one-segment view of one tensor,
which :mod:`learned_opt.kernel` runs eagerly and compiled. :class:`Parts` says which
networks can change the result: a rule whose heads are zero (the shipped single-worker
rule) evaluates neither network, and gives the same values.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from .config import MOMENTUM_DECAYS, NetConfig
from .features import (
    adam_direction,
    adapt_log_lr,
    bias_correction,
    compute_dtype,
    constant,
    corrected_v_mean,
    element_features,
    feature_scales,
    safe_sqrt,
    shape_stats,
    stepped,
    tensor_stats,
    time_features,
    update_moments,
)
from .network import (
    Theta,
    element_bias,
    element_layers,
    element_mlp,
    head_is_nonzero,
    tensor_head,
)
from .orthogonal import gram_layout, gram_numel, is_matrix, ns_due, shape_direction
from .segments import FlatLayout, one_segment, segment_expand, segment_mean, segment_sum


class Parts(NamedTuple):
    """Which parts of the network can change the step (see :func:`active_parts`).

    ``tensor_net``: the per-tensor network's output head is not zero (else every tensor's
    log step scale is 0 and its context is the MLP's own first bias). ``element_net``: the
    per-element MLP's output head is not zero (else its direction and magnitude are exactly
    0, and the features it reads are never built)."""

    tensor_net: bool = True
    element_net: bool = True


#: Every part evaluated: what meta-training differentiates through.
ALL_PARTS = Parts()


def moment_rows(parts: Parts, sparse_rows: bool = False) -> int:
    """How many of the momenta (``m``'s rows, decays
    :data:`~learned_opt.config.MOMENTUM_DECAYS`) the step under ``parts`` reads: all three
    when a network is evaluated (its features read them), else the momentum that the
    update reads (0.9) and the one that the step-size adaptation reads
    (:func:`adapt_row`): one row, or two for a row-sparse matrix (``sparse_rows``). The
    rows past these are neither read nor updated: they are work that cannot change the
    result of a rule whose heads are zero, and the optimizer keeps only these rows, so
    that such a rule's state is 8 bytes per float32 parameter, as AdamW's (12 for an
    embedding table)."""
    if parts.tensor_net or parts.element_net:
        return 3
    return 2 if sparse_rows else 1


def adapt_row(sparse_rows: bool) -> int:
    """The momentum (``m``'s row) that the step-size adaptation reads its cosine against:
    the 0.9 momentum (row 0), and the 0.99 momentum (row 1) for a row-sparse matrix.

    A table row sits in a batch now and then, so the 0.9 momentum of a row-sparse matrix
    is mostly the decayed memory of rows that are absent now: its cosine with the present
    gradient is small and noisy, and the adapted step sizes sank to the floor. Read against
    the 0.99 momentum, the signal spans the rows' visits; measured on the validation
    family's recommender: 0.92x tuned AdamW against 0.68x (``validation_sparse_lag.json``),
    and no other row changes (none has a row-sparse matrix)."""
    return 1 if sparse_rows else 0


def fit_moment_rows(m: Tensor, rows: int) -> Tensor:
    """Momenta ``m`` (``[k, *shape]``) as the first ``rows`` of them: the rows past ``k``
    start at zero (a rule that now reads the slower momenta, after a change of theta or
    loading a rule without networks' state), the rows past ``rows`` are dropped (a rule
    that no longer reads them); ``m`` itself when it holds ``rows`` already."""
    if m.shape[0] == rows:
        return m
    if m.shape[0] > rows:
        return m[:rows].clone()
    return torch.cat([m, m.new_zeros(rows - m.shape[0], *m.shape[1:])])


def fit_state_rows(state: dict, parts: Parts) -> None:
    """Fit a tensor's optimizer state (a dict holding ``m``, and its ``sparse_rows`` mark if
    it has one) to the momenta the step under ``parts`` reads for it, in place:
    :func:`fit_moment_rows` to :func:`moment_rows` (saved, or kept, for a rule that read
    other rows)."""
    state["m"] = fit_moment_rows(state["m"], moment_rows(parts, bool(state.get("sparse_rows"))))


def active_parts(theta: Theta) -> Parts:
    """The :class:`Parts` of ``theta`` whose output heads hold a non-zero value (one look at
    theta; call again after changing it)."""
    return Parts(
        tensor_net=head_is_nonzero(theta, "tensor_out"),
        element_net=head_is_nonzero(theta, "elem_out"),
    )


class TensorSums(NamedTuple):
    """The reduce stage's per-tensor values, each ``[B, T]``."""

    ok: Tensor  # the tensor is stepped: its gradient and parameter are finite
    g_sum_squares: Tensor  # sum of g^2 (0 where not ok)
    g_rms: Tensor  # root mean square of g
    v_mean: Tensor  # mean of the second moment after this step's update
    g_dot_m: Tensor | None  # sum of g * m_a (m_a: adapt_momentum), when adapting step sizes
    m_sum_squares: Tensor | None  # sum of m_a^2, likewise


def init_flat_state(
    p: Tensor, layout: FlatLayout | None = None, rows: int = 3
) -> dict[str, Tensor]:
    """Zero state for flat parameters ``[B, P]``: ``m`` ``[B, rows, P]`` (the first ``rows``
    momenta: all three, or the :func:`moment_rows` a step reads) and ``v`` ``[B, P]``, and
    with ``layout`` the per-tensor log step multipliers ``log_lr`` ``[B, T]``."""
    b, n = p.shape
    state = {"m": p.new_zeros(b, rows, n), "v": p.new_zeros(b, n)}
    if layout is not None:
        state["log_lr"] = p.new_zeros(b, len(layout.shapes))
    return state


def adapt_momentum(m: Tensor, layout: FlatLayout) -> Tensor:
    """Per element, the momentum before this step that the adaptation reads (``[..., P]``
    of ``m``'s ``[..., k, P]``): :func:`adapt_row` of each segment."""
    sparse = layout.sparse_rows or (False,) * len(layout.shapes)
    if all(sparse):
        return m[..., adapt_row(True), :]
    fast = m[..., adapt_row(False), :]
    if not any(sparse):
        return fast
    mask = segment_expand(constant(sparse, torch.bool, m.device), layout)
    return torch.where(mask, m[..., adapt_row(True), :], fast)


def reduce_sums(
    cfg: NetConfig,
    layout: FlatLayout,
    ok: Tensor,
    g_sum_squares: Tensor,
    g_in: Tensor,
    m: Tensor,
    v_new: Tensor,
    masked: bool = True,
) -> TensorSums:
    """The reduce stage after masking: per-tensor sums of the masked gradient ``g_in``, the
    momentum before this step that the adaptation reads (:func:`adapt_momentum`) and the
    new second moment. ``ok`` and ``g_sum_squares`` (of the raw gradient) come from
    :func:`~learned_opt.features.stepped`'s test, made before the gradient is masked;
    ``masked=False``: every tensor is known to be stepped (``ok`` all true)."""
    if masked:
        zero = torch.zeros((), dtype=g_in.dtype, device=g_in.device)
        g_sum_squares = torch.where(ok, g_sum_squares, zero)
    sizes = constant(tuple(max(n, 1) for n in layout.numels), g_in.dtype, g_in.device)
    g_dot_m = m_sum_squares = None
    if cfg.adapts_lr:
        m1 = adapt_momentum(m, layout)
        g_dot_m, m_sum_squares = segment_sum(g_in * m1, layout), segment_sum(m1 * m1, layout)
    return TensorSums(
        ok, g_sum_squares, safe_sqrt(g_sum_squares / sizes), segment_mean(v_new, layout),
        g_dot_m, m_sum_squares,
    )  # fmt: skip


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
    q: Tensor | None = None,
    return_finite: bool = False,
    parts: Parts = ALL_PARTS,
    read_mask: bool = False,
    decay: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Learned step of every segment of ``p`` (``[B, P]``; ``m`` is ``[B, k, P]``, ``k`` at
    least :func:`moment_rows`); returns
    ``(new_p, new_m, new_v)``, then ``new_log_lr`` if ``log_lr`` is given, then ``new_q``
    if ``q`` is given, then the ``[B, T]`` mask of segments that were stepped if
    ``return_finite``. ``step`` is the
    1-based step count after this update: a number, or a ``[B, 1]`` tensor (a count per
    row). ``new_m`` holds the first :func:`moment_rows` rows of ``m`` (``[B, k, P]``): the
    rows after them are unchanged.

    ``log_lr`` (``[B, T]``) are the segments' adapted log step multipliers
    (:func:`~learned_opt.features.adapt_log_lr`); a config that adapts them needs them, and
    one that does not passes them through unchanged. ``q`` (``[B, Q]``,
    :func:`~learned_opt.orthogonal.gram_layout`) holds the Gram polynomials of the matrices that keep one between Newton-Schulz
    iterations (:attr:`~learned_opt.config.NetConfig.ns_every`); without it every matrix
    iterates at every step. ``parts``: the networks to evaluate
    (:func:`active_parts`; all of them by default).

    ``lr`` is the step multiplier: a number or 0-d tensor, or one per segment (``[T]``,
    or ``[B, 1]`` for rows of one segment: param groups stepped in one call).
    ``cfg.weight_decay`` above 0 multiplies every segment by
    ``1 - weight_decay * step_mult * lr`` before its update (decoupled weight decay);
    ``decay``, one weight decay per segment shaped as ``lr``, replaces it where given.

    A segment whose gradient or parameter holds NaN or Inf is left unchanged (parameter
    and state; see :func:`~learned_opt.features.stepped`), and its values never reach the
    other segments or, through autograd, theta. ``read_mask`` (an eager caller on CPU, not
    traced or vmapped): read that mask on the host, and where every segment is stepped
    leave out the masking, which is then the identity (five passes over the elements).
    """
    if cfg.adapts_lr and log_lr is None:
        raise ValueError("this config adapts per-tensor step sizes: flat_step needs log_lr")
    g_sum_squares = segment_sum(g * g, layout)  # [B, T]
    ok = stepped(g_sum_squares, segment_sum(p * p, layout))
    masked = not (read_mask and bool(ok.all()))
    g_in, p_in = g, p
    if masked:
        keep = segment_expand(ok, layout)
        zero = torch.zeros((), dtype=p.dtype, device=p.device)
        g_in, p_in = torch.where(keep, g, zero), torch.where(keep, p, zero)
    rows = moment_rows(parts, any(layout.sparse_rows))
    if m.shape[-2] < rows:
        raise ValueError(f"this step reads {rows} momenta, m holds {m.shape[-2]}")
    m = m[..., :rows, :]  # the rows no evaluated part reads stay as they are
    m_new, v_new = update_moments(g_in, m, v)
    sums = reduce_sums(cfg, layout, ok, g_sum_squares, g_in, m, v_new, masked)
    matrices = layout.matrices(cfg)
    # for the adaptation and the context
    stats = shape_stats(layout.shapes, cfg, p, matrices, layout.sparse_rows)
    new_log_lr = log_lr
    if cfg.adapts_lr:
        sizes = constant(tuple(max(n, 1) for n in layout.numels), p.dtype, p.device)
        adapted = adapt_log_lr(
            log_lr, sums.g_dot_m, sums.g_sum_squares, sums.m_sum_squares, sums.v_mean,
            sizes, step, cfg, lr, stats[:, 3],
        )  # fmt: skip
        new_log_lr = torch.where(sums.ok, adapted, log_lr)
    x = ms = None
    if parts.tensor_net or parts.element_net:
        x = element_features(p_in, g_in, m_new, v_new, segment_expand(sums.g_rms, layout), cfg)
        ms = segment_mean(x * x, layout).transpose(-1, -2)  # [B, T, 11]
    scales, bias, scale = tensor_context(
        theta, cfg, ms, sums.v_mean, stats, step, lr, new_log_lr, parts
    )
    if cfg.ortho_snr and any(matrices):
        snr = momentum_snr(m_new[..., 0, :], sums.v_mean, step, layout)
        mask = constant(matrices, torch.bool, p.device)
        scale = torch.where(mask, scale * snr**cfg.ortho_snr, scale)
    if decay is not None or cfg.weight_decay:  # decoupled, AdamW's at lr * step_mult
        rate = cfg.weight_decay if decay is None else decay  # see NetConfig.weight_decay
        factor = 1.0 - rate * cfg.step_mult * lr
        if isinstance(factor, Tensor) and factor.dim():  # per segment
            factor = segment_expand(factor, layout)
        p_in = p_in * factor
    d = log_mag = None
    if parts.element_net:
        layers = element_layers(theta, cfg, p.dtype, segment_expand(bias.transpose(-1, -2), layout))
        d, log_mag = element_mlp(layers, x * segment_expand(scales.transpose(-1, -2), layout))
    keeping = gram_layout(cfg, layout.shapes, matrices) if q is not None else ()
    size = sum(gram_numel(layout.shapes[k]) for k in keeping)
    if q is not None and q.shape[-1] != size:
        raise ValueError(f"q holds {q.shape[-1]} elements, the layout's Gram polynomials {size}")
    refresh = ns_due(cfg, step) if keeping else True
    new_p, new_q = apply_update(
        cfg, p_in, d, log_mag, m_new[..., 0, :], v_new, step, segment_expand(scale, layout),
        layout.shapes, matrices, q if keeping else None, refresh, g_in,
    )  # fmt: skip
    out = (new_p, m_new, v_new)
    if masked:
        out = (
            torch.where(keep, new_p, p),
            torch.where(keep.unsqueeze(-2), m_new, m),
            torch.where(keep, v_new, v),
        )
        if new_q is not None:
            ok_q = [
                sums.ok[..., k : k + 1].expand(*q.shape[:-1], gram_numel(layout.shapes[k]))
                for k in keeping
            ]
            new_q = torch.where(ok_q[0] if len(ok_q) == 1 else torch.cat(ok_q, -1), new_q, q)
    if log_lr is not None:
        out = (*out, new_log_lr)
    if q is not None:
        out = (*out, q if new_q is None else new_q)
    return (*out, sums.ok) if return_finite else out


def momentum_snr(m1: Tensor, v_mean: Tensor, step, layout: FlatLayout) -> Tensor:
    """Per tensor (``[..., T]``), ``min(1, rms(m1_hat) / sqrt(mean(v_hat)))``: the
    bias-corrected 0.9 momentum's RMS over the gradient's, about 1 where gradients agree
    from step to step and ``sqrt(0.1 / 1.9)``, 0.23, for pure noise (see
    :attr:`~learned_opt.config.NetConfig.ortho_snr`)."""
    bc1 = bias_correction(MOMENTUM_DECAYS[0], step, m1)
    m_hat_ms = segment_mean(m1 * m1, layout) / (bc1 * bc1)
    ratio = m_hat_ms / (corrected_v_mean(v_mean, step) + 1e-30)
    return torch.sqrt(torch.clamp(ratio, max=1.0))


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
    *,
    parts: Parts = ALL_PARTS,
    return_finite: bool = False,
    sparse_rows: bool = False,
    read_mask: bool = False,
) -> tuple[Tensor, ...]:
    """Pure learned step of one tensor: :func:`flat_step` on a one-segment view
    (``sparse_rows``: a row-sparse matrix, see :class:`~learned_opt.segments.FlatLayout`).

    ``m`` is ``(k, *p.shape)``, ``k`` at least :func:`moment_rows`; computes in
    :func:`~learned_opt.features.compute_dtype`. Returns ``(new_p, new_m, new_v)``
    (``new_m``: the first :func:`moment_rows` rows), and the new ``log_lr`` (a scalar)
    after them if ``log_lr`` is given (a config that adapts step sizes needs it), then
    whether the tensor was stepped if ``return_finite``; differentiable in theta, p, g, m
    and v, and works under ``torch.func.vmap`` (stacked workers). A gradient or parameter holding NaN
    or Inf leaves ``p``, ``m``, ``v`` and ``log_lr`` unchanged. ``read_mask``: see
    :func:`flat_step`.
    """
    dtype = compute_dtype(p)
    out = flat_step(
        theta, cfg, one_segment(p.shape, sparse_rows),
        p.to(dtype).reshape(1, -1), g.to(dtype).reshape(1, -1),
        m.reshape(1, m.shape[0], -1), v.reshape(1, -1), step, lr,
        log_lr=None if log_lr is None else log_lr.reshape(1, 1),
        return_finite=True, parts=parts, read_mask=read_mask,
    )  # fmt: skip
    new_p, new_m, new_v = out[:3]
    new_m = new_m.reshape(-1, *p.shape)
    new = (new_p.reshape(p.shape).to(p.dtype), new_m, new_v.reshape(v.shape))
    if log_lr is not None:
        new = (*new, out[3].reshape(log_lr.shape))
    return (*new, out[-1].reshape(())) if return_finite else new


def tensor_context(
    theta: Theta,
    cfg: NetConfig,
    ms: Tensor | None,
    v_mean: Tensor,
    stats: Tensor,
    step,
    lr,
    log_lr: Tensor | None = None,
    parts: Parts = ALL_PARTS,
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """The per-tensor stage for a batch of tensors.

    ``ms`` (``(..., T, 11)``) are the feature mean squares (None when neither network is
    evaluated), ``v_mean`` (``(..., T)``) the means of v and ``stats`` the ``T`` tensors'
    :func:`~learned_opt.features.shape_stats` (``(T, 4)``); leading dims stack rows.
    Returns ``(feature_scales (..., T, 11), context_bias (..., T, H), scale (..., T))``:
    the normalisers of the features, the full first-layer bias of the per-element MLP
    (both None when ``parts`` evaluates no per-element MLP), and the step scale
    ``-lr * step_mult * exp(log_scale)``, times ``exp(log_lr)`` when the config adapts
    step sizes and times each tensor's factor on its base step (the third column of its
    :func:`~learned_opt.features.shape_stats`: its width factor, and a row-sparse table's
    ``table_step_mult``).
    """
    stats = stats.expand(*v_mean.shape, 4)
    time = time_features(step, cfg, v_mean) if parts.tensor_net or parts.element_net else None
    bias = None
    width_factor = stats[..., 2].to(v_mean.dtype)
    if parts.tensor_net:
        log_scale, bias = tensor_head(theta, cfg, tensor_stats(ms, v_mean, stats[..., :2]), time)
        log_scale = log_scale + width_factor
    else:
        log_scale = width_factor
        if parts.element_net:
            bias = element_bias(theta, time).expand(*v_mean.shape, cfg.width)
    if cfg.adapts_lr:
        log_scale = log_scale + log_lr
    scales = feature_scales(ms) if parts.element_net else None
    bias = bias if parts.element_net else None
    return scales, bias, (-lr * cfg.step_mult) * torch.exp(log_scale)


def adam_span(shapes, matrices) -> tuple[int, int]:
    """The elements ``[lo, hi)`` from the first segment that is not a matrix to the end of
    the last one (``(0, 0)`` when every segment is): where the Adam form is computed."""
    numels = [math.prod(s) for s in shapes]
    starts = [0, *itertools.accumulate(numels)]
    others = [k for k, matrix in enumerate(matrices) if not matrix]
    return (starts[others[0]], starts[others[-1] + 1]) if others else (0, 0)


def apply_update(
    cfg: NetConfig,
    p: Tensor,
    d: Tensor | None,
    log_mag: Tensor | None,
    m1: Tensor,
    v: Tensor,
    step,
    scale: Tensor,
    shapes,
    matrices=None,
    q: Tensor | None = None,
    refresh: bool | Tensor = True,
    g: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The output parameterisation: the new parameter, and the matrices' new Gram
    polynomials (``q`` and ``refresh``: see :func:`~learned_opt.orthogonal.shape_direction`;
    None without ``q``). ``g``: this step's gradient, which the matrices that take the
    Nesterov input mix into what they orthogonalise (see
    :func:`~learned_opt.orthogonal.shape_direction`; None: none does). The new parameter is

        p + scale * clamp(adam_dir + d, +-max_direction) * exp(log_mag)

    where ``adam_dir`` is Adam's bias-corrected direction from ``m1`` (the 0.9 momentum)
    and ``v``, ``d`` and ``log_mag`` (``exp_mult * a``) are the per-element MLP's outputs
    (None: zero) and ``scale`` the per-tensor step scale broadcast to the elements. Zero
    heads give exactly Adam with learning rate ``lr * step_mult``. ``shapes`` are the
    segments' shapes and ``matrices`` which of them take the orthogonalised direction
    (:func:`~learned_opt.orthogonal.shape_direction`).
    """
    if matrices is None:
        matrices = tuple(is_matrix(tuple(s), cfg) for s in shapes)
    # a matrix's direction reads only m1 and d: the Adam form spans the other segments
    # only (none when all are matrices; a pack orders its matrices last)
    lo, hi = adam_span(shapes, matrices)
    direction = None
    if not matrices or not all(matrices):
        direction = adam_direction(m1[..., lo:hi], v[..., lo:hi], step, cfg.eps)
        if d is not None:
            direction = direction + d[..., lo:hi]
        direction = torch.clamp(direction, -cfg.max_direction, cfg.max_direction)
    direction, new_q = shape_direction(
        cfg, shapes, direction, m1, d, matrices, q, refresh, g, direction_at=lo
    )  # fmt: skip
    magnitude = scale if log_mag is None else torch.exp(log_mag) * scale
    return torch.addcmul(p, direction, magnitude), new_q
