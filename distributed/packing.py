"""The flat byte buffer a rank sends to its neighbours, and where each tensor lives in it.

A float64 header (the batch loss and a finite flag) is followed by one section per dtype,
each tensor at a fixed offset. The buffer goes to every neighbour whole, byte for byte, so
the neighbour's parameters arrive exactly, and :meth:`Layout.unpack` gives views of them
without copies. Optimizer state shared with the neighbours (the learned optimizer's
moments) travels in :func:`wire_dtype`: float32 state as bfloat16, half its bytes.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

_ALIGN = 16
HEADER = 2  # float64 slots: loss (NaN when absent), finite flag (1.0 / 0.0)
#: The dtype float32 optimizer state travels in. The moments a worker shares are mixed into
#: running averages that the rule normalises by, where bfloat16's rounding (at most 2^-8
#: relative) is far below their step-to-step change: on the decentralized validation
#: settings the shipped rule's median stayed (1.40x against 1.33x exact), with the same
#: settings above tuned D-Adam (``validation_state_bf16_decentralized.json``), and an
#: exchange that carries its moments sends twice the bytes of the parameters instead of
#: three times.
STATE_WIRE_DTYPE = torch.bfloat16


def wire_dtype(t: Tensor, state: bool) -> torch.dtype:
    """The dtype ``t`` is sent in: :data:`STATE_WIRE_DTYPE` for float32 optimizer state
    (``state``), else its own (parameters, and float64 state, travel exactly)."""
    return STATE_WIRE_DTYPE if state and t.dtype == torch.float32 else t.dtype


def as_received(t: Tensor) -> Tensor:
    """Shared state ``t`` as a neighbour receives it (rounded to its :func:`wire_dtype`),
    in ``t``'s dtype, so that the simulator mixes what real workers would. Its gradient is
    the identity (the rounding passes gradients straight through, unrounded)."""
    wire = wire_dtype(t, True)
    if wire == t.dtype:
        return t
    return t + (t.detach().to(wire).to(t.dtype) - t.detach())


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives inside the flat byte buffer."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]  # the dtype each tensor travels in
    sections: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, byte offset, numel)
    offsets: tuple[tuple[int, int], ...]  # per tensor: (section index, element offset)
    nbytes: int

    @classmethod
    def of(cls, ys: list[Tensor], state: int = 0) -> Layout:
        """The layout of ``ys``, whose last ``state`` tensors are shared optimizer state
        (sent in their :func:`wire_dtype`)."""
        wire = [wire_dtype(y, k >= len(ys) - state) for k, y in enumerate(ys)]
        dtypes = tuple(dict.fromkeys(wire))
        sections, offsets, pos = [], [None] * len(ys), 8 * HEADER
        for s, dt in enumerate(dtypes):
            numel = 0
            for k, y in enumerate(ys):
                if wire[k] == dt:
                    offsets[k] = (s, numel)
                    numel += y.numel()
            pos = -(-pos // _ALIGN) * _ALIGN
            sections.append((dt, pos, numel))
            pos += numel * dt.itemsize
        return cls(
            tuple(y.shape for y in ys),
            tuple(wire),
            tuple(sections),
            tuple(offsets),
            pos,
        )

    def describe(self) -> str:
        return f"{len(self.shapes)} tensors, {sum(n for _, _, n in self.sections)} elements"

    def fingerprint(self) -> int:
        text = repr([(str(d), tuple(s)) for d, s in zip(self.dtypes, self.shapes)])
        return zlib.crc32(text.encode())

    def header(self, buf: Tensor) -> Tensor:
        return buf[: 8 * HEADER].view(torch.float64)

    def section(self, buf: Tensor, s: int) -> Tensor:
        dt, off, numel = self.sections[s]
        return buf[off : off + numel * dt.itemsize].view(dt)

    def unpack(self, buf: Tensor) -> list[Tensor]:
        """Views of every tensor inside ``buf`` (no copies)."""
        secs = [self.section(buf, s) for s in range(len(self.sections))]
        return [
            secs[s][o : o + shape.numel()].view(shape)
            for (s, o), shape in zip(self.offsets, self.shapes)
        ]

    def pack(self, ys: list[Tensor], loss: float | None, buf: Tensor) -> bool:
        """Write ``ys`` (each cast to its dtype in the layout) and ``loss`` into ``buf``;
        returns whether every float tensor is finite."""
        finite = True
        for s, (dt, _, _) in enumerate(self.sections):
            sec = self.section(buf, s)
            members = [y.reshape(-1) for y, d in zip(ys, self.dtypes) if d == dt]
            if all(m.dtype == dt for m in members):
                torch.cat(members, out=sec)
            else:  # cast (shared state): a copy per tensor; cat casting into sec took 2.8x
                at = 0
                for m in members:
                    sec[at : at + m.numel()].copy_(m)
                    at += m.numel()
            if sec.is_floating_point() or sec.is_complex():
                # a float16 sum would overflow past 65504; bfloat16's range is float32's, and
                # its sum accumulates in float32 anyway (asking for a float32 result first
                # converts the whole section: 2.7x the time, 0.7 ms of a 1M-parameter
                # model's shared state)
                acc = torch.float32 if dt == torch.float16 else None
                finite = finite and bool(torch.isfinite(sec.sum(dtype=acc)))
        loss = float("nan") if loss is None else float(loss)
        head = torch.tensor([loss, 1.0 if finite else 0.0], dtype=torch.float64)
        self.header(buf).copy_(head)
        return finite
