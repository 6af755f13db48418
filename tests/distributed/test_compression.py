"""Compressors and the error-feedback copies, in one process."""

import math

import pytest
import torch

from learned_opt.distributed import indices
from learned_opt.distributed.compression import (
    ErrorFeedback,
    Int8,
    Sign,
    TopK,
    default_consensus_step,
    default_drift_correction,
    get_compressor,
)


def _apply(comp, d):
    h = torch.zeros_like(d)
    comp.add_(h, comp.compress(d))
    return h


def test_topk_keeps_the_largest_entries_in_bfloat16():
    d = torch.randn(7, 13, generator=torch.Generator().manual_seed(0))
    idx, values = TopK(0.1).compress(d)
    assert idx.dtype == torch.uint8 and idx.numel() == indices.nbytes(91, 10)  # sorted, coded
    assert values.dtype == torch.bfloat16
    h = _apply(TopK(0.1), d)
    k = math.ceil(0.1 * d.numel())
    kept = h.ne(0)
    assert int(kept.sum()) == k
    assert torch.equal(h[kept], d[kept].to(torch.bfloat16).float())
    assert d.abs()[kept].min() >= d.abs()[~kept].max()
    big = torch.zeros(40_000)
    big[39_999] = 1.0
    idx, _ = TopK(1e-4).compress(big)  # 4 of 40,000 (beyond int16)
    assert 39_999 in indices.decode(idx, 40_000, 4).tolist()


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
    for _ in range(10):  # 4 entries per step: after 10 steps every entry was sent once
        payload = ef.encode([y], full=False)
        assert payload[0].dtype == torch.uint8 and payload[0].numel() == indices.nbytes(40, 4)
    torch.testing.assert_close(ef.own[0], y, atol=0.01, rtol=0.01)  # to bfloat16's precision
    for _ in range(10):  # the rounding left behind is sent too
        ef.encode([y], full=False)
    torch.testing.assert_close(ef.own[0], y, atol=1e-4, rtol=1e-4)
    assert ef.full(step=0, epoch=0, period=2) and ef.full(1, 0, 2) and not ef.full(2, 0, 2)
    assert ef.full(7, 1, 2)  # a re-formed group starts the copies over


@pytest.mark.parametrize("spec", ["topk:0", "topk:1.5", "topk:x", "fp4", ""])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError, match="compression|top-k ratio"):
        get_compressor(spec)


def test_bad_consensus_step_is_refused():
    with pytest.raises(ValueError, match="gamma"):
        ErrorFeedback("sign", gamma=0.0)


def _ring_run(spec, steps, lr, gamma=None, n=8, dim=200, seed=0, decay=0.0, beta=None):
    """CHOCO-gossip on a ring of ``n`` in one process, through the ranks' ErrorFeedback:
    local gradient steps on f_i(x) = |x - c_i|^2 / 2 (different c_i per rank), then the
    compressed exchange and mix. Returns the mean of x after each mix, the final x and the
    optimum; ``means_before`` (the mean after each step's local steps, before the mix) is
    set as an attribute of the function."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randn(n, dim, generator=gen)
    xs = [torch.randn(dim, generator=gen) for _ in range(n)]
    codecs = [ErrorFeedback(spec, gamma, beta) for _ in range(n)]
    means, _ring_run.means_before = [], []
    for step in range(steps):
        rate = lr / (1.0 + decay * step)
        for i in range(n):
            xs[i] -= rate * (xs[i] - targets[i])
        _ring_run.means_before.append(torch.stack(xs).mean(0))
        full = step == 0
        # what goes on the wire is a copy (packed into a buffer)
        payloads = [[t.clone() for t in codecs[i].encode([xs[i]], full)] for i in range(n)]
        for i in range(n):
            peers = sorted({(i - 1) % n, (i + 1) % n})
            copies = [codecs[i].decode(j, payloads[j], full)[0] for j in peers]
            codecs[i].mix_(0, xs[i], copies, [1 / 3] * len(peers))
        means.append(torch.stack(xs).mean(0))
    return means, torch.stack(xs), targets.mean(0)


def test_compressed_mix_keeps_the_average_exactly():
    # lr 0: pure mixing, so the network average must not move at all
    means, xs, _ = _ring_run("topk:0.01", steps=200, lr=0.0, dim=100)
    for m in means:
        torch.testing.assert_close(m, means[0], atol=1e-5, rtol=0)


def _distance(xs, optimum):
    return float((xs - optimum).norm() / xs.shape[0] ** 0.5)


@pytest.mark.parametrize("spec", ["topk:0.01", "topk:0.05", "sign", "int8"])
def test_compressed_gossip_converges_at_the_default_consensus_step(spec):
    # (and the default drift correction)
    # heterogeneous targets: every rank reaches the optimum of the sum (their mean) only
    # through consensus; a decaying step lets D-SGD converge rather than hover
    _, xs0, optimum = _ring_run(spec, steps=1, lr=0.0, dim=100)
    _, xs, optimum = _ring_run(spec, steps=400, lr=0.05, decay=0.05, dim=100)
    assert torch.isfinite(xs).all()
    assert _distance(xs, optimum) < 0.3 * _distance(xs0, optimum)


def test_too_large_a_drift_correction_oscillates_when_the_step_decays():
    # the integral term reacts to stale copies: at R / 10 it oscillates once the local step
    # decays (the reason the default is R / 20), and without it the ranks agree less
    kw = dict(steps=1500, lr=0.05, decay=0.05, dim=100)
    _, default, optimum = _ring_run("topk:0.01", **kw)
    _, large, _ = _ring_run("topk:0.01", beta=0.001, **kw)
    _, plain, _ = _ring_run("topk:0.01", beta=0.0, **kw)
    assert _distance(large, optimum) > 5 * _distance(default, optimum)
    assert _distance(default, optimum) < _distance(plain, optimum)


def test_top_k_diverges_at_a_large_consensus_step():
    # the cause of the divergence seen with top-k 1% at gamma 0.5 (see compression's doc)
    _, xs, optimum = _ring_run("topk:0.01", steps=400, lr=0.05, gamma=0.5, dim=100)
    assert not _distance(xs, optimum) < 100.0


def test_default_consensus_step_shrinks_with_top_k_density():
    assert default_consensus_step("topk:0.01") == pytest.approx(0.04)
    assert default_consensus_step("topk:0.5") == 0.5
    assert default_consensus_step("sign") == default_consensus_step("int8") == 0.5
    assert ErrorFeedback("topk:0.02").gamma == pytest.approx(0.08)
    with pytest.raises(ValueError, match="unknown compression"):
        default_consensus_step("fp4")


def test_drift_correction_keeps_the_average_exactly():
    # with local steps: every mix leaves the mean where the local steps put it
    means, xs, _ = _ring_run("topk:0.05", steps=200, lr=0.05, dim=100, beta=0.02)
    assert any(float(x.abs().max()) > 0 for x in (xs - xs.mean(0)))  # the ranks differ
    for before, after in zip(_ring_run.means_before, means):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_drift_correction_removes_the_heterogeneity_bias():
    # constant step: plain compressed gossip settles away from the optimum of the sum (each
    # rank is pulled to its own target), the integral term cancels that pull
    _, plain, optimum = _ring_run("topk:0.05", steps=1500, lr=0.05, dim=50, beta=0.0)
    _, corrected, _ = _ring_run("topk:0.05", steps=1500, lr=0.05, dim=50)  # default beta
    assert torch.isfinite(corrected).all()
    assert _distance(corrected, optimum) < 0.5 * _distance(plain, optimum)


def test_drift_correction_defaults_and_checks():
    assert default_drift_correction("topk:0.01") == pytest.approx(0.0005)
    assert default_drift_correction("sign") == default_drift_correction("int8") == 0.0
    assert ErrorFeedback("topk:0.02").beta == pytest.approx(0.001)
    assert ErrorFeedback("topk:0.01", gamma=0.0002).beta == pytest.approx(0.0002)  # <= gamma
    with pytest.raises(ValueError, match="drift correction beta"):
        ErrorFeedback("topk:0.01", gamma=0.04, beta=0.05)
    with pytest.raises(ValueError, match="drift correction beta"):
        ErrorFeedback("topk:0.01", beta=-0.001)


def test_drift_correction_starts_over_with_the_copies():
    ef = ErrorFeedback("topk:0.5", gamma=0.5, beta=0.25)
    y = torch.ones(4)
    ef.encode([y], full=True)
    ef.mix_(0, y, [torch.zeros(4)], [0.5])  # d = -0.5: z = -0.125, y = 1 - 0.25 - 0.125
    torch.testing.assert_close(ef.drift[0], torch.full((4,), -0.125))
    torch.testing.assert_close(y, torch.full((4,), 0.625))
    ef.mix_(0, y, [], [])  # no neighbour this step: z still applies
    torch.testing.assert_close(y, torch.full((4,), 0.5))
    ef.encode([y], full=True)  # a (re-)start: z back to zero
    assert float(ef.drift[0].abs().max()) == 0.0
    assert ErrorFeedback("sign").drift == []
