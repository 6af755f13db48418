"""The "ortho" output parameterisation: orthogonalised steps for matrices.

Hidden weight matrices are stepped along an orthogonalised direction, as in Muon and
Celo2: the quintic Newton-Schulz iteration (coefficients 3.4445, -4.7750, 2.0315) maps a
matrix ``X = U S V^T`` close to ``U V^T``, so every singular direction moves by about the
same amount whatever the gradient's spectrum. The learned per-element output ``d`` enters
before the orthogonalisation (the network shapes the direction; the scale stays bounded):

    matrix step   = scale * ortho_step_mult / step_mult * rms_normalised(NS(m1 / rms(m1) + d))
    other tensors = scale * clamp(adam_dir + d)          (unit RMS if ``cfg.normalize``)

where ``scale = -lr * step_mult * exp(log_scale)`` is the per-tensor step scale. With zero
heads a matrix moves by exactly ``lr * ortho_step_mult`` (RMS) per step, along the
orthogonalised 0.9 momentum. A matrix is a 2-D tensor whose smaller dimension lies in
``[cfg.ortho_min_dim, cfg.ortho_max_dim]`` (the upper bound caps the cost of Newton-Schulz);
other matrices, convolution kernels (4-D) and vectors take the Adam form.

Everything here works on the layout-neutral view of :mod:`learned_opt.segments`
(``[..., P]`` with leading rows), is differentiable, and runs under ``torch.func.vmap``.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .config import NetConfig

#: Quintic Newton-Schulz coefficients (Muon's), tuned to converge from any scaled input.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_TINY = 1e-12


#: A matrix at least this many times wider than tall iterates on its Gram matrix (see
#: :func:`newton_schulz`). By FLOPs (``4 r^2 c + 34 r^3`` in five iterations against
#: ``20 r^2 c + 10 r^3``) and by time the Gram iteration pays from ``c = 2 r`` (one thread:
#: 128 x 256 took 1.16 ms against 1.52 ms), but it works on ``S = x x^T``, whose condition
#: number is the square of ``x``'s: on a momentum close to rank one (consistent gradients),
#: 64 x 32 matrices stepped in two summation orders of their input drifted apart beyond the
#: tests' 1e-5 within six steps, where the iteration on the matrix itself stays within it
#: (``test_lr_adapt``). At 3, the bound measured before, they hold.
GRAM_RATIO = 3


def newton_schulz(x: Tensor, steps: int) -> Tensor:
    """Approximately orthogonalise the matrices ``x`` (``[..., r, c]``): ``U V^T`` of their
    SVD, with singular values brought near 1 (within about [0.7, 1.2]). A zero matrix maps to
    zero.

    Each iteration is ``y <- a y + (b A + c A^2) y`` with ``A = y y^T`` (``r <= c``; a tall
    matrix is transposed), three matrix products whose scalings fold into the products
    (``baddbmm``'s ``beta`` and ``alpha``). A matrix at least :data:`GRAM_RATIO` times wider
    than tall takes the same iteration on its ``r x r`` Gram matrix
    (:func:`gram_polynomial`), four ``r x r`` products an iteration instead of two ``r x c``
    ones and one ``r x r``, and ``y = Q x`` once at the end. Same values up to rounding,
    about 2x fewer FLOPs at ``c = 4 r``."""
    a, b, c = NS_COEFFICIENTS
    wide = x.shape[-2] <= x.shape[-1]
    y = x if wide else x.transpose(-1, -2)
    lead, (r, cols) = y.shape[:-2], y.shape[-2:]
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    y = (y / (norm + 1e-7)).reshape(-1, r, cols)
    if cols >= GRAM_RATIO * r:
        q = gram_polynomial(y, steps)
        if not wide:  # (q y)^T = y^T q^T: the tall result in its own layout, not a copy
            return torch.bmm(y.transpose(-1, -2), q.transpose(-1, -2)).reshape(x.shape)
        y = torch.bmm(q, y)
    else:
        for _ in range(steps):
            gram = torch.bmm(y, y.transpose(-1, -2))
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.baddbmm(y, poly, y, beta=a)
    y = y.reshape(*lead, r, cols)
    return y if wide else y.transpose(-1, -2)


def newton_schulz_reusing(
    x: Tensor, q: Tensor, refresh: bool | Tensor, steps: int
) -> tuple[Tensor, Tensor]:
    """:func:`newton_schulz` of the matrices ``x`` (``[..., r, c]``) where ``refresh``
    holds, and elsewhere the last Gram polynomial ``q`` (``[..., k, k]``, ``k`` the
    smaller side) applied to ``x`` at unit norm; returns the result and the polynomial it
    applied (``q`` itself when not refreshed).

    On a refreshed step the iteration runs on the Gram matrix whatever the aspect ratio
    (:func:`polynomial_of_gram`), so that ``Q`` exists to be kept: ``S = y y^T`` and
    ``Q y`` for a wide matrix, ``S = y^T y`` and ``y Q^T`` for a tall one, which is thus
    never transposed. Between, directions that grew since ``Q`` was computed are not
    equalised: a different rule, not a cheaper copy, chosen on the validation family
    (:attr:`~learned_opt.config.NetConfig.ns_every`). ``refresh`` is a bool, or a 0-d bool
    tensor in compiled code, where the choice is a ``torch.cond`` inside the kernel (given
    a transposed view of a matrix as its operand, AOTInductor's branch read wrong values on
    torch 2.13; the matrices in their own layout read right)."""
    wide = x.shape[-2] <= x.shape[-1]
    k = min(x.shape[-2:])
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    y = (x / (norm + 1e-7)).reshape(-1, *x.shape[-2:])
    kept = q.reshape(-1, k, k)

    def fresh(y_: Tensor, q_: Tensor) -> Tensor:
        gram = torch.bmm(y_, y_.transpose(-1, -2)) if wide else torch.bmm(y_.transpose(-1, -2), y_)
        return polynomial_of_gram(gram, steps)

    if isinstance(refresh, bool):
        new = fresh(y, kept) if refresh else kept
    else:
        new = torch.cond(refresh, fresh, lambda y_, q_: q_.clone(), (y, kept))
    out = torch.bmm(new, y) if wide else torch.bmm(y, new.transpose(-1, -2))
    return out.reshape(x.shape), new.reshape(q.shape)


def gram_polynomial(y: Tensor, steps: int) -> Tensor:
    """``Q`` (``[B, r, r]``) such that ``Q y`` is :func:`newton_schulz`'s result for the
    wide matrices ``y`` (``[B, r, c]``, ``r <= c``, already scaled to Frobenius norm at most
    1): the quintic iteration run on the Gram matrix ``S = y y^T``
    (:func:`polynomial_of_gram`)."""
    return polynomial_of_gram(torch.bmm(y, y.transpose(-1, -2)), steps)


def polynomial_of_gram(s: Tensor, steps: int) -> Tensor:
    """:func:`gram_polynomial` from the Gram matrices ``s`` (``[B, r, r]``). Every iterate
    is ``Q y`` with ``Q`` a polynomial in ``S`` (so ``Q`` and ``S`` commute and
    ``A = Q^2 S``), and ``Q <- a Q + (b A + c A^2) Q``; the first iteration, from
    ``Q = I``, is ``a I + b S + c S^2`` (one product)."""
    a, b, c = NS_COEFFICIENTS
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    q = torch.baddbmm(s, s, s, beta=b, alpha=c) + a * eye
    for _ in range(steps - 1):
        gram = torch.bmm(torch.bmm(q, q), s)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        q = torch.baddbmm(q, poly, q, beta=a)
    return q


def unit_rms(x: Tensor, dim=-1) -> Tensor:
    """``x`` scaled to unit root-mean-square over ``dim`` (zero stays zero)."""
    ms = x.square().mean(dim=dim, keepdim=True)
    return x * torch.rsqrt(ms + _TINY)


def ortho_input(m1: Tensor, m1_ms: Tensor, d: Tensor | None) -> Tensor:
    """What a matrix's direction orthogonalises: the 0.9 momentum ``m1`` at unit RMS
    (``m1_ms``: its mean square over the tensor, broadcastable) plus the MLP's direction
    output ``d`` (None: zero), elementwise."""
    unit = m1 * torch.rsqrt(m1_ms + _TINY)
    return unit if d is None else unit + d


def ortho_direction(cfg: NetConfig, shape, z: Tensor) -> Tensor:
    """The step direction of matrices of ``shape`` from their :func:`ortho_input` ``z``
    (``[..., numel]``, leading dims stack matrices): Newton-Schulz, then unit RMS per
    matrix, relative to the Adam form's ``step_mult``."""
    return _scaled(cfg, newton_schulz(z.reshape(*z.shape[:-1], *shape), cfg.ns_steps), z.shape)


def _scaled(cfg: NetConfig, o: Tensor, shape, dim=-1) -> Tensor:
    """Orthogonalised matrices ``o`` as step directions of ``shape`` (flat, or ``o``'s own
    with ``dim=(-2, -1)``): unit RMS per matrix, relative to the Adam form's
    ``step_mult``."""
    return (cfg.ortho_step_mult / cfg.step_mult) * unit_rms(o.reshape(shape), dim=dim)


def is_matrix(shape: tuple[int, ...], cfg: NetConfig) -> bool:
    """Whether a tensor of ``shape`` takes the orthogonalised step under ``cfg``."""
    if cfg.output != "ortho" or len(shape) != 2:
        return False
    return cfg.ortho_min_dim <= min(shape) <= cfg.ortho_max_dim


def is_wide_matrix(shape, cfg: NetConfig) -> bool:
    """Whether a tensor of ``shape`` is an orthogonalised matrix whose smaller side is at
    least :attr:`~learned_opt.config.NetConfig.ns_reuse_min_dim`: the matrices that may keep
    a Gram polynomial (:func:`reuses_gram`) and take the Nesterov input
    (:func:`takes_nesterov`)."""
    shape = tuple(shape)
    return is_matrix(shape, cfg) and min(shape) >= cfg.ns_reuse_min_dim


def reuses_gram(shape, cfg: NetConfig) -> bool:
    """Whether a matrix of ``shape`` keeps the Gram polynomial of its last Newton-Schulz
    iteration between iterations under ``cfg`` (:attr:`~learned_opt.config.NetConfig.ns_every`):
    optimizer state of :func:`gram_numel` elements."""
    return cfg.ns_every > 1 and is_wide_matrix(shape, cfg)


def takes_nesterov(shape, cfg: NetConfig) -> bool:
    """Whether a matrix of ``shape`` orthogonalises the Nesterov form of its momentum,
    ``(1 - w) m1 + w g`` with ``w`` :attr:`~learned_opt.config.NetConfig.ortho_nesterov`,
    instead of ``m1`` (see :func:`shape_direction`)."""
    return cfg.ortho_nesterov > 0 and is_wide_matrix(shape, cfg)


def gram_layout(cfg: NetConfig, shapes, matrices=None) -> tuple[int, ...]:
    """The segments (indices into ``shapes``) that keep a Gram polynomial under ``cfg``
    (:func:`reuses_gram`; ``matrices``: which segments are orthogonalised, by default
    :func:`is_matrix` of each shape), in the order of the flat ``q`` that
    :func:`shape_direction` and :func:`~learned_opt.step.flat_step` take: each ``r x r``
    flattened (:func:`gram_numel`)."""
    if matrices is None:
        matrices = tuple(is_matrix(tuple(s), cfg) for s in shapes)
    return tuple(k for k, s in enumerate(shapes) if matrices[k] and reuses_gram(s, cfg))


def gram_numel(shape) -> int:
    """Elements of the Gram polynomial a matrix of ``shape`` keeps: ``r x r``, ``r`` its
    smaller side."""
    return min(shape) ** 2


def ns_due(cfg: NetConfig, step) -> bool | Tensor:
    """Whether the matrices that keep their Gram polynomial (:func:`reuses_gram`) run
    Newton-Schulz at ``step``, the 1-based step count after this update: at steps 1,
    ``1 + ns_every``, ... ``step`` is a number or a tensor of per-row counts; rows stepped
    together iterate together, so when any row is due all are (a row that is not takes a
    fresh polynomial, as it would on its own next step). A bool, except in compiled code,
    where it is a 0-d bool tensor that the kernel branches on."""
    if not isinstance(step, Tensor):
        return (int(step) - 1) % cfg.ns_every == 0
    due = (torch.remainder(step - 1, cfg.ns_every) == 0).any()
    return due if torch.compiler.is_compiling() else bool(due)


def needs_whole_tensor(cfg: NetConfig, shape) -> bool:
    """Whether the output stage of a tensor of ``shape`` reduces over the whole tensor, so
    that a layout which sees it in chunks cannot step it."""
    return cfg.normalize or is_matrix(tuple(shape), cfg)


def shape_direction(
    cfg: NetConfig,
    shapes,
    direction: Tensor | None,
    m1: Tensor,
    d: Tensor | None,
    matrices,
    q: Tensor | None = None,
    refresh: bool | Tensor = True,
    g: Tensor | None = None,
    direction_at: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """The step direction of every segment under ``cfg.output`` and ``cfg.normalize``, and
    the matrices' new Gram polynomials.

    ``shapes`` are the segments' shapes (those of a :class:`~learned_opt.segments.FlatLayout`);
    ``direction`` (``[..., P]``) is the Adam form ``clamp(adam_dir + d)`` (None when every
    segment is a matrix, which never reads it), ``m1`` the 0.9 momentum and ``d`` the MLP's
    direction output (None: zero), all ``[..., P]``; ``direction`` may cover only the
    elements from ``direction_at`` on, up to the end of the last segment that is not a
    matrix (:func:`~learned_opt.step.adam_span`).
    ``matrices`` (one bool per segment, :func:`is_matrix` of each shape or a layout's
    :meth:`~learned_opt.segments.FlatLayout.matrices`) says which segments are orthogonalised. Matrices are replaced by
    their orthogonalised direction (scaled relative to the Adam form's ``step_mult``); the
    other segments are kept, or scaled to unit RMS with ``cfg.normalize``.

    ``q`` (``[..., Q]``) holds the Gram polynomials of the matrices that keep one
    (:func:`reuses_gram`), flattened, in segment order; those matrices take
    :func:`newton_schulz_reusing` under ``refresh`` (:func:`ns_due`), and the result's
    second item holds their new polynomials in the same layout. Without ``q`` (None, and
    None is returned) every matrix runs Newton-Schulz.

    ``g`` (``[..., P]``) is this step's gradient: a matrix that takes the Nesterov input
    (:func:`takes_nesterov`) orthogonalises ``(1 - w) m1 + w g`` instead of ``m1``, ``w``
    :attr:`~learned_opt.config.NetConfig.ortho_nesterov`. At ``w = 0.1`` this is
    ``0.9 m1 + 0.1 g``, Muon's Nesterov momentum (the current gradient weighs 0.19 instead
    of 0.1), chosen on the validation family for matrices at least 64 wide
    (``validation_nesterov64.json``); on narrower ones (recurrent and attention models of
    width 32 to 48) it lost (``validation_nesterov_all.json``). None: ``m1`` for every
    matrix.

    Matrices of one shape, or of transposed shapes (a tall matrix iterates on its
    transpose anyway), take one batched Newton-Schulz iteration (:func:`ortho_directions`):
    the layers of a small deep model, packed into one flat vector, cost one iteration's
    operations instead of one per layer.
    """
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if not cfg.normalize and not any(matrices):
        return direction, q
    starts = [0, *itertools.accumulate(numels)]
    q_starts, q_at = {}, 0  # each keeping matrix's offset in q
    for k in gram_layout(cfg, shapes, matrices) if q is not None else ():
        q_starts[k], q_at = q_at, q_at + gram_numel(shapes[k])
    pieces: list[Tensor | None] = [None] * len(shapes)
    new_q: list[Tensor | None] = [None] * len(shapes)
    groups: dict[tuple[int, int], list[int]] = {}
    for k, (shape, matrix, lo, hi) in enumerate(zip(shapes, matrices, starts, starts[1:])):
        if k in q_starts:  # a kept polynomial: matrices of one shape, in their own layout
            groups.setdefault(tuple(shape), []).append(k)
        elif matrix:
            groups.setdefault((min(shape), max(shape)), []).append(k)
        elif cfg.normalize:
            pieces[k] = unit_rms(direction[..., lo - direction_at : hi - direction_at])
        else:
            pieces[k] = direction[..., lo - direction_at : hi - direction_at]
    for ks in groups.values():
        m = _stacked(m1, ks, starts, numels)  # [k, ..., n]: the group's matrices, flat
        if g is not None and takes_nesterov(shapes[ks[0]], cfg):  # alike across the group
            m = torch.lerp(m, _stacked(g, ks, starts, numels), cfg.ortho_nesterov)
        dk = None if d is None else _stacked(d, ks, starts, numels)
        z = ortho_input(m, m.square().mean(dim=-1, keepdim=True), dk)
        qs = None
        if ks[0] in q_starts:
            qs = _stacked(q, ks, q_starts, {k: gram_numel(shapes[k]) for k in ks})
        outs, kept = ortho_directions(cfg, [tuple(shapes[k]) for k in ks], z, qs, refresh)
        for i, k in enumerate(ks):
            pieces[k] = outs[i]
            if kept is not None:
                new_q[k] = kept[i]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
    kept_q = [t for t in new_q if t is not None]
    if not kept_q:  # no q, or no matrix that keeps one
        return out, q
    return out, (kept_q[0] if len(kept_q) == 1 else torch.cat(kept_q, dim=-1))


def _stacked(t: Tensor, ks, starts, sizes) -> Tensor:
    """The segments ``ks`` of ``t`` (``[..., P]``; each segment's start and size in
    ``starts`` and ``sizes``) stacked: ``[len(ks), ..., n]`` (a view for one)."""
    parts = [t[..., starts[k] : starts[k] + sizes[k]] for k in ks]
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)


def ortho_directions(
    cfg: NetConfig,
    shapes: list[tuple[int, int]],
    z: Tensor,
    q: Tensor | None = None,
    refresh: bool | Tensor = True,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """:func:`ortho_direction` of matrices whose shapes are equal or transposed, in one
    batched Newton-Schulz iteration (each tall one on its transpose, as alone): ``z``
    (``[k, ..., numel]``) holds their :func:`ortho_input` stacked, and each matrix's
    direction (``[..., numel]``) is returned. With their kept Gram polynomials ``q`` (flat,
    ``[k, ..., r * r]``; the matrices then share one shape), :func:`newton_schulz_reusing`
    under ``refresh``, and the new polynomials are returned too (else None)."""
    if q is not None:  # the matrices of one shape (see shape_direction), in their layout
        k = min(shapes[0])
        x = z.reshape(*z.shape[:-1], *shapes[0])
        o, new_q = newton_schulz_reusing(x, q.reshape(*q.shape[:-1], k, k), refresh, cfg.ns_steps)
        return list(_scaled(cfg, o, z.shape).unbind(0)), list(new_q.reshape(q.shape).unbind(0))
    if all(shape == shapes[0] for shape in shapes):
        return list(ortho_direction(cfg, shapes[0], z).unbind(0)), None
    wide = min(shapes[0]), max(shapes[0])
    mats = []
    for shape, zi in zip(shapes, z.unbind(0)):
        x = zi.reshape(*zi.shape[:-1], *shape)
        mats.append(x if shape == wide else x.transpose(-1, -2))
    o = newton_schulz(torch.stack(mats), cfg.ns_steps)
    o = _scaled(cfg, o, o.shape, dim=(-2, -1))  # a matrix's RMS is its transpose's
    out = []
    for shape, x in zip(shapes, o.unbind(0)):
        x = x if shape == wide else x.transpose(-1, -2)
        out.append(x.reshape(*x.shape[:-2], -1))
    return out, None
