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


def gram_polynomial(y: Tensor, steps: int) -> Tensor:
    """``Q`` (``[B, r, r]``) such that ``Q y`` is :func:`newton_schulz`'s result for the
    wide matrices ``y`` (``[B, r, c]``, ``r <= c``, already scaled to Frobenius norm at most
    1): the quintic iteration run on the Gram matrix ``S = y y^T``. Every iterate is ``Q y``
    with ``Q`` a polynomial in ``S`` (so ``Q`` and ``S`` commute and ``A = Q^2 S``), and
    ``Q <- a Q + (b A + c A^2) Q``; the first iteration, from ``Q = I``, is
    ``a I + b S + c S^2`` (one product)."""
    a, b, c = NS_COEFFICIENTS
    s = torch.bmm(y, y.transpose(-1, -2))
    eye = torch.eye(y.shape[-2], dtype=y.dtype, device=y.device)
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
    return _scaled(cfg, newton_schulz(z.reshape(*z.shape[:-1], *shape), cfg.ns_steps), z)


def _scaled(cfg: NetConfig, o: Tensor, z: Tensor) -> Tensor:
    """An orthogonalised matrix ``o`` as a step direction in ``z``'s flat layout: unit RMS
    per matrix, relative to the Adam form's ``step_mult``."""
    return (cfg.ortho_step_mult / cfg.step_mult) * unit_rms(o.reshape(z.shape))


def is_matrix(shape: tuple[int, ...], cfg: NetConfig) -> bool:
    """Whether a tensor of ``shape`` takes the orthogonalised step under ``cfg``."""
    if cfg.output != "ortho" or len(shape) != 2:
        return False
    return cfg.ortho_min_dim <= min(shape) <= cfg.ortho_max_dim


def needs_whole_tensor(cfg: NetConfig, shape) -> bool:
    """Whether the output stage of a tensor of ``shape`` reduces over the whole tensor, so
    that a layout which sees it in chunks cannot step it."""
    return cfg.normalize or is_matrix(tuple(shape), cfg)


def shape_direction(
    cfg: NetConfig, shapes, direction: Tensor | None, m1: Tensor, d: Tensor | None, matrices
) -> Tensor:
    """The step direction of every segment under ``cfg.output`` and ``cfg.normalize``.

    ``shapes`` are the segments' shapes (those of a :class:`~learned_opt.segments.FlatLayout`);
    ``direction`` (``[..., P]``) is the Adam form ``clamp(adam_dir + d)`` (None when every
    segment is a matrix, which never reads it), ``m1`` the 0.9 momentum and ``d`` the MLP's
    direction output (None: zero), all ``[..., P]``.
    ``matrices`` (one bool per segment, :func:`is_matrix` of each shape or a layout's
    :meth:`~learned_opt.segments.FlatLayout.matrices`) says which segments are orthogonalised. Matrices are replaced by
    their orthogonalised direction (scaled relative to the Adam form's ``step_mult``); the
    other segments are kept, or scaled to unit RMS with ``cfg.normalize``.

    Matrices of one shape, or of transposed shapes (a tall matrix iterates on its
    transpose anyway), take one batched Newton-Schulz iteration (:func:`ortho_directions`):
    the layers of a small deep model, packed into one flat vector, cost one iteration's
    operations instead of one per layer.
    """
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if not cfg.normalize and not any(matrices):
        return direction
    starts = [0, *itertools.accumulate(numels)]
    pieces: list[Tensor | None] = [None] * len(shapes)
    groups: dict[tuple[int, int], list[int]] = {}
    for k, (shape, matrix, lo, hi) in enumerate(zip(shapes, matrices, starts, starts[1:])):
        if matrix:
            groups.setdefault((min(shape), max(shape)), []).append(k)
        elif cfg.normalize:
            pieces[k] = unit_rms(direction[..., lo:hi])
        else:
            pieces[k] = direction[..., lo:hi]
    for ks in groups.values():
        zs = []
        for k in ks:
            m = m1[..., starts[k] : starts[k + 1]]
            dk = None if d is None else d[..., starts[k] : starts[k + 1]]
            zs.append(ortho_input(m, m.square().mean(dim=-1, keepdim=True), dk))
        for k, piece in zip(ks, ortho_directions(cfg, [tuple(shapes[k]) for k in ks], zs)):
            pieces[k] = piece
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def ortho_directions(
    cfg: NetConfig, shapes: list[tuple[int, int]], zs: list[Tensor]
) -> list[Tensor]:
    """:func:`ortho_direction` of matrices whose shapes are equal or transposed, in one
    batched Newton-Schulz iteration (each tall one on its transpose, as alone)."""
    if len(zs) == 1:
        return [ortho_direction(cfg, shapes[0], zs[0])]
    wide = min(shapes[0]), max(shapes[0])
    mats = []
    for shape, z in zip(shapes, zs):
        x = z.reshape(*z.shape[:-1], *shape)
        mats.append(x if shape == wide else x.transpose(-1, -2))
    o = newton_schulz(torch.stack(mats), cfg.ns_steps)
    out = []
    for shape, z, x in zip(shapes, zs, o.unbind(0)):
        out.append(_scaled(cfg, x if shape == wide else x.transpose(-1, -2), z))
    return out
