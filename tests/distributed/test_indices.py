"""The lossless index code of top-k: round trips, lengths, and buffers a neighbour corrupted."""

from __future__ import annotations

import math

import pytest
import torch

from learned_opt.distributed import indices
from learned_opt.distributed.compression import (
    ErrorFeedback,
    PayloadError,
    dequantize,
    get_compressor,
    quantize,
)
from learned_opt.distributed.outer import OuterStep, outer_rule, unwire, wire


def _draw(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 64, 100, 1000, 4097, 65_537])
def test_every_density_round_trips_exactly_in_the_bytes_counted(n):
    for k in sorted({0, 1, 2, n // 20, n // 4, n // 2, n - 1, n} & set(range(n + 1))):
        idx = _draw(n, k, seed=n + k)
        buf = indices.encode(idx, n)
        assert buf.dtype == torch.uint8 and buf.numel() == indices.nbytes(n, k)
        back = indices.decode(buf, n, k)
        assert back.dtype == torch.int64 and torch.equal(back, idx)


def test_the_codes_by_density_and_their_lengths():
    assert indices.code(5, 5) == ("all", 0, 0) and indices.nbytes(0, 0) == 0
    assert indices.code(100, 60)[0] == "bitmap" and indices.nbytes(100, 60) == 13
    kind, low, bits = indices.code(2048, 103)  # 5 %: Elias-Fano, 6.2 bits per index
    assert kind == "elias-fano" and low == 4 and bits == 103 * 4 + (2047 >> 4) + 103
    entropy = math.lgamma(2049) - math.lgamma(104) - math.lgamma(1946)
    assert bits < 1.1 * entropy / math.log(2)  # within 10 % of any code's floor
    n = 3_000_000_000  # large n: the length is computed, nothing is allocated
    assert indices.nbytes(n, n // 100) < n // 100 * 9 // 8
    idx = torch.tensor([0, 5, 2**40 + 3])
    assert torch.equal(indices.decode(indices.encode(idx, 2**41), 2**41, 3), idx)


def test_topk_sends_sorted_indices_and_receives_every_bit_the_unsorted_encoding_did():
    for spec in ("topk:0.05:4", "topk:0.02:2", "topk:0.05:8", "topk:0.1", "topk:1:4"):
        c = get_compressor(spec)
        for shape in ((7,), (64, 33), (5000,)):
            d = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
            flat = d.reshape(-1)
            k = c.k(flat.numel())
            idx = flat.abs().topk(k, sorted=False).indices  # as found, in this order
            reference = torch.zeros_like(flat)
            values = dequantize(quantize(flat[idx], c.bits), c.bits, k)
            reference.index_add_(0, idx, values.float())
            h = torch.zeros_like(d)
            c.add_(h, c.compress(d))
            assert torch.equal(h.reshape(-1), reference), (spec, shape)


def _corrupt(buf: torch.Tensor, n: int, k: int):
    yield buf[:-1] if buf.numel() else torch.zeros(1, dtype=torch.uint8)  # too short
    yield torch.cat([buf, buf.new_zeros(1)])  # too long
    yield buf.to(torch.int16)  # wrong dtype
    yield torch.full_like(buf, 255)  # every bit set
    yield torch.zeros_like(buf)  # no bit set
    for byte in range(buf.numel()):
        for bit in range(8):
            flipped = buf.clone()
            flipped[byte] ^= 1 << bit
            yield flipped


@pytest.mark.parametrize("n, k", [(2048, 103), (100, 60), (64, 4), (9, 1), (40_000, 4)])
def test_a_corrupt_buffer_is_rejected_or_decodes_to_a_valid_set(n, k):
    buf = indices.encode(_draw(n, k), n)
    rejected = 0
    for bad in _corrupt(buf, n, k):
        try:
            idx = indices.decode(bad, n, k)
        except PayloadError:
            rejected += 1
            continue
        # a flip the code cannot see (a low bit) still gives k distinct indices inside n
        assert idx.numel() == k and int(idx.min()) >= 0 and int(idx.max()) < n
        assert idx.unique().numel() == k
    assert rejected >= 5


def test_a_corrupt_payload_stops_the_round_naming_the_sender_before_anything_moves():
    params = [torch.zeros(300), torch.zeros(4)]
    ranks = [OuterStep(params, outer_rule("nesterov")[0], local_steps=1, rank=r,
                       world_size=2) for r in range(2)]  # fmt: skip
    for r in ranks:
        r.params[0].add_(torch.randn(300))
    payloads = [r.encode() for r in ranks]
    assert ranks[0].bytes_sent == wire(payloads[0]).numel()  # the buffer gathered
    assert all(
        torch.equal(a, b) for a, b in zip(unwire(wire(payloads[1]), payloads[0]), payloads[1])
    )
    bad = list(payloads[1])
    bad[0] = torch.full_like(bad[0], 255)  # indices: every bit set
    anchors = [a.detach().clone() for a in ranks[0].anchors]
    with pytest.raises(PayloadError, match="rank 1's payload, tensor 0"):
        ranks[0].finish({1: bad})
    assert all(torch.equal(a, b) for a, b in zip(ranks[0].anchors, anchors))
    bad = list(payloads[1])
    bad[1] = bad[1][:-1]  # values cut short
    with pytest.raises(PayloadError, match="values in 4 bits"):
        ranks[0].finish({1: bad})
    ranks[0].finish({1: payloads[1]})  # the genuine payload still decodes


def test_error_feedback_names_the_neighbour_whose_payload_is_corrupt():
    ef = ErrorFeedback("topk:0.1:4")
    ef.encode([torch.zeros(50)], full=True)
    ef.decode(3, [torch.zeros(50)], full=True)
    payload = ef.encode([torch.randn(50)], full=False)
    with pytest.raises(PayloadError, match="rank 3's payload, tensor 0"):
        ef.decode(3, [payload[0][:1], *payload[1:]], full=False)
    with pytest.raises(PayloadError, match="int64 seed"):
        get_compressor("randk:0.1:4").add_(torch.zeros(50), [torch.zeros(1)])
