"""Compressors and the error-feedback copies, in one process."""

import math

import pytest
import torch

from learned_opt.distributed.compression import ErrorFeedback, Int8, Sign, TopK, get_compressor


def _apply(comp, d):
    h = torch.zeros_like(d)
    comp.add_(h, comp.compress(d))
    return h


def test_topk_keeps_the_largest_entries_exactly():
    d = torch.randn(7, 13, generator=torch.Generator().manual_seed(0))
    h = _apply(TopK(0.1), d)
    k = math.ceil(0.1 * d.numel())
    kept = h.ne(0)
    assert int(kept.sum()) == k
    assert torch.equal(h[kept], d[kept])
    assert d.abs()[kept].min() >= d.abs()[~kept].max()


def test_sign_and_int8_reconstruct_within_their_resolution():
    d = torch.randn(37, generator=torch.Generator().manual_seed(1))  # not a multiple of 8
    h = _apply(Sign(), d)
    torch.testing.assert_close(h.abs(), torch.full_like(d, float(d.abs().mean())))
    assert torch.equal(h.sign(), torch.where(d >= 0, 1.0, -1.0))
    h = _apply(Int8(), d)
    assert float((h - d).abs().max()) <= float(d.abs().max()) / 127 / 2 + 1e-6
    assert float(_apply(Int8(), torch.zeros(5)).abs().max()) == 0.0


def test_error_feedback_sends_what_was_left_out_later():
    y = torch.randn(40, generator=torch.Generator().manual_seed(2))
    ef = ErrorFeedback("topk:0.1")
    ef.encode([torch.zeros(40)], full=True)  # the copies start at zero
    for _ in range(10):  # 4 entries per step: after 10 steps every entry was sent
        payload = ef.encode([y], full=False)
        assert payload[0].dtype == torch.int32 and payload[0].numel() == 4
    torch.testing.assert_close(ef.own[0], y)
    assert ef.full(step=0, epoch=0, period=2) and ef.full(1, 0, 2) and not ef.full(2, 0, 2)
    assert ef.full(7, 1, 2)  # a re-formed group starts the copies over


@pytest.mark.parametrize("spec", ["topk:0", "topk:1.5", "topk:x", "fp4", ""])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError, match="compression|top-k ratio"):
        get_compressor(spec)


def test_bad_consensus_step_is_refused():
    with pytest.raises(ValueError, match="gamma"):
        ErrorFeedback("sign", gamma=0.0)
