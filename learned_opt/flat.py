"""The learned step on flat, segmented, stacked parameters: the meta-training path.

All parameter tensors of a model are concatenated into one flat vector of length ``P``,
and workers are stacked in front: ``p`` is ``[B, P]``. ``FlatLayout`` records which
segment (tensor) each element belongs to. :func:`flat_step` applies exactly the math of
:func:`learned_opt.core.tensor_step` to every segment and every worker at once, with
segment reductions instead of one call per tensor and no ``vmap``: a few dozen large ops
per inner step instead of a few dozen small ops per tensor and worker. It is pure and
differentiable, and agrees with ``tensor_step`` to 1e-5 (tested).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import MOMENTUM_DECAYS, NUM_ELEMENT_FEATURES, SECOND_MOMENT_DECAY, NetConfig
from .features import (
    _TINY,
    NORM_EPS,
    adam_direction,
    constant,
    safe_sqrt,
    shape_stats,
    time_features,
)
from .network import Theta, tensor_head


@dataclass(frozen=True)
class FlatLayout:
    """Names, shapes and offsets of the tensors packed into a flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def size(self) -> int:
        return sum(self.numels)

    @classmethod
    def of(cls, params: dict[str, Tensor], batch_dims: int = 0) -> FlatLayout:
        """Layout of a params dict (shapes after ``batch_dims`` leading dims)."""
        return cls(tuple(params), tuple(tuple(t.shape[batch_dims:]) for t in params.values()))

    @functools.lru_cache(maxsize=8)  # noqa: B019 - layouts are few, frozen and long-lived
    def segments(self, device=None) -> Tensor:
        """Segment id of every element, ``[P]``."""
        ids = torch.arange(len(self.shapes), device=device)
        return ids.repeat_interleave(torch.tensor(self.numels, device=device))

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def padded_index(self, device=None) -> Tensor:
        """Where each element goes when every segment is padded to the longest: ``[P]``
        indices into ``T * max(numels)``."""
        longest = max(self.numels, default=0)
        seg = self.segments(device)
        return seg * longest + torch.arange(self.size, device=device) - self._starts(device)[seg]

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def blocked_index(self, block: int, device=None) -> tuple[Tensor, Tensor, int, int]:
        """Indices for summing segments in blocks of ``block`` elements, each segment
        padded to whole blocks: ``(element -> slot in nb * block, block -> slot in
        T * most_blocks, nb, most_blocks)``."""
        blocks = [-(-n // block) for n in self.numels]
        most = max(blocks, default=0)
        first = torch.tensor([0, *itertools.accumulate(blocks)][:-1], device=device)
        seg = self.segments(device)
        element = (first[seg] * block) + torch.arange(self.size, device=device)
        element -= self._starts(device)[seg]
        block_seg = torch.arange(len(blocks), device=device).repeat_interleave(
            torch.tensor(blocks, device=device)
        )
        block_slot = block_seg * most + torch.arange(sum(blocks), device=device) - first[block_seg]
        return element, block_slot, sum(blocks), most

    def _starts(self, device=None) -> Tensor:
        return torch.tensor([0, *itertools.accumulate(self.numels)][:-1], device=device)

    def flatten(self, params: dict[str, Tensor], batch_dims: int = 1) -> Tensor:
        """Concatenate ``params`` (with ``batch_dims`` leading dims) into ``[..., P]``."""
        lead = next(iter(params.values())).shape[:batch_dims]
        return torch.cat([params[k].reshape(*lead, -1) for k in self.names], dim=-1)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of ``flat`` (``[..., P]``) as the original tensors."""
        lead = flat.shape[:-1]
        parts = flat.split(self.numels, dim=-1)
        return {k: t.reshape(*lead, *s) for k, t, s in zip(self.names, parts, self.shapes)}


def init_flat_state(p: Tensor) -> dict[str, Tensor]:
    """Zero state for flat parameters ``[B, P]``: ``m`` ``[B, 3, P]`` and ``v`` ``[B, P]``."""
    b, n = p.shape
    return {"m": p.new_zeros(b, 3, n), "v": p.new_zeros(b, n)}


#: Segment sums on accelerators pad every segment to the longest while the padded size is
#: at most this many times ``P``; beyond that they sum blocks of :data:`SUM_BLOCK` first.
MAX_PADDING = 4
SUM_BLOCK = 1024


def segment_sum(x: Tensor, layout: FlatLayout, method: str | None = None) -> Tensor:
    """Sum of ``x`` (``[..., P]``) over each segment (tensor): ``[..., T]``; differentiable.

    Every method is deterministic (bitwise repeatable) and takes a few kernels whatever
    the number of segments. ``method``: ``"index_add"`` (the default on CPU, where it adds
    in order; on CUDA it adds with atomics, in a varying order), ``"padded"`` (scatter into
    ``[..., T, longest]`` and sum; the default on accelerators while the padding stays
    below :data:`MAX_PADDING` times ``P``) or ``"blocked"`` (segments padded to whole
    blocks, block sums, then the padded method on the block sums; the default beyond).
    """
    num, lead = len(layout.shapes), x.shape[:-1]
    if method is None:
        padded_size = num * max(layout.numels, default=0)
        method = (
            "index_add"
            if x.device.type == "cpu"
            else "padded"
            if padded_size <= MAX_PADDING * max(layout.size, 1)
            else "blocked"
        )
    if method == "index_add":
        return x.new_zeros(*lead, num).index_add(-1, layout.segments(x.device), x)
    if method == "padded":
        longest = max(layout.numels, default=0)
        if len(set(layout.numels)) <= 1:  # segments of one size: already laid out so
            return x.reshape(*lead, num, longest).sum(-1)
        out = x.new_zeros(*lead, num * longest).index_copy(-1, layout.padded_index(x.device), x)
        return out.view(*lead, num, longest).sum(-1)
    if method == "blocked":
        element, block_slot, blocks, most = layout.blocked_index(SUM_BLOCK, x.device)
        padded = x.new_zeros(*lead, blocks * SUM_BLOCK).index_copy(-1, element, x)
        sums = padded.view(*lead, blocks, SUM_BLOCK).sum(-1)
        out = sums.new_zeros(*lead, num * most).index_copy(-1, block_slot, sums)
        return out.view(*lead, num, most).sum(-1)
    raise ValueError(f"unknown segment_sum method {method!r}")


def segment_expand(t: Tensor, layout: FlatLayout) -> Tensor:
    """Per-segment values ``t`` (``[..., T]``) repeated over each segment's elements:
    ``[..., P]`` (a view without copying when there is one segment)."""
    if len(layout.shapes) == 1:
        return t.expand(*t.shape[:-1], layout.size)
    return t[..., layout.segments(t.device)]


def segment_mean(x: Tensor, layout: FlatLayout) -> Tensor:
    """Mean of ``x`` (``[..., P]``) over each segment (tensor): ``[..., T]``; see
    :func:`segment_sum`."""
    return segment_sum(x, layout) / constant(tuple(layout.numels), x.dtype, x.device)


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
    return_finite: bool = False,
) -> tuple[Tensor, ...]:
    """Learned step of every segment of ``p`` (``[B, P]``); returns ``(new_p, new_m, new_v)``,
    plus the ``[B, T]`` mask of segments that were updated if ``return_finite``.

    A segment whose gradient holds NaN or Inf is left unchanged (parameters and state).
    """
    num = len(layout.shapes)

    def mean(x: Tensor) -> Tensor:
        return segment_mean(x, layout)

    finite = torch.isfinite(mean(g * g))  # [B, T]
    g = torch.where(segment_expand(finite, layout), g, torch.zeros_like(g))
    decays = constant(MOMENTUM_DECAYS, p.dtype, p.device).view(1, 3, 1)
    m_new = m * decays + (1.0 - decays) * g.unsqueeze(1)
    v_new = v * SECOND_MOMENT_DECAY + (1.0 - SECOND_MOMENT_DECAY) * g * g

    # per-tensor statistics (design: log rms of g, p, m_k and v; log size; rank)
    ms = torch.stack(
        [mean(g * g), mean(p * p)] + [mean(m_new[:, k] ** 2) for k in range(3)] + [mean(v_new)],
        dim=-1,
    )  # [B, T, 6]
    shapes = shape_stats(layout.shapes, p).expand(p.shape[0], num, 2)
    stats = torch.cat([0.1 * torch.log(safe_sqrt(ms) + _TINY), shapes], dim=-1)
    time = time_features(step, cfg, p)
    log_scale, bias = tensor_head(theta, cfg, stats, time)  # [B, T], [B, T, H]

    # per-element features, normalised per tensor
    g_rms = segment_expand(safe_sqrt(ms[..., 0]), layout)
    r = torch.rsqrt(v_new + cfg.eps)
    clip_g = (g / (g_rms + _TINY)).clamp(-cfg.clip_value, cfg.clip_value)
    x = torch.cat(
        [g.unsqueeze(1), clip_g.unsqueeze(1), p.unsqueeze(1), m_new, m_new * r.unsqueeze(1),
         (g * r).unsqueeze(1), r.unsqueeze(1)],
        dim=1,
    )  # fmt: skip  # [B, 11, P]
    assert x.shape[1] == NUM_ELEMENT_FEATURES
    scales = torch.rsqrt(NORM_EPS + mean(x * x))  # [B, 11, T]
    xn = x * segment_expand(scales, layout)
    w1 = theta["elem_in.weight"].to(p.dtype)
    h = torch.relu(torch.matmul(w1, xn) + segment_expand(bias.transpose(1, 2), layout))
    w2, b2 = theta["elem_hidden.weight"].to(p.dtype), theta["elem_hidden.bias"].to(p.dtype)
    h = torch.relu(torch.matmul(w2, h) + b2.unsqueeze(-1))
    w3, b3 = theta["elem_out.weight"].to(p.dtype), theta["elem_out.bias"].to(p.dtype)
    out = torch.matmul(w3, h) + b3.unsqueeze(-1)  # [B, 2, P]
    d, a = out[:, 0], out[:, 1]

    adam_dir = adam_direction(m_new[:, 0], v_new, step, cfg.eps)
    direction = (adam_dir + d).clamp(-cfg.max_direction, cfg.max_direction)
    scale = segment_expand((-lr * cfg.step_mult) * torch.exp(log_scale), layout)
    new_p = p + scale * direction * torch.exp(cfg.exp_mult * a)
    keep = segment_expand(finite, layout)
    out = (
        torch.where(keep, new_p, p),
        torch.where(keep.unsqueeze(1), m_new, m),
        torch.where(keep, v_new, v),
    )
    return (*out, finite) if return_finite else out


@torch.no_grad()
def flat_step_(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: int,
    lr: float = 1.0,
) -> list[bool]:
    """In-place learned step of many tensors at once, through :func:`flat_step`.

    For small tensors (biases, norms), where one call per tensor costs far more than the
    math: the tensors are packed into one flat vector, stepped with a few dozen large ops
    and copied back. ``states`` are :func:`learned_opt.core.init_state` dicts, all of one
    compute dtype (float32 for bf16 parameters), which ``theta`` must share. Returns, per
    tensor, False where the gradient was not finite and nothing changed.
    """
    layout = FlatLayout(tuple(map(str, range(len(params)))), tuple(p.shape for p in params))
    p, g, m, v = (
        torch.cat(ts, dim=-1).unsqueeze(0) for ts in _flat_operands(params, grads, states)
    )
    new_p, new_m, new_v, finite = flat_step(
        theta, cfg, layout, p, g, m, v, step, lr, return_finite=True
    )
    numels = layout.numels
    new_p = [t.view(s) for t, s in zip(new_p[0].split(numels), layout.shapes)]
    new_m = [t.reshape(3, *s) for t, s in zip(new_m[0].split(numels, dim=-1), layout.shapes)]
    new_v = [t.view(s) for t, s in zip(new_v[0].split(numels), layout.shapes)]
    _copy_back(params, states, new_p, new_m, new_v)
    return finite[0].tolist()


@torch.no_grad()
def stacked_step_(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: int,
    lr: float = 1.0,
) -> Tensor:
    """In-place learned step of tensors that share one shape, through :func:`flat_step`.

    The tensors are stacked as the rows ("workers") of a one-segment layout, so each keeps
    its own per-tensor statistics, and all are stepped with a few dozen large ops: on an
    accelerator this replaces a few dozen kernel launches per tensor. Same contract as
    :func:`flat_step_`, except that the per-tensor flags come back as a bool tensor (no
    device sync); the stacked copies cost memory of about 40 floats per element.
    """
    shape = tuple(params[0].shape)
    if any(tuple(t.shape) != shape for t in params):
        raise ValueError(
            f"stacked_step_ needs tensors of one shape, got {[t.shape for t in params]}"
        )
    layout = FlatLayout(("tensor",), (shape,))
    p, g, m, v = (torch.stack(ts) for ts in _flat_operands(params, grads, states))
    new_p, new_m, new_v, finite = flat_step(
        theta, cfg, layout, p, g, m, v, step, lr, return_finite=True
    )
    _copy_back(
        params,
        states,
        [t.view(shape) for t in new_p],
        [t.view(3, *shape) for t in new_m],
        [t.view(shape) for t in new_v],
    )
    return finite[:, 0]


def _flat_operands(params, grads, states) -> tuple[list[Tensor], ...]:
    """Per tensor, flat views (or compute-dtype copies) of ``(p, g, m, v)``; ``m`` is
    ``(3, n)``. The compute dtype is the states' (float32 for bf16 parameters)."""
    dtype = states[0]["v"].dtype
    return (
        [t.detach().reshape(-1).to(dtype) for t in params],
        [t.reshape(-1).to(dtype) for t in grads],
        [s["m"].reshape(3, -1) for s in states],
        [s["v"].reshape(-1) for s in states],
    )


def _copy_back(params, states, new_p, new_m, new_v) -> None:
    """Write new values into the parameters and their states (one fused copy)."""
    dst = list(params) + [s["m"] for s in states] + [s["v"] for s in states]
    torch._foreach_copy_(dst, list(new_p) + list(new_m) + list(new_v))
