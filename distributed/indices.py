"""A set of ``k`` distinct indices out of ``n`` in few bytes, losslessly (what top-k sends).

The order in which top-k finds its entries carries no information, so the indices travel
sorted (the values in the same order) in one of three codes, whichever is shortest for
``(n, k)``. Both ends know ``n`` (the tensor's size) and ``k`` (from the ratio), so neither
the choice of code nor the length is sent, and every rank's buffer has the same length:

- ``"all"`` (``k == n``): nothing, the indices are ``0 .. n - 1``;
- ``"bitmap"``: bit ``i`` set for every index ``i``, ``n`` bits (denser than about 1 in 4);
- ``"elias-fano"`` with ``l`` low bits: each index's low ``l`` bits packed (``k l`` bits),
  then its high part ``i >> l`` in unary, bit ``(i >> l) + r`` set for the ``r``-th index
  (``((n - 1) >> l) + k`` bits). ``l`` is the one of fewest bits, near ``log2(n / k)``: at
  5 % density about 6.3 bits per index, close to the ``log2 C(n, k) / k`` = 5.7 bits below
  which no code can go, where int16 indices take 16.

Bits are packed least significant first into uint8, the last byte padded with zeros.
:func:`decode` checks a buffer whole before an index leaves it (its dtype and length, the
number of set bits, zero padding, every index below ``n`` and strictly increasing), and
raises :class:`PayloadError` naming what is wrong: a corrupt or malicious buffer can never
make the receiver write outside a tensor or twice into one entry.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


class PayloadError(ValueError):
    """A received buffer that does not decode to what its sender could have sent."""


@functools.lru_cache(maxsize=4096)
def code(n: int, k: int) -> tuple[str, int, int]:
    """``(kind, l, bits)``: the code of ``k`` indices out of ``n`` (see the module doc),
    its low bits ``l`` (Elias-Fano; else 0) and its length in bits."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if k == n:
        return "all", 0, 0
    bits, low = min((k * b + ((n - 1) >> b) + k, b) for b in range((n - 1).bit_length() + 1))
    return ("bitmap", 0, n) if n <= bits else ("elias-fano", low, bits)


def nbytes(n: int, k: int) -> int:
    """The length in bytes of the buffer that holds ``k`` indices out of ``n``."""
    return -(-code(n, k)[2] // 8)


def _pack(bits: Tensor) -> Tensor:
    """Bits (0/1, any integer dtype) into uint8, least significant first, zero padded."""
    bits = bits.to(torch.uint8)
    bits = torch.cat([bits, bits.new_zeros((-bits.numel()) % 8)]).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=bits.device)).sum(
        1, dtype=torch.uint8
    )


def _unpack(buf: Tensor) -> Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=buf.device)
    return ((buf.unsqueeze(1) >> shifts) & 1).reshape(-1)


def encode(idx: Tensor, n: int) -> Tensor:
    """The uint8 buffer of ``idx``: distinct indices in ``[0, n)``, sorted increasing."""
    k = idx.numel()
    kind, low, bits = code(n, k)
    idx = idx.reshape(-1).long()
    if kind == "all":
        return idx.new_zeros(0, dtype=torch.uint8)
    if kind == "bitmap":
        mask = idx.new_zeros(n, dtype=torch.uint8)
        mask[idx] = 1
        return _pack(mask)
    shifts = torch.arange(low, device=idx.device)
    lows = (idx.unsqueeze(1) >> shifts) & 1  # [k, l]
    upper = idx.new_zeros(((n - 1) >> low) + k, dtype=torch.uint8)
    upper[(idx >> low) + torch.arange(k, device=idx.device)] = 1
    return _pack(torch.cat([lows.reshape(-1).to(torch.uint8), upper]))


def decode(buf: Tensor, n: int, k: int) -> Tensor:
    """The ``k`` sorted int64 indices out of ``n`` that :func:`encode` wrote into ``buf``;
    :class:`PayloadError` if ``buf`` is not such a buffer."""
    kind, low, nbits = code(n, k)
    want = -(-nbits // 8)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != want:
        raise PayloadError(
            f"indices of {k} out of {n} take {want} bytes (uint8, 1-D); got "
            f"{tuple(buf.shape)} of {buf.dtype}"
        )
    arange = torch.arange(k, device=buf.device)
    if kind == "all":
        return arange
    bits = _unpack(buf)
    if bool(bits[nbits:].any()):
        raise PayloadError("index buffer: padding bits are set")
    if kind == "bitmap":
        idx = bits[:n].nonzero().reshape(-1)
        if idx.numel() != k:
            raise PayloadError(f"index bitmap holds {idx.numel()} indices, expected {k}")
        return idx
    ones = bits[k * low : nbits].nonzero().reshape(-1)
    if ones.numel() != k:
        raise PayloadError(f"index buffer holds {ones.numel()} high parts, expected {k}")
    lows = bits[: k * low].view(k, low).long() << torch.arange(low, device=buf.device)
    idx = ((ones - arange) << low) | lows.sum(1)
    if k and int(idx[-1]) >= n:
        raise PayloadError(f"index {int(idx[-1])} is out of range for a tensor of {n}")
    if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise PayloadError("indices are not distinct and increasing")
    return idx
