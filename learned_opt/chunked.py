"""The no-grad fast path: many tensors stepped in place, in cache-sized chunks.

:func:`tensor_steps_` applies exactly the math of :func:`learned_opt.core.tensor_step` to
a list of tensors, in place, in four phases:

1. the mean square of each gradient, to skip tensors holding NaN or Inf;
2. per tensor, in cache-sized pieces, in the calling thread: the moment update and the
   sums of squares of the features, computed analytically while the piece is in cache
   (large elementwise ops, which intra-op threads speed up);
3. the per-tensor network, once for all tensors;
4. per chunk, as tasks on a :class:`~learned_opt.workers.ChunkRunner`: the features, the
   per-element MLP and the update, with features and activations in one scratch buffer
   per worker (small matrix products, which only worker threads speed up).

Chunks are independent and partial sums are added in order, so the result does not
depend on how the tasks were scheduled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import NUM_ELEMENT_FEATURES, NetConfig
from .core import compute_dtype, element_update, tensor_context, tensor_step
from .features import (
    element_features,
    feature_sum_squares,
    mean_square,
    safe_sqrt,
    update_moments_,
)
from .network import Theta, layers_of
from .workers import SERIAL, ChunkRunner

#: Elements per chunk on CPU: large enough that per-op overhead stays small, small enough
#: that a chunk's features and activations stay near the core; chosen by measurement
#: with ``benchmarks/step_overhead.py``.
DEFAULT_CHUNK = 1 << 16
#: Elements per chunk on accelerators, where only the scratch memory limits the size.
ACCELERATOR_CHUNK = 1 << 22
#: Phase 2 (moments and sums of squares) works on chunks this many times larger.
PASS1_CHUNKS = 4


def default_chunk(device: torch.device) -> int:
    """The chunk size used on ``device`` when none is given."""
    return DEFAULT_CHUNK if torch.device(device).type == "cpu" else ACCELERATOR_CHUNK


@dataclass
class _Tensor:
    """One tensor being stepped, as flat views in its compute dtype."""

    p: Tensor  # the parameter itself
    flat_p: Tensor
    flat_g: Tensor
    flat_m: Tensor  # (3, n)
    flat_v: Tensor
    target: Tensor  # where the new values are written: flat_p, or a private copy
    in_place: bool

    @property
    def n(self) -> int:
        return self.flat_p.numel()


def _prepare(p: Tensor, g: Tensor, state: dict[str, Tensor]) -> _Tensor:
    dtype = compute_dtype(p)
    flat_p = p.detach().to(dtype).reshape(-1)
    aliases_p = flat_p.data_ptr() == p.data_ptr()
    in_place = aliases_p and p.is_contiguous()
    # m and v are created contiguous by init_state, so these reshapes are views
    return _Tensor(
        p=p,
        flat_p=flat_p,
        flat_g=g.to(dtype).reshape(-1),
        flat_m=state["m"].reshape(3, -1),
        flat_v=state["v"].reshape(-1),
        target=flat_p.clone() if aliases_p and not in_place else flat_p,
        in_place=in_place,
    )


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _moments_and_sums(t: _Tensor, g_rms: float, size: int, cfg: NetConfig) -> Tensor:
    """Phase 2 on one tensor, ``size`` elements at a time: update the moments; return the
    feature mean squares and the mean of v, ``(12,)``. Partial sums add up in order."""
    total = 0
    for lo, hi in _spans(t.n, size):
        g, m, v = t.flat_g[lo:hi], t.flat_m[:, lo:hi], t.flat_v[lo:hi]
        update_moments_(g, m, v)
        sums = feature_sum_squares(t.flat_p[lo:hi], g, m, v, g_rms, cfg)
        total = total + torch.cat([sums, v.sum().reshape(1)])
    return total / t.n


def _buffers(workspace: dict, rows: tuple[int, int], k: int, like: Tensor) -> list[Tensor]:
    """Two ``(rows[i], k)`` scratch blocks cut from one flat buffer kept in ``workspace``
    (per dtype and device, grown when too small; the cut views are cached with it)."""
    key, need = (like.dtype, str(like.device)), sum(rows) * k
    buf, views = workspace.get(key, (None, {}))
    if buf is None or buf.numel() < need:
        buf, views = torch.empty(need, dtype=like.dtype, device=like.device), {}
        workspace[key] = (buf, views)
    if (rows, k) not in views:
        views[rows, k] = [part.view(-1, k) for part in buf[:need].split([r * k for r in rows])]
    return views[rows, k]


def _update_chunk(task, workspace: dict, cfg: NetConfig, step: int) -> None:
    """Phase 4 on one chunk: features, per-element MLP, ``target += scale * dir * mag``."""
    t, g_rms, layers, scale, lo, hi = task
    k, width = hi - lo, cfg.width
    # two blocks of rows, each reused once dead: features then second hidden layer in
    # `a`, first hidden layer then outputs in `b` (a smaller footprint stays in cache)
    a, b = _buffers(workspace, (max(NUM_ELEMENT_FEATURES, width), width), k, t.flat_p)
    m, v = t.flat_m[:, lo:hi], t.flat_v[lo:hi]
    x = element_features(
        t.flat_p[lo:hi], t.flat_g[lo:hi], m, v, g_rms, cfg, out=a[:NUM_ELEMENT_FEATURES]
    )
    direction, magnitude = element_update(cfg, layers, x, m[0], v, step, (b, a[:width], b[:2]))
    t.target[lo:hi].addcmul_(direction, magnitude, value=scale)


@torch.no_grad()
def tensor_steps_(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: int,
    lr: float = 1.0,
    chunk: int | None = None,
    runner: ChunkRunner = SERIAL,
) -> list[bool]:
    """In-place fast twin of :func:`~learned_opt.core.tensor_step` for many tensors.

    ``params`` share one device and one compute dtype (theta's); ``states`` are
    :func:`~learned_opt.core.init_state` dicts. ``chunk`` defaults to
    :func:`default_chunk` of the device. Chunk tasks run on ``runner``. Returns, per
    tensor, False where the gradient was not finite and nothing changed.
    """
    if not params:
        return []
    chunk = chunk or default_chunk(params[0].device)
    tensors = [_prepare(p, g, s) for p, g, s in zip(params, grads, states)]
    g_ms = torch.stack([mean_square(t.flat_g) for t in tensors])
    g_ms, g_rms = torch.stack([g_ms, safe_sqrt(g_ms)]).tolist()  # one sync
    finite = [math.isfinite(ms) for ms in g_ms]
    live = [i for i, ok in enumerate(finite) if ok and tensors[i].n > 0]
    if not live:
        return finite
    # phase 2 in this thread: its ops are large and elementwise, so intra-op threads
    # scale on them, and per-op costs stay low
    sums = [_moments_and_sums(tensors[i], g_rms[i], PASS1_CHUNKS * chunk, cfg) for i in live]
    means = torch.stack(sums)  # (T, 12): feature mean squares, then mean of v
    shapes = [params[i].shape for i in live]
    layers, scales = tensor_context(theta, cfg, means[:, :-1], means[:, -1], shapes, step, lr)
    scales = scales.tolist()
    tasks = [
        (tensors[i], g_rms[i], layers_of(layers, j), scales[j], *span)
        for j, i in enumerate(live)
        for span in _spans(tensors[i].n, chunk)
    ]
    runner.map(lambda task, ws: _update_chunk(task, ws, cfg, step), tasks)
    for i in live:
        if not tensors[i].in_place:
            tensors[i].p.copy_(tensors[i].target.view(params[i].shape))
    return finite


def tensor_step_(
    theta: Theta,
    cfg: NetConfig,
    p: Tensor,
    g: Tensor,
    state: dict[str, Tensor],
    step: int,
    lr: float = 1.0,
    chunk: int | None = None,
    runner: ChunkRunner = SERIAL,
) -> bool:
    """:func:`tensor_steps_` for one tensor. Returns False (and changes nothing) when the
    gradient is not finite."""
    return tensor_steps_(theta, cfg, [p], [g], [state], step, lr, chunk, runner)[0]


def learned_update(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: Tensor | int,
    lr: Tensor | float = 1.0,
    differentiable: bool = True,
) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """Apply the learned optimizer to a list of tensors.

    ``differentiable=True`` returns new tensors built by
    :func:`~learned_opt.core.tensor_step` (gradients flow to theta).
    ``differentiable=False`` updates ``params`` and ``states`` in place with the chunked
    fast path (one compute dtype and device) and returns them.
    """
    if differentiable:
        new_params, new_states = [], []
        for p, g, s in zip(params, grads, states):
            p2, m2, v2 = tensor_step(theta, cfg, p, g, s["m"], s["v"], step, lr)
            new_params.append(p2)
            new_states.append({"m": m2, "v": v2})
        return new_params, new_states
    tensor_steps_(theta, cfg, params, grads, states, int(step), float(lr))
    return params, states
