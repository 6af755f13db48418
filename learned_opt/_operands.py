"""The operands of the fused passes (:mod:`learned_opt._passes`): each tensor's flat views
(:func:`operands`) and small tensors packed into one vector (:class:`Pack`), built once and
cached while the tensors keep their memory."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

#: ``id(state["m"]) -> (weakref to m, key, (p, m0, m1, m2, v))``: each tensor's flat
#: operands, built once (:func:`operands`); an entry goes when its ``m`` is freed.
_operand_cache: dict[int, tuple] = {}


def operands(p: Tensor, g: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """``(p, g, m0, m1, m2, v)`` of one tensor, each ``[n]`` on the tensor's memory.

    The momentum rows are tensors on storage objects of their own (through DLPack, on the
    same memory): they do not overlap, and so the compiler may write all three in the
    update pass's one loop (rows of one storage object are treated as aliases that might
    overlap, and the writes then go through copies). Built once per tensor and cached
    while the parameter, ``m`` and ``v`` keep their memory; only ``g`` is aliased anew.
    """
    m, v = state["m"], state["v"]
    key = (p.data_ptr(), m.data_ptr(), v.data_ptr(), id(p), id(v), p.dtype, p.numel())
    hit = _operand_cache.get(id(m))
    if hit is None or hit[0]() is not m or hit[1] != key:
        rows = tuple(torch.from_dlpack(row.detach().reshape(-1)) for row in m.unbind(0))
        ops = (_alias(p, -1), *rows, _alias(v, -1))
        _operand_cache[id(m)] = hit = (weakref.ref(m, _forget(id(m))), key, ops)
    p_flat, m0, m1, m2, v_flat = hit[2]
    return p_flat, _alias(g, -1), m0, m1, m2, v_flat


class Pack:
    """Small tensors packed for :func:`~learned_opt._fused.fused_step_`: each operand as one ``[n]`` vector, the
    segment index of each element (``seg``) and the tensors' sizes (``sizes``).

    Built once per set of tensors (:meth:`of`) and cached while their parameters and states
    keep their memory (the flat views that the results are copied back into hold it);
    each step then copies the tensors in (:meth:`operands`) and back (:meth:`write_back`)
    with a few calls whatever their number."""

    def __init__(self, params: list[Tensor], states: list[dict[str, Tensor]]):
        like = states[0]["v"]
        self.dtype, self.numels = like.dtype, [p.numel() for p in params]
        counts = torch.tensor(self.numels, device=like.device)
        self.seg = torch.arange(len(params), device=like.device).repeat_interleave(counts)
        self.sizes = counts.to(like.dtype)
        self.params = [p.detach().view(-1) for p in params]
        self.m = [s["m"].view(3, -1) for s in states]
        self.v = [s["v"].view(-1) for s in states]

    @classmethod
    def of(cls, params: list[Tensor], states: list[dict[str, Tensor]]) -> Pack:
        key = tuple(
            (p.data_ptr(), p.numel(), p.dtype, s["m"].data_ptr(), s["v"].data_ptr())
            for p, s in zip(params, states)
        )
        pack = _packs.get(key)
        if pack is None:
            while len(_packs) >= MAX_PACKS:
                _packs.pop(next(iter(_packs)))
            pack = _packs[key] = cls(params, states)
        return pack

    def operands(self, grads: list[Tensor]) -> tuple[Tensor, ...]:
        """``(p, g, m0, m1, m2, v, m)`` packed, in the compute dtype (copies); the momentum
        rows each on a storage of its own (as :func:`_operands`), on the memory of ``m``
        (``[3, n]``)."""
        p = torch.cat(self.params).to(self.dtype)
        g = torch.cat([g.reshape(-1) for g in grads]).to(self.dtype)
        m = torch.cat(self.m, dim=1)
        return (p, g, *(torch.from_dlpack(row) for row in m.unbind(0)), torch.cat(self.v), m)

    def write_back(self, packed, log_lr: Tensor | None, ok: Tensor, states) -> None:
        """Copy the stepped ``packed`` operands back into the tensors and states, and
        ``log_lr`` (``[T]``) into the states of the tensors stepped (``ok``)."""
        p, v, m = packed[0], packed[5], packed[6]  # m: the memory of the rows
        dst = [*self.params, *self.m, *self.v]
        src = [*p.split(self.numels), *m.split(self.numels, 1), *v.split(self.numels)]
        if log_lr is not None:
            dst += [s["log_lr"] for s in states]
            src += list(torch.where(ok, log_lr, torch.stack(dst[-len(states) :])).unbind())
        torch._foreach_copy_(dst, src)


#: At most this many sets of packed tensors are cached (:class:`Pack`).
MAX_PACKS = 4
_packs: dict[tuple, Pack] = {}


def _forget(key: int):
    """The weakref callback that drops the cache entry ``key`` (and the memory it holds)."""
    return lambda _: _operand_cache.pop(key, None)


def _alias(t: Tensor, *shape: int) -> Tensor:
    """``t`` reshaped to ``shape`` as a new tensor on the same memory, not a view: the
    compiled code would otherwise guard on the rank of the view's base and compile again
    for every rank. A non-contiguous ``t`` (a gradient) is copied."""
    t = t.detach()
    if not t.is_contiguous():
        return t.reshape(shape)
    shape = tuple(t.numel() // 3 if (d == -1 and len(shape) == 2) else d for d in shape)
    shape = (t.numel(),) if shape == (-1,) else shape
    strides = (shape[1], 1) if len(shape) == 2 else (1,)
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), shape, strides)
