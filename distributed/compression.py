"""Compressed exchange with error feedback, keeping the network average exactly.

Each rank keeps a public copy ``h_i`` of its parameters that its neighbours hold too, bit
for bit, and a copy ``h_j`` of each neighbour's. Per step and tensor (CHOCO-gossip)::

    q_i  = C(x_i - h_i)                       sent to every neighbour (compressed)
    h_i += q_i;   h_j += q_j                  on both ends, identically
    x_i += gamma * sum_j w_ij (h_j - h_i)     with w_ij = w_ji

What ``C`` leaves out stays in ``x_i - h_i`` and is sent later (error feedback). Because the
weights are symmetric and every ``h_j`` is the same on both ends of an edge, the correction
terms cancel in pairs: the network average of ``x`` is preserved exactly, whatever ``C``
drops. Learned weights are computed from ``h_i`` and ``h_j`` for the same reason.

The copies start from one uncompressed exchange per step of the topology's period, and
start over the same way after the group re-forms (every survivor then does the same).

Drift correction (``beta > 0``, the default for top-k) adds an integral term to that
proportional pull. Each rank accumulates its consensus corrections and adds the sum every
step::

    d_i  = sum_j w_ij (h_j - h_i)
    z_i += beta * d_i
    x_i += gamma * d_i + z_i

Under label skew a rank's local steps drift away from the others' in a persistent
direction. The proportional pull alone counters that only with a persistent disagreement,
which is large when ``gamma`` must be small (top-k). ``z_i`` learns the drift instead
(as a dual variable or a gradient-tracking correction does), and costs one more tensor
per parameter and no bytes. Every ``z`` increment has an opposite twin on the other end of
its edge, so ``sum_i z_i = 0`` and the average stays exact; ``z`` starts at zero with the
copies (again after a re-form). Measured on 8 ranks of ``digits_mlp`` with Adam
(``benchmarks/gossip_compression.py``, in git at ``c2adf13``): top-k 1% ends at 1.76x the exact run's loss
without it, below the exact run's loss with it. The ranks' models stay further apart (the
consensus distance grows); their average improves, and each rank's own model improves on
the uncorrected run's but stays worse than the exact run's.
:func:`default_drift_correction` is ``R / 20`` for top-k and 0 for ``sign`` and ``int8``,
which send every coordinate every step and gained nothing from it. ``beta`` must stay
small against how often top-k refreshes a coordinate: ``z`` reacts to stale copies, and
on a ring of quadratics with a decaying step ``R / 10`` already oscillated while ``R / 20``
did not (``tests/distributed/test_compression.py``).

The consensus step ``gamma`` must shrink with the compressor's density. A copy ``h_j`` is
stale in every coordinate that ``C`` has not sent lately: top-k at ratio ``R`` refreshes a
coordinate about every ``1/R`` steps, while the mix keeps pulling ``x_i`` towards the same
stale difference each step. With ``gamma`` large against ``R`` the pull overshoots before
the copies catch up, and the error grows step after step: that is how top-k 1% at
``gamma = 0.5`` diverged (8 workers, ``digits_mlp``, Adam, ring). Single-process replays of
the algorithm found the largest stable ``gamma`` near 0.05-0.1 at 1% and 0.2 at 5%
(``digits_mlp`` with Adam, and a ring of quadratics; see ``tests/distributed/
test_compression.py``); ``sign`` and ``int8`` stay stable at 0.5. The default,
:func:`default_consensus_step`, is ``min(0.5, 4 R)`` for top-k and 0.5 for ``sign`` and
``int8`` (which send every coordinate every step).

Compressors (``compression=``):

- ``"topk:R"``: the largest ``ceil(R * n)`` entries of each tensor by magnitude: the
  indices sorted, in the shortest of three lossless fixed-length codes (:mod:`.indices`:
  Elias-Fano, about 6.3 bits per index at 5 %, a bitmap when denser, nothing when all are
  kept), values rounded to bfloat16 in the same order (what the rounding loses stays in
  ``x_i - h_i`` and is sent later). Until the index code, indices went as int16 or int32
  (2 or 4 bytes each);
- ``"sign"``: one bit per entry and one float32 scale (the mean magnitude) per tensor;
- ``"int8"``: one int8 per entry and one float32 scale (max magnitude / 127) per tensor.
- ``"topk:R:B"``: top-k with its values in ``B`` bits (2, 4 or 8; 16 is bfloat16, the
  plain ``"topk:R"``): the indices as above, then ``ceil(k B / 8)`` bytes of packed codes
  and one float32 scale per tensor (:func:`quantize`);
- ``"randk:R:B"``: ``ceil(R * n)`` entries drawn at random, the same draw on every rank in
  the same call; no indices are sent, only the int64 seed of the draw (8 bytes), the packed
  ``B``-bit values (16: bfloat16) and, below 16 bits, one float32 scale per tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import indices
from .indices import PayloadError
from .mixing import mix

BITS = (2, 4, 8, 16)


def quantize(values: Tensor, bits: int, order: Tensor | None = None) -> list[Tensor]:
    """``values`` in ``bits`` bits: ``[packed uint8 codes, float32 scale]``. The ``2^B``
    levels sit at odd multiples of ``scale`` (``+-scale, +-3 scale, ...``, no zero), the
    outermost at ``R = min(max |v|, 3 rms(v))``; values beyond are clipped (what is lost
    stays in the sender's error feedback). ``bits`` 16 is bfloat16, without a scale.
    ``order``: a permutation the codes are sent in (the scale is computed on ``values``
    as given, so the order sent changes no bit of what is received)."""
    if bits == 16:
        values = values if order is None else values[order]
        return [values.to(torch.bfloat16)]
    v = values.float()
    levels = 2**bits
    rms = v.square().mean().sqrt()
    scale = (torch.minimum(v.abs().max(), 3 * rms) / (levels - 1)).clamp_min(1e-30)
    codes = ((v / scale + (levels - 1)) / 2).round_().clamp_(0, levels - 1).to(torch.uint8)
    if order is not None:
        codes = codes[order]
    per = 8 // bits
    codes = torch.cat([codes, codes.new_zeros((-codes.numel()) % per)]).view(-1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return [(codes << shifts).sum(1, dtype=torch.uint8), scale.reshape(1)]


def dequantize(payload: list[Tensor], bits: int, n: int) -> Tensor:
    """The ``n`` values :func:`quantize` sent (float32; bfloat16 at 16 bits);
    :class:`~.indices.PayloadError` if ``payload`` does not hold them."""
    if bits == 16:
        if len(payload) != 1 or payload[0].dim() != 1 or payload[0].numel() != n:
            raise PayloadError(f"expected {n} values, got {[tuple(t.shape) for t in payload]}")
        return payload[0]
    want = -(-n * bits // 8)
    shapes = [(t.dtype, tuple(t.shape)) for t in payload]
    if shapes != [(torch.uint8, (want,)), (torch.float32, (1,))]:
        raise PayloadError(
            f"{n} values in {bits} bits take {want} uint8 bytes and a float32 scale, got {shapes}"
        )
    packed, scale = payload
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    codes = ((packed.unsqueeze(1) >> shifts) & (2**bits - 1)).reshape(-1)[:n]
    return (2 * codes.float() - (2**bits - 1)) * scale


class TopK:
    """Largest entries by magnitude: payload ``[indices, values]`` per tensor, the indices
    sorted in :mod:`.indices`' code, the values in their order, in bfloat16 (``bits`` 16;
    other float dtypes than float32 and bfloat16 are sent as they are) or in ``bits`` bits
    (:func:`quantize`)."""

    def __init__(self, ratio: float, bits: int = 16):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        if bits not in BITS:
            raise ValueError(f"value bits must be one of {BITS}, got {bits}")
        self.ratio, self.bits = ratio, bits

    def k(self, n: int) -> int:
        """The entries kept of a tensor of ``n``."""
        return max(1, math.ceil(self.ratio * n))

    def compress(self, d: Tensor) -> list[Tensor]:
        flat = d.reshape(-1)
        idx = flat.abs().topk(self.k(flat.numel()), sorted=False).indices
        order = idx.argsort()  # sent sorted; the values quantized as found (same scale)
        values = flat[idx]
        if values.dtype == torch.float32 or self.bits < 16:
            values = quantize(values, self.bits, order)
        else:
            values = [values[order]]
        return [indices.encode(idx[order], flat.numel()), *values]

    def add_(self, h: Tensor, payload: list[Tensor]) -> None:
        """``h += `` the entries ``payload`` carries; :class:`~.indices.PayloadError`, before
        ``h`` is touched, when ``payload`` is not what a :meth:`compress` of ``h``'s size
        sends."""
        n = h.numel()
        idx = indices.decode(payload[0], n, self.k(n))
        values = dequantize(payload[1:], self.bits, len(idx))
        h.view(-1).index_add_(0, idx.to(h.device), values.to(h.dtype))


class RandK:
    """``ceil(R n)`` entries at random: payload ``[int64 seed, values]`` per tensor (values as
    :class:`TopK` sends them). The draws come from one generator seeded at 0, so every rank
    that compresses the same tensors in the same order draws the same entries."""

    def __init__(self, ratio: float, bits: int = 16):
        TopK(ratio, bits)  # the same checks
        self.ratio, self.bits = ratio, bits
        self._gen = torch.Generator().manual_seed(0)

    def _indices(self, seed: Tensor, n: int) -> Tensor:
        k = max(1, math.ceil(self.ratio * n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))[:k]

    def compress(self, d: Tensor) -> list[Tensor]:
        flat = d.reshape(-1)
        seed = torch.randint(0, 2**62, (1,), generator=self._gen)
        values = flat[self._indices(seed, flat.numel()).to(flat.device)]
        return [seed, *quantize(values, self.bits)]

    def add_(self, h: Tensor, payload: list[Tensor]) -> None:
        seed = payload[0] if payload else None
        if seed is None or seed.dtype != torch.int64 or seed.shape != (1,):
            raise PayloadError(f"random-k payload must start with one int64 seed, got {seed}")
        idx = self._indices(seed, h.numel()).to(h.device)
        values = dequantize(payload[1:], self.bits, len(idx))
        h.view(-1).index_add_(0, idx, values.to(h.dtype))


class Sign:
    """Scaled sign: payload ``[uint8 packed bits, float32 scale]`` per tensor."""

    _bits = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)

    def compress(self, d: Tensor) -> list[Tensor]:
        flat = d.reshape(-1)
        pad = (-flat.numel()) % 8
        positive = torch.cat([flat >= 0, flat.new_zeros(pad, dtype=torch.bool)])
        bits = self._bits.to(flat.device)
        packed = (positive.view(-1, 8).to(torch.uint8) * bits).sum(1, dtype=torch.uint8)
        scale = flat.abs().mean(dtype=torch.float32).reshape(1)
        return [packed, scale]

    def add_(self, h: Tensor, payload: list[Tensor]) -> None:
        packed, scale = payload
        bits = self._bits.to(packed.device)
        positive = (packed.unsqueeze(1) & bits).ne(0).reshape(-1)[: h.numel()]
        step = torch.where(positive, scale, -scale).to(h.dtype)
        h.view(-1).add_(step)


class Int8:
    """Linear 8-bit: payload ``[int8 values, float32 scale]`` per tensor."""

    def compress(self, d: Tensor) -> list[Tensor]:
        flat = d.reshape(-1).float()
        scale = (flat.abs().max() / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        return [(flat / scale).round_().clamp_(-127, 127).to(torch.int8), scale.reshape(1)]

    def add_(self, h: Tensor, payload: list[Tensor]) -> None:
        values, scale = payload
        h.view(-1).add_((values.float() * scale).to(h.dtype))


def default_consensus_step(spec: str) -> float:
    """A ``gamma`` at which the compressed mix stays stable (see the module doc):
    ``min(0.5, 4 R)`` for ``"topk:R"``, 0.5 for ``"sign"`` and ``"int8"``."""
    compressor = get_compressor(spec)
    if isinstance(compressor, (TopK, RandK)):
        return min(0.5, 4.0 * compressor.ratio)
    return 0.5


def default_drift_correction(spec: str) -> float:
    """The integral step ``beta`` of the drift correction (see the module doc): ``R / 20``
    for ``"topk:R"`` (``gamma / 80`` at the default ``gamma``), 0 (off) for ``"sign"`` and
    ``"int8"``."""
    compressor = get_compressor(spec)
    return compressor.ratio / 20.0 if isinstance(compressor, (TopK, RandK)) else 0.0


def get_compressor(spec: str):
    """``"topk:R[:B]"``, ``"randk:R[:B]"``, ``"sign"`` or ``"int8"`` (see the module doc)."""
    if spec == "sign":
        return Sign()
    if spec == "int8":
        return Int8()
    kind, _, rest = spec.partition(":")
    if kind in ("topk", "randk") and rest:
        ratio, _, bits = rest.partition(":")
        try:
            ratio, bits = float(ratio), int(bits or 16)
        except ValueError:
            ratio = float("nan")
        if ratio == ratio:
            return (TopK if kind == "topk" else RandK)(ratio, bits)
    raise ValueError(
        f"unknown compression {spec!r}; use 'topk:R[:B]' or 'randk:R[:B]' (0 < R <= 1, "
        "B in 2, 4, 8, 16 bits), 'sign' or 'int8'"
    )


class ErrorFeedback:
    """One rank's copies ``h_i`` and ``h_j``, its drift correction ``z_i`` and the compressed
    exchange's two halves.

    Args:
        spec: the compressor (:func:`get_compressor`).
        gamma: the consensus step, in (0, 1]; default :func:`default_consensus_step`.
        beta: the drift correction's integral step, in [0, gamma]; 0 turns it off; default
            :func:`default_drift_correction`.
    """

    def __init__(self, spec: str, gamma: float | None = None, beta: float | None = None):
        if gamma is None:
            gamma = default_consensus_step(spec)
        if not 0 < gamma <= 1:
            raise ValueError(f"consensus step gamma must be in (0, 1], got {gamma}")
        if beta is None:
            beta = min(default_drift_correction(spec), gamma)
        if not 0 <= beta <= gamma:
            raise ValueError(
                f"drift correction beta must be in [0, gamma] = [0, {gamma}], got {beta}"
            )
        self.compressor = get_compressor(spec)
        self.spec = spec
        self.gamma = gamma
        self.beta = beta
        self.own: list[Tensor] = []
        self.drift: list[Tensor] = []  # z_i per tensor (empty when beta is 0)
        self.copies: dict[int, list[Tensor]] = {}
        self._epoch = None
        self._full_until = 0

    def full(self, step: int, epoch: int, period: int) -> bool:
        """Whether the exchange at ``step`` sends the tensors whole (to start the copies)."""
        if epoch != self._epoch:
            self._epoch, self._full_until = epoch, step + period
            self.copies.clear()
        return step < self._full_until

    def encode(self, ys: list[Tensor], full: bool) -> list[Tensor]:
        """What to send: ``ys`` whole, or ``C(y - h_i)`` per tensor (then ``h_i += q_i``)."""
        if full:
            self.own = [y.detach().clone() for y in ys]
            self.drift = [torch.zeros_like(y) for y in ys] if self.beta else []
            return list(ys)
        out = []
        for y, h in zip(ys, self.own):
            q = self.compressor.compress(y - h)
            self.compressor.add_(h, q)
            out += q
        return out

    def decode(self, peer: int, payload: list[Tensor], full: bool) -> list[Tensor]:
        """Update and return the copy ``h_j`` of ``peer`` from what it sent."""
        if full:
            self.copies[peer] = [t.clone() for t in payload]
        else:
            parts = len(payload) // len(self.copies[peer])
            for t, h in enumerate(self.copies[peer]):
                try:
                    self.compressor.add_(h, payload[parts * t : parts * (t + 1)])
                except PayloadError as e:
                    raise PayloadError(f"rank {peer}'s payload, tensor {t}: {e}") from None
        return self.copies[peer]

    def mix_(self, t: int, y: Tensor, copies: list[Tensor], weights: list) -> None:
        """Tensor ``t``: ``d = sum_j w_j (h_j - h_i)`` through :func:`mix` (robust mixing
        passes weights already clipped), then ``y += gamma * d`` and, with drift
        correction, ``z += beta * d; y += z``; in place."""
        own = self.own[t]
        if copies:
            d = mix(own, copies, weights).sub_(own)
            y.add_(d, alpha=self.gamma)
            if self.beta:
                self.drift[t].add_(d, alpha=self.beta)
        if self.beta:
            y.add_(self.drift[t])
