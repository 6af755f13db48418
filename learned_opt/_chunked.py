"""The chunked CPU layout of the learned step: many tensors in place, in cache-sized chunks.

:func:`chunked_step_` composes the same formulas (:mod:`learned_opt.features`), network
(:mod:`learned_opt.network`) and stages (:mod:`learned_opt.stages`) as
:func:`learned_opt.flat.flat_step`, for each tensor seen as one segment a chunk at a time,
in four phases:

1. the sums of squares of each gradient and parameter (and, when step sizes adapt,
   ``g . m1`` and ``m1^2``): the masking rule, rms(g) and the adapted step multipliers;
2. per chunk: the moment update in place, and the feature rows (the computed ones into a
   scratch buffer) with their sums of squares, which add up over the chunks of a tensor;
3. the per-tensor stage, once for all tensors;
4. per chunk: the features again, the per-element MLP (the feature normalisation folded
   into its first layer) and the output stage, in place.

Phases 2 and 4 run as tasks on a :class:`~learned_opt.workers.ChunkRunner`, each with its
features and activations in one scratch buffer per worker (small matrix products, which
only worker threads speed up). Chunks are independent and partial sums are added in
order, so the result does not depend on how the tasks were scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import NUM_ELEMENT_FEATURES, NetConfig
from .features import (
    adapt_log_lr,
    compute_dtype,
    element_features,
    feature_rows,
    safe_sqrt,
    shape_stats,
    stepped,
    sum_squares,
    update_moments,
)
from .network import Theta, element_layers, element_mlp, layers_of
from .orthogonal import needs_whole_tensor
from .stages import apply_update, tensor_context
from .workers import SERIAL, ChunkRunner, worth_threads

#: Elements per chunk on CPU: large enough that per-op overhead stays small, small enough
#: that a chunk's features and activations stay near the core; chosen by measurement
#: with ``benchmarks/step_overhead.py``.
DEFAULT_CHUNK = 1 << 16
#: Elements per chunk on accelerators, where only the scratch memory limits the size.
ACCELERATOR_CHUNK = 1 << 22


def default_chunk(device: torch.device) -> int:
    """The chunk size used on ``device`` when none is given."""
    return DEFAULT_CHUNK if torch.device(device).type == "cpu" else ACCELERATOR_CHUNK


@dataclass
class _Flat:
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


def _prepare(p: Tensor, g: Tensor, state: dict[str, Tensor]) -> _Flat:
    dtype = compute_dtype(p)
    flat_p = p.detach().to(dtype).reshape(-1)
    aliases_p = flat_p.data_ptr() == p.data_ptr()
    in_place = aliases_p and p.is_contiguous()
    # m and v are created contiguous by init_state, so these reshapes are views
    return _Flat(
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


def _phase1_sums(t: _Flat, adapt: bool) -> list[Tensor]:
    """Phase 1 on one tensor: the sums of squares of its gradient and parameter, and when
    step sizes adapt, ``g . m1`` and ``m1^2`` with the momentum before this step."""
    sums = [sum_squares(t.flat_g), sum_squares(t.flat_p)]
    if adapt:
        m1 = t.flat_m[0]
        sums += [torch.dot(t.flat_g, m1), sum_squares(m1)]
    return sums


def _moments_and_sums(task, workspace: dict, cfg: NetConfig) -> Tensor:
    """Phase 2 on one chunk: update the moments in place; return the sums of squares of the
    feature rows and the sum of v, ``(12,)``."""
    t, g_rms, lo, hi = task
    g, m, v = t.flat_g[lo:hi], t.flat_m[:, lo:hi], t.flat_v[lo:hi]
    update_moments(g, m, v, inplace=True)
    (x,) = _buffers(workspace, (NUM_ELEMENT_FEATURES,), hi - lo, t.flat_p)
    rows = feature_rows(t.flat_p[lo:hi], g, m, v, g_rms, cfg, out=x)
    return torch.stack([torch.dot(row, row) for row in rows] + [v.sum()])


def _buffers(workspace: dict, rows: tuple[int, ...], k: int, like: Tensor) -> list[Tensor]:
    """``(rows[i], k)`` scratch blocks cut from one flat buffer kept in ``workspace``
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
    """Phase 4 on one chunk: features, per-element MLP, and the output stage into ``target``."""
    t, g_rms, layers, scale, lo, hi = task
    k, width = hi - lo, cfg.width
    # two blocks of rows, each reused once dead: features then second hidden layer in
    # `a`, first hidden layer then outputs in `b` (a smaller footprint stays in cache)
    a, b = _buffers(workspace, (max(NUM_ELEMENT_FEATURES, width), width), k, t.flat_p)
    m, v = t.flat_m[:, lo:hi], t.flat_v[lo:hi]
    x = element_features(
        t.flat_p[lo:hi], t.flat_g[lo:hi], m, v, g_rms, cfg, out=a[:NUM_ELEMENT_FEATURES]
    )
    d, log_mag = element_mlp(layers, x, out=(b, a[:width], b[:2]))
    # the first feature row is scratch once the MLP has run
    apply_update(cfg, t.target[lo:hi], d, log_mag, m[0], v, step, scale, scratch=a[0])


@torch.no_grad()
def chunked_step_(
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
    """The learned step of many tensors, in place, in chunks.

    ``params`` share one device and one compute dtype (theta's); ``states`` are
    :func:`~learned_opt.features.init_state` dicts. ``chunk`` defaults to
    :func:`default_chunk` of the device. Chunk tasks run on ``runner``. Returns, per
    tensor, False where the gradient or the parameter was not finite and nothing changed.
    """
    if not params:
        return []
    whole = [tuple(p.shape) for p in params if needs_whole_tensor(cfg, p.shape)]
    if whole:
        raise ValueError(
            f"tensors of shapes {whole} need their whole tensor in the output stage "
            f"(output={cfg.output!r}, normalize={cfg.normalize}); chunks cannot step them"
        )
    chunk = chunk or default_chunk(params[0].device)
    tensors = [_prepare(p, g, s) for p, g, s in zip(params, grads, states)]
    adapt = cfg.adapts_lr
    sums = torch.stack(
        [torch.stack(_phase1_sums(t, adapt)) for t in tensors]
    )  # (T, 2): sums of g^2 and p^2; adapting: then g . m1 and m1^2 (before the update)
    sizes = torch.tensor([max(t.n, 1) for t in tensors], dtype=sums.dtype, device=sums.device)
    ok = stepped(sums[:, 0], sums[:, 1])
    g_rms = safe_sqrt(torch.where(ok, sums[:, 0], 0.0) / sizes)
    ok, g_rms = ok.tolist(), g_rms.tolist()  # one sync
    live = [i for i, good in enumerate(ok) if good and tensors[i].n > 0]
    if not live:
        return ok
    spans = {i: _spans(tensors[i].n, chunk) for i in live}
    if not worth_threads(runner, sum(len(s) for s in spans.values())):
        runner = SERIAL
    tasks = [(tensors[i], g_rms[i], *span) for i in live for span in spans[i]]
    partial = iter(runner.map(lambda task, ws: _moments_and_sums(task, ws, cfg), tasks))
    means = torch.stack(
        [sum(next(partial) for _ in spans[i]) / tensors[i].n for i in live]
    )  # (T, 12): feature mean squares, then mean of v
    stats = shape_stats([params[i].shape for i in live], cfg, means)
    log_lr = None
    if adapt:
        rows = torch.tensor(live, device=sums.device)
        live_sums = sums.index_select(0, rows)
        old = torch.stack([states[i]["log_lr"] for i in live])
        log_lr = adapt_log_lr(
            old, live_sums[:, 2], live_sums[:, 0], live_sums[:, 3], means[:, -1],
            sizes.index_select(0, rows), step, cfg, lr, stats[:, 3],
        )  # fmt: skip
        torch._foreach_copy_([states[i]["log_lr"] for i in live], list(log_lr.unbind()))
    scales, bias, step_scales = tensor_context(
        theta, cfg, means[:, :-1], means[:, -1], stats, step, lr, log_lr
    )
    layers = element_layers(theta, cfg, scales.dtype, bias.unsqueeze(-1), scales)
    step_scales = step_scales.tolist()
    tasks = [
        (tensors[i], g_rms[i], layers_of(layers, j), step_scales[j], *span)
        for j, i in enumerate(live)
        for span in spans[i]
    ]
    runner.map(lambda task, ws: _update_chunk(task, ws, cfg, step), tasks)
    for i in live:
        if not tensors[i].in_place:
            tensors[i].p.copy_(tensors[i].target.view(params[i].shape))
    return ok
