"""The flat byte buffer a rank sends to its neighbours, and where each tensor lives in it.

A float64 header (the batch loss and a finite flag) is followed by one section per dtype,
each tensor at a fixed offset. The buffer goes to every neighbour whole, byte for byte, so
the neighbour's tensors arrive exactly, and :meth:`Layout.unpack` gives views of them
without copies.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

_ALIGN = 16
HEADER = 2  # float64 slots: loss (NaN when absent), finite flag (1.0 / 0.0)


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives inside the flat byte buffer."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    sections: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, byte offset, numel)
    offsets: tuple[tuple[int, int], ...]  # per tensor: (section index, element offset)
    nbytes: int

    @classmethod
    def of(cls, ys: list[Tensor]) -> Layout:
        dtypes = tuple(dict.fromkeys(y.dtype for y in ys))
        sections, offsets, pos = [], [None] * len(ys), 8 * HEADER
        for s, dt in enumerate(dtypes):
            numel = 0
            for k, y in enumerate(ys):
                if y.dtype == dt:
                    offsets[k] = (s, numel)
                    numel += y.numel()
            pos = -(-pos // _ALIGN) * _ALIGN
            sections.append((dt, pos, numel))
            pos += numel * dt.itemsize
        return cls(
            tuple(y.shape for y in ys),
            tuple(y.dtype for y in ys),
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
        """Write ``ys`` and ``loss`` into ``buf``; returns whether every float tensor is finite."""
        finite = True
        for s, (dt, _, _) in enumerate(self.sections):
            sec = self.section(buf, s)
            members = [y.reshape(-1) for y, d in zip(ys, self.dtypes) if d == dt]
            torch.cat(members, out=sec)
            if sec.is_floating_point() or sec.is_complex():
                acc = torch.float64 if dt == torch.float64 else torch.float32
                finite = finite and bool(torch.isfinite(sec.sum(dtype=acc)))
        loss = float("nan") if loss is None else float(loss)
        head = torch.tensor([loss, 1.0 if finite else 0.0], dtype=torch.float64)
        self.header(buf).copy_(head)
        return finite
