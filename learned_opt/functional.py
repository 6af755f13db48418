"""``learned_step``: the one entry point of the in-place learned step, which picks a layout.

In the style of torch's ``adam()``, which chooses among ``_single_tensor_adam``,
``_multi_tensor_adam`` and ``_fused_adam``, :func:`learned_step` groups the tensors by
device and compute dtype and hands each group to one of three private layouts of the
same math (:mod:`learned_opt.features`, :mod:`learned_opt.network`,
:mod:`learned_opt.stages`):

* small tensors (biases, norms) packed into one flat vector
  (:func:`learned_opt._stacked.packed_step_`);
* large tensors of one shape stacked as rows (:func:`learned_opt._stacked.stacked_step_`),
  the default on accelerators, where the step is bound by kernel launches;
* every other tensor in cache-sized chunks on worker threads
  (:func:`learned_opt._chunked.chunked_step_`), the default on CPU.

All three agree to 1e-5 with the differentiable :func:`learned_opt.flat.flat_step` that
meta-training unrolls (tested).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._chunked import DEFAULT_CHUNK, chunked_step_
from ._stacked import packed_step_, stacked_step_
from .config import NetConfig
from .network import Theta
from .orthogonal import needs_whole_tensor
from .workers import SERIAL, ChunkRunner

#: Default ``small_tensor_size``: up to this size, one call per tensor costs more than the
#: tensor's math, so such tensors are stepped together. Thresholds from 2K to 32K measured
#: alike on the step-overhead shapes; larger ones would give up the chunked path's caching.
SMALL_TENSOR_SIZE = 1 << 13
#: With ``stack_same_shape``, at most this many elements are stacked into one call (the
#: stacked step holds about 40 floats per element); larger tensors take the chunked path.
STACK_ELEMENTS = 1 << 24

ThetaFor = Callable[[torch.device, torch.dtype], Theta]


def stacks(items: list, cap: int) -> tuple[list[list], list]:
    """Split ``(param, grad, state)`` items into stacks of one shape with at most ``cap``
    elements each, and the items too large to stack."""
    by_shape: dict[tuple, list] = {}
    rest = []
    for item in items:
        n = item[0].numel()
        stackable = 0 < n <= cap
        (by_shape.setdefault(tuple(item[0].shape), []) if stackable else rest).append(item)
    out = []
    for group in by_shape.values():
        per = max(1, cap // max(group[0][0].numel(), 1))
        out += [group[i : i + per] for i in range(0, len(group), per)]
    return out, rest


def _cast(theta: Theta) -> ThetaFor:
    return lambda device, dtype: {k: v.detach().to(device, dtype) for k, v in theta.items()}


@torch.no_grad()
def learned_step(
    theta: Theta | ThetaFor,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: int,
    lr: float = 1.0,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    small_tensor_size: int = SMALL_TENSOR_SIZE,
    stack_same_shape: bool | None = None,
    runner: ChunkRunner = SERIAL,
) -> list[bool]:
    """Step ``params`` in place with the learned optimizer; return, per tensor, whether it
    was stepped (False where its gradient or parameter held NaN or Inf: nothing changed).

    Args:
        theta: the network's parameters, or a function ``(device, dtype) -> theta`` that
            returns them there (a cache avoids a copy per step).
        cfg: the network's config.
        params, grads: tensors of any devices and floating dtypes.
        states: :func:`~learned_opt.features.init_state` dicts, one per tensor.
        step: the 1-based step count after this update; ``lr``: the step multiplier.
        chunk_size: elements per chunk of the chunked layout on CPU.
        small_tensor_size: tensors of at most this many elements are packed together.
        stack_same_shape: stack large same-shape tensors; ``None``: on accelerators only.
        runner: worker threads for the chunked layout on CPU.
    """
    if not len(params) == len(grads) == len(states):
        raise ValueError(
            f"learned_step needs one gradient and one state per parameter, got "
            f"{len(params)} params, {len(grads)} grads and {len(states)} states"
        )
    theta_for = theta if callable(theta) else _cast(theta)
    index = {id(s): i for i, s in enumerate(states)}
    ok = [True] * len(params)
    groups: dict[tuple, list] = {}  # by (small, device, compute dtype)
    for item in zip(params, grads, states):
        small = 0 < item[0].numel() <= small_tensor_size
        groups.setdefault((small, item[0].device, item[2]["v"].dtype), []).append(item)
    for (small, device, dtype), items in groups.items():
        theta_d = theta_for(device, dtype)
        if small:
            flags = packed_step_(theta_d, cfg, *zip(*items), step, lr)
            _record(ok, index, items, flags)
            continue
        cpu = device.type == "cpu"
        stack = stack_same_shape if stack_same_shape is not None else not cpu
        # tensors whose output stage reduces over the whole tensor are always stacked
        whole, rest = [], []
        for it in items:
            (whole if needs_whole_tensor(cfg, it[0].shape) else rest).append(it)
        items = rest
        shape_stacks, items = stacks(items, STACK_ELEMENTS) if stack else ([], items)
        whole_stacks, too_large = stacks(whole, STACK_ELEMENTS)
        shape_stacks += whole_stacks + [[it] for it in too_large]
        if shape_stacks:  # one device sync for all stacks
            flags = [stacked_step_(theta_d, cfg, *zip(*s), step, lr) for s in shape_stacks]
            _record(ok, index, [it for s in shape_stacks for it in s], torch.cat(flags).tolist())
        if items:
            flags = chunked_step_(
                theta_d, cfg, *zip(*items), step, lr,
                chunk=chunk_size if cpu else None, runner=runner if cpu else SERIAL,
            )  # fmt: skip
            _record(ok, index, items, flags)
    return ok


def _record(ok: list[bool], index: dict, items, flags) -> None:
    for item, flag in zip(items, flags):
        ok[index[id(item[2])]] = bool(flag)
