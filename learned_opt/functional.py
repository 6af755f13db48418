"""``learned_step``: the one entry point of the in-place learned step, which picks a layout.

In the style of torch's ``adam()``, which chooses among ``_single_tensor_adam``,
``_multi_tensor_adam`` and ``_fused_adam``, :func:`learned_step` groups the tensors by
device and compute dtype and hands each group to one of three private layouts of the
same math (:mod:`learned_opt.features`, :mod:`learned_opt.network`,
:mod:`learned_opt.stages`):

* small tensors (biases, norms) packed into one flat vector
  (:func:`learned_opt._stacked.packed_step_`), or, with the fused layout, into one call
  of each of its passes (those of at most :data:`~learned_opt._fused.PACK_SIZE`
  elements; the rest of the small tensors take a call each);
* large tensors of one shape stacked as rows (:func:`learned_opt._stacked.stacked_step_`),
  the default on accelerators, where the step is bound by kernel launches;
* every other tensor in one fused pass each, compiled with inductor
  (:func:`learned_opt._fused.fused_step_`), the default on CPU ("ortho" matrices, whose
  step needs the whole matrix, included: their pass writes what Newton-Schulz takes);
  tensors whose output stage needs the whole tensor and that it cannot take are stacked;
* or, where that is turned off or cannot compile, in cache-sized chunks on worker threads
  (:func:`learned_opt._chunked.chunked_step_`).

All of them agree to 1e-5 with the differentiable :func:`learned_opt.flat.flat_step` that
meta-training unrolls (tested).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from torch import Tensor

from ._chunked import DEFAULT_CHUNK, chunked_step_
from ._fused import (
    PACK_SIZE,
    CompileFailed,
    announce,
    compile_failure,
    fusable,
    fused_step_,
    fuses_whole,
    packable,
)
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


#: Environment variable that sets what ``fused=None`` means: ``0`` (never), ``1`` (on every
#: device), ``eager`` (the fused math without compiling); unset: on CPU.
FUSED_ENV = "LEARNED_OPT_FUSED"
_ENV_VALUES = {"0": False, "false": False, "1": True, "true": True, "eager": "eager", "": None}


def check_fused(fused) -> None:
    """A ``ValueError`` unless ``fused`` is None, True, False or ``"eager"``."""
    if not (
        fused is None or isinstance(fused, bool) or (isinstance(fused, str) and fused == "eager")
    ):
        raise ValueError(
            f"Invalid fused: {fused!r} (must be None for the default, True, False or 'eager')"
        )


def _fused_mode(fused, device: torch.device) -> str | None:
    """``"compiled"``, ``"eager"`` or None (the fused layout is not used) on ``device``."""
    if fused is None:
        env = os.environ.get(FUSED_ENV, "").strip().lower()
        if env not in _ENV_VALUES:
            raise ValueError(f"Invalid {FUSED_ENV}={env!r} (must be 0, 1 or eager, or unset)")
        fused = _ENV_VALUES[env]
    if fused is False or torch.compiler.is_compiling():  # a compiled caller fuses it all
        return None
    if fused == "eager":
        return "eager"
    if fused is None and (device.type != "cpu" or compile_failure() is not None):
        return None  # by default only where measured (CPU), and not once compiling failed
    return "compiled"


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
    fused: bool | str | None = None,
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
        small_tensor_size: tensors of at most this many elements are packed together (by
            the fused layout, those of at most :data:`~learned_opt._fused.PACK_SIZE`).
        stack_same_shape: stack large same-shape tensors; ``None``: on accelerators only.
        runner: worker threads for the chunked layout on CPU.
        fused: step each large tensor in one fused pass compiled by ``torch.compile``
            (:mod:`learned_opt._fused`). ``None``: on CPU; ``True``: on every device;
            ``False``: never (the chunked or stacked layouts); ``"eager"``: the fused
            math without compiling (slow; for tests). If compiling fails, a warning says
            why and the eager layouts step instead, from then on. The environment
            variable :data:`FUSED_ENV` changes what ``None`` means.
    """
    check_fused(fused)
    if not len(params) == len(grads) == len(states):
        raise ValueError(
            f"learned_step needs one gradient and one state per parameter, got "
            f"{len(params)} params, {len(grads)} grads and {len(states)} states"
        )
    theta_for = theta if callable(theta) else _cast(theta)
    index = {id(s): i for i, s in enumerate(states)}
    ok = [True] * len(params)
    groups: dict[tuple, list] = {}  # by (device, compute dtype)
    for item in zip(params, grads, states):
        groups.setdefault((item[0].device, item[2]["v"].dtype), []).append(item)
    for (device, dtype), items in groups.items():
        theta_d = theta_for(device, dtype)
        small = [it for it in items if 0 < it[0].numel() <= small_tensor_size]
        items = [it for it in items if not 0 < it[0].numel() <= small_tensor_size]
        cpu = device.type == "cpu"
        stack = stack_same_shape if stack_same_shape is not None else not cpu
        mode = _fused_mode(fused, device)
        # tensors whose output stage reduces over the whole tensor are stacked, but for
        # the "ortho" matrices that the fused step takes
        whole, rest = [], []
        for it in items:
            stacked = needs_whole_tensor(cfg, it[0].shape)
            stacked = stacked and (mode is None or not fuses_whole(cfg, it[0].shape))
            (whole if stacked else rest).append(it)
        items = rest
        if mode is not None:
            threads = torch.get_num_threads()
            with _one_thread(device):
                items, small = _fused_part(
                    theta_d, cfg, items, small, step, lr, mode, device, ok, index, threads,
                    small_tensor_size,
                )  # fmt: skip
            # those it left (not contiguous, or compiling failed): stacked too
            whole += [it for it in items if needs_whole_tensor(cfg, it[0].shape)]
            items = [it for it in items if not needs_whole_tensor(cfg, it[0].shape)]
        if small:
            with _one_thread(device):
                flags = packed_step_(theta_d, cfg, *zip(*small), step, lr)
            _record(ok, index, small, flags)
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


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """Run the enclosed small CPU ops on the calling thread: their work is too small to
    pay for an OpenMP team, whose barriers stall the step when another process holds a
    core (measured: 2-3 ms per small op on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fused_part(theta, cfg, items, small, step, lr, mode, device, ok, index, threads, size):
    """Step the fusable ``items`` and the packable ``small`` ones (of at most ``size``
    elements, packed together) with the fused layout; return the others of each (and, if
    compiling failed, the ones not stepped yet)."""
    cap = min(size, PACK_SIZE)
    whole = [needs_whole_tensor(cfg, it[0].shape) for it in small]
    pack = [it for it, w in zip(small, whole) if it[0].numel() <= cap and packable(it[0]) and not w]
    pack = pack if len(pack) > 1 else []
    packed = {id(it[2]) for it in pack}
    alone = [
        it for it in small
        if id(it[2]) not in packed and fusable(it[0]) and fuses_whole(cfg, it[0].shape)
    ]  # fmt: skip
    taken = packed | {id(it[2]) for it in alone}
    fuse = [it for it in items if fusable(it[0])] + alone + pack
    if not fuse:
        return items, small
    rest = [it for it in items if not fusable(it[0])]
    small = [it for it in small if id(it[2]) not in taken]
    try:
        flags = fused_step_(
            theta, cfg, *zip(*fuse), step, lr, compiled=mode == "compiled", threads=threads,
            small_tensor_size=cap if pack else 0,
        )  # fmt: skip
    except CompileFailed as e:
        announce("eager", device, why=f"torch.compile failed: {e}")
        _record(ok, index, [fuse[i] for i in e.done], list(e.done.values()))
        left = [it for i, it in enumerate(fuse) if i not in e.done]
        small += [it for it in left if id(it[2]) in packed]
        return rest + [it for it in left if id(it[2]) not in packed], small
    if mode == "compiled":
        announce("fused", device)
    _record(ok, index, fuse, flags)
    return rest, small


def _record(ok: list[bool], index: dict, items, flags) -> None:
    for item, flag in zip(items, flags):
        ok[index[id(item[2])]] = bool(flag)
