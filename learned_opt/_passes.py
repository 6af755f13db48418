"""The two passes of the fused step (:mod:`learned_opt._fused`), written once.

* :func:`tensor_sums`, the reduction pass: reads p, g and the state, and returns the
  masking flag, rms(g), the feature mean squares and mean(v) (nothing is written);
* :func:`tensor_tables`, between them: the per-tensor stage for all tensors at once;
* :func:`update_tensor_`, the update pass: reads p, g and the state once, updates the
  moments, computes the features, the per-element MLP and the output stage per element,
  and writes p and the state once;
* :func:`direction_tensor_`, the update pass of an "ortho" matrix: the same up to the
  MLP, then it writes the state and, instead of p, what the matrix's orthogonalised
  direction is built from (the Newton-Schulz step itself needs the whole matrix and runs
  after it, :func:`learned_opt.orthogonal.ortho_direction`).

Each pass serves one tensor, or many small tensors packed into one vector
(:func:`update_packed_`; :class:`learned_opt._operands.Pack`), whose per-tensor sums and
values go through :func:`_reductions`. The formulas are those of
:mod:`learned_opt.features`, :mod:`learned_opt.network` and :mod:`learned_opt.stages`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NetConfig
from .features import adapt_log_lr, feature_rows, safe_sqrt, stepped, update_moments
from .network import Layers, Theta, element_mlp_rows
from .orthogonal import ortho_input
from .stages import apply_update, step_magnitude, tensor_context


def tensor_sums(
    p: Tensor,
    g: Tensor,
    m0: Tensor,
    m1: Tensor,
    m2: Tensor,
    v: Tensor,
    cfg: NetConfig,
    seg: Tensor | None = None,
    sizes: Tensor | None = None,
) -> Tensor:
    """The reduction pass of one tensor: ``(14,)`` = whether it is stepped (1 or 0), rms(g),
    the mean squares of the 11 features after this step's moment update, and mean(v); when
    ``cfg`` adapts step sizes, ``(17,)``: then ``g . m1`` and ``m1^2`` (the 0.9 momentum
    before the update) and ``g^2``, the sums :func:`~learned_opt.features.adapt_log_lr` reads.
    With ``cfg.output == "ortho"`` one more, last: the mean square of the 0.9 momentum after
    the update, which :func:`direction_tensor_` scales it by.

    ``p`` and ``g`` are ``[n]`` in any floating dtype, the momentum rows ``m0, m1, m2`` and
    ``v`` ``[n]`` in the compute dtype; nothing is written. Where the gradient or the
    parameter holds NaN or Inf, the first entry is 0 (the tensor is skipped; the rest is
    then meaningless).

    With ``seg`` (``[n]``: the index of each element's tensor) and ``sizes`` (``[T]``: the
    tensors' sizes, in the compute dtype), the elements are ``T`` small tensors packed
    (:class:`~learned_opt._operands.Pack`): the same sums per tensor, ``(T, 14)`` (or ``(T, 17)``).
    """
    dtype = v.dtype
    p_c, g_c = p.to(dtype), g.to(dtype)
    dot, mean, at = _reductions(seg, sizes)
    count = v.shape[-1] if sizes is None else sizes
    g_ss, p_ss = dot(g_c, g_c), dot(p_c, p_c)
    ok = stepped(g_ss, p_ss)
    m_new, v_new = update_moments(g_c, (m0, m1, m2), v)
    g_rms = safe_sqrt(g_ss / count)
    rows = feature_rows(p_c, g_c, m_new, v_new, at(g_rms), cfg)
    ms = torch.stack([mean(r * r) for r in rows], dim=-1)
    out = [torch.stack([ok.to(dtype), g_rms], dim=-1), ms, mean(v_new).unsqueeze(-1)]
    if cfg.adapts_lr:
        out.append(torch.stack([dot(g_c, m0), dot(m0, m0), g_ss], dim=-1))
    if cfg.output == "ortho":
        out.append(mean(m_new[0] * m_new[0]).unsqueeze(-1))
    return torch.cat(out, dim=-1)


def _reductions(seg: Tensor | None, sizes: Tensor | None):
    """``(dot, mean, at)`` over one tensor (``seg`` None), or per tensor of the packed ones:
    ``dot(x, y)`` the sum of ``x * y``, ``mean(x)`` and ``at(t)``, which takes per-tensor
    values (``[..., T]``) to the elements (``[..., n]``). Per tensor the sums are
    ``index_add`` in element order (on the one thread of the compiled pass: repeatable)."""
    if seg is None:
        return torch.dot, torch.mean, lambda t: t

    def total(x: Tensor) -> Tensor:
        return torch.zeros_like(sizes).index_add(0, seg, x)

    return (lambda x, y: total(x * y)), (lambda x: total(x) / sizes), (lambda t: t[..., seg])


def update_tensor_(
    layers: Layers,
    p: Tensor,
    g: Tensor,
    m0: Tensor,
    m1: Tensor,
    m2: Tensor,
    v: Tensor,
    g_rms: Tensor,
    scale: Tensor,
    step: Tensor,
    cfg: NetConfig,
    scales: Tensor | None = None,
    keep: Tensor | None = None,
) -> None:
    """The update pass of one tensor, in place: read p, g, m and v once; update the
    moments, compute the features, the per-element MLP (``layers`` of the tensor, its
    feature normalisation and context folded in) and the output stage per element; write
    p, m and v once. ``g_rms``, ``scale`` (the step scale) and ``step`` are 0-d tensors.

    The momenta come as their three rows ``m0, m1, m2`` (``[n]`` each) and every formula
    is applied row by row, so that each op has the shape ``[n]`` and inductor fuses the
    whole pass into one loop that writes each row directly (a ``[3, n]`` intermediate
    would cost a loop of its own and a buffer of ``3n`` floats). The compiled caller
    passes rows that do not share a storage object (:func:`~learned_opt._operands.operands`); rows of one storage
    would make the compiler treat the three writes as overlapping and copy through
    buffers.

    For packed tensors (:func:`update_packed_`) the per-tensor values come per element:
    ``g_rms``, ``scale`` and ``keep`` (where to write) ``[n]``, the first layer's bias
    ``(H, n)`` and the feature normalisers ``scales`` (``(11, n)``), which the first layer
    then does not fold in."""
    p_c, m_new, v_new, d, log_mag = _element_outputs(layers, p, g, m0, m1, m2, v, g_rms,
                                                     cfg, scales)  # fmt: skip
    new_p = apply_update(cfg, p_c, d, log_mag, m_new[0], v_new, step, scale)
    if keep is not None:  # a packed tensor that is skipped keeps its values
        new_p = torch.where(keep, new_p, p_c)
        m_new = [torch.where(keep, new, old) for new, old in zip(m_new, (m0, m1, m2))]
        v_new = torch.where(keep, v_new, v)
    p.copy_(new_p)
    _write_state(m0, m1, m2, v, m_new, v_new)


def direction_tensor_(layers: Layers, p: Tensor, g: Tensor, m0: Tensor, m1: Tensor,
                      m2: Tensor, v: Tensor, g_rms: Tensor, scale: Tensor, m1_ms: Tensor,
                      z: Tensor, magnitude: Tensor, cfg: NetConfig) -> None:  # fmt: skip
    """The update pass of one "ortho" matrix (:func:`~learned_opt.orthogonal.is_matrix`),
    in place, but for p: everything :func:`update_tensor_` does up to the per-element MLP,
    then it writes the state, the matrix's :func:`~learned_opt.orthogonal.ortho_input` into
    ``z`` and the per-element step magnitude ``exp(log_mag) * scale`` into ``magnitude``
    (both ``[n]`` in the compute dtype). The caller then steps p by
    ``ortho_direction(z) * magnitude`` (:func:`~learned_opt.stages.apply_update`'s formula
    for a matrix). ``m1_ms`` is the last entry of the tensor's :func:`tensor_sums`."""
    p_c, m_new, v_new, d, log_mag = _element_outputs(layers, p, g, m0, m1, m2, v, g_rms, cfg)
    z.copy_(ortho_input(m_new[0], m1_ms, d))
    magnitude.copy_(step_magnitude(log_mag, scale))
    _write_state(m0, m1, m2, v, m_new, v_new)


def _element_outputs(layers, p, g, m0, m1, m2, v, g_rms, cfg, scales=None):
    """``(p, m_new, v_new, d, log_mag)`` of the update passes: p in the compute dtype, the
    updated moments and the per-element MLP's outputs."""
    dtype = v.dtype
    p_c, g_c = p.to(dtype), g.to(dtype)
    m_new, v_new = update_moments(g_c, (m0, m1, m2), v)
    rows = feature_rows(p_c, g_c, m_new, v_new, g_rms, cfg)
    if scales is not None:
        rows = [r * s for r, s in zip(rows, scales.unbind(0))]
    d, log_mag = element_mlp_rows(layers, rows)
    return p_c, m_new, v_new, d, log_mag


def _write_state(m0, m1, m2, v, m_new, v_new) -> None:
    for row, new in zip((m0, m1, m2), m_new):
        row.copy_(new)
    v.copy_(v_new)


def update_packed_(
    layers: Layers,
    p: Tensor,
    g: Tensor,
    m0: Tensor,
    m1: Tensor,
    m2: Tensor,
    v: Tensor,
    seg: Tensor,
    g_rms: Tensor,
    scale: Tensor,
    scales: Tensor,
    ok: Tensor,
    step: Tensor,
    cfg: NetConfig,
) -> None:
    """The update pass (:func:`update_tensor_`) of ``T`` small tensors packed into ``[n]``
    vectors (:class:`~learned_opt._operands.Pack`), in place. Per-tensor values are tables that ``seg`` (``[n]``)
    indexes per element: ``g_rms``, ``scale`` and ``ok`` (whether to step) ``[T]``, the
    feature normalisers ``scales`` ``(11, T)`` and the first layer's bias ``(H, T)`` in
    ``layers``, whose first weight does not fold the normalisers in."""
    (w1, b1), *shared = layers
    at = _reductions(seg, None)[2]
    own = ((w1, at(b1)), *shared)
    update_tensor_(own, p, g, m0, m1, m2, v, at(g_rms), at(scale), step, cfg, at(scales), at(ok))


def tensor_tables(
    theta: Theta,
    sums: Tensor,
    stats: Tensor,
    log_lr: Tensor,
    numel: Tensor,
    step: Tensor,
    lr: Tensor,
    cfg: NetConfig,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The per-tensor stage of ``T`` tensors from their reduction-pass rows ``sums``
    (``(T, 14)`` or ``(T, 17)``, :func:`tensor_sums`): ``(scales, bias, scale, log_lr)``,
    those of :func:`~learned_opt.stages.tensor_context` and the adapted log step
    multipliers (:func:`~learned_opt.features.adapt_log_lr`; ``log_lr`` as given when
    ``cfg`` does not adapt them, and then ``log_lr`` and ``numel``, the tensors' sizes, are
    not read). ``stats``: the tensors' :func:`~learned_opt.features.shape_stats`; ``step``
    and ``lr``: 0-d tensors. A skipped tensor's row is computed too, and never used."""
    if cfg.adapts_lr:
        log_lr = adapt_log_lr(
            log_lr, sums[:, 14], sums[:, 16], sums[:, 15], sums[:, 13], numel, step, cfg, lr,
            stats[:, 3],
        )  # fmt: skip
    ms, v_mean = sums[:, 2:13], sums[:, 13]
    scales, bias, scale = tensor_context(theta, cfg, ms, v_mean, stats, step, lr, log_lr)
    return scales, bias, scale, log_lr
