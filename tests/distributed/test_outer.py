"""The shared compressed outer step (DiLoCo / DeMo class): codecs, bytes, the round's math,
and the mode on 2 real gloo ranks (torchrun entry and Lightning strategy)."""

from __future__ import annotations

import math

import dist_workers as w
import outer_workers as ow
import pytest
import torch

from learned_opt.distributed import get_topology, launch_local
from learned_opt.distributed.compression import dequantize, get_compressor, quantize
from learned_opt.distributed.local_steps import SimulatedLocalSteps
from learned_opt.distributed.outer import (
    DEFAULT_COMPRESSION,
    DEFAULT_LOCAL_STEPS,
    OuterStep,
    outer_rule,
)
from learned_opt.distributed.train import format_summary, parse_args


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_packs_bits_and_rounds_to_the_nearest_level(bits):
    v = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    packed, scale = quantize(v, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 * bits / 8)
    back = dequantize([packed, scale], bits, 1001)
    levels = (torch.arange(2**bits) * 2 - (2**bits - 1)) * scale
    inside = v.abs() <= levels.max()  # the rest is clipped to the outermost level
    nearest = levels[(v[:, None] - levels[None]).abs().argmin(1)]
    torch.testing.assert_close(back[inside], nearest[inside])
    assert bool((back[~inside].abs() == levels.max()).all())


@pytest.mark.parametrize(
    "spec, nbytes",
    [
        ("topk:0.02:4", 19 + 10 + 4),  # 20 of 1,000 indices in 151 bits, 4-bit values, a scale
        ("topk:0.02:2", 19 + 5 + 4),
        ("topk:0.02", 19 + 20 * 2),  # bfloat16 values
        ("randk:0.02:4", 8 + 10 + 4),  # a seed, no indices
        ("randk:0.03:8", 8 + 30 + 4),
    ],
)
def test_payload_bytes_are_indices_values_and_scales(spec, nbytes):
    c = get_compressor(spec)
    payload = c.compress(torch.randn(1000))
    assert sum(t.numel() * t.element_size() for t in payload) == nbytes


def test_randk_draws_the_same_entries_on_every_rank_and_decodes_from_the_seed():
    a, b = get_compressor("randk:0.05:8"), get_compressor("randk:0.05:8")
    x, y = torch.randn(500), torch.randn(500)
    for _ in range(3):
        pa, pb = a.compress(x), b.compress(y)
        assert torch.equal(pa[0], pb[0])  # the same draw in the same call
        ha, hb = torch.zeros(500), torch.zeros(500)
        a.add_(ha, pa)
        b.add_(hb, pb)
        assert torch.equal(ha != 0, hb != 0) and int((ha != 0).sum()) == 25


@pytest.mark.parametrize("spec", ["topk:0.1:5", "randk:0:4", "randk", "topk:0.1:x"])
def test_bad_specs_raise(spec):
    with pytest.raises(ValueError, match="compression|bits|ratio"):
        get_compressor(spec)


def _simulate(rule, world=2, steps=ow.TOY_STEPS):
    start = ow.toy_start()
    params = [p.unsqueeze(0).repeat(world, *[1] * p.dim()) for p in start]
    factory, decay = outer_rule(rule)
    sim = SimulatedLocalSteps(params, factory, kind=OuterStep, local_steps=ow.TOY_H,
                              topology=get_topology("ring", world), compression=ow.TOY_SPEC,
                              decay=decay)  # fmt: skip
    for _ in range(steps):
        for i in range(world):
            ow.toy_local_step([p[i] for p in params], ow.toy_targets(i))
        sim.step()
    if sim.count % sim.local_steps:
        sim.round()
    return params, sim


@pytest.mark.parametrize("rule", ["nesterov", "learned", "demo"])
def test_every_rank_ends_on_the_same_anchor_and_error_feedback_keeps_the_rest(rule):
    params, sim = _simulate(rule, world=4, steps=9)
    for p in params:
        assert torch.equal(p, p[:1].expand_as(p))  # bitwise the same anchor everywhere
        assert bool(torch.isfinite(p).all())
    if rule != "demo":  # decay 1: what was sent plus what is kept is every pseudo-gradient
        r = sim.ranks[0]
        assert all(bool(b.abs().sum() > 0) for b in r.buffers)  # top-k 20% kept some back


@pytest.mark.parametrize("rule", ["nesterov", "learned", "demo"])
def test_the_anchor_moves_towards_the_ranks_common_optimum(rule):
    """The ranks' quadratics differ, so the compressed pseudo-gradients keep a noise floor
    (each rank sends its own top entries): the anchor goes there, not to the optimum."""
    start = ow.toy_start()
    params, _ = _simulate(rule, world=4, steps=150)
    mean_target = [sum(t) / 4 for t in zip(*(ow.toy_targets(i) for i in range(4)))]
    for s, p, t in zip(start, params, mean_target):
        assert float((p[0] - t).norm()) < 0.3 * float((s - t).norm())


@pytest.mark.parametrize("size, lr", [(1e-4, 1.0), (1.0, 1.0), (30.0, 0.5)])
def test_the_learned_outer_step_moves_by_the_pseudo_gradient_at_the_adapted_size(size, lr):
    """Each round moves a tensor by ``lr * exp(log_lr)`` times the averaged pseudo-gradient
    itself, at any scale of it, with ``log_lr`` the shipped rule's adaptation of the cosine
    between this round's pseudo-gradient and the momentum of the earlier ones, never above
    the ceiling; a tensor without a pseudo-gradient, or with a non-finite one, stays put."""
    from learned_opt import load_checkpoint
    from learned_opt.checkpoint import DEFAULT_CHECKPOINT
    from learned_opt.distributed.outer import LEARNED_CEILING
    from learned_opt.features import adapt_log_lr

    config = load_checkpoint(DEFAULT_CHECKPOINT)[0].config
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 24), (24,), (3, 5), (7,)]
    anchors = [torch.randn(s, generator=gen).requires_grad_(True) for s in shapes]
    outer = outer_rule("learned", lr)[0](anchors)
    m, v, log_lr = [torch.zeros(s) for s in shapes], [0.0] * 4, [torch.zeros(())] * 4
    directions = [torch.randn(s, generator=gen) for s in shapes]
    for t in range(1, 7):
        # the first tensor's pseudo-gradients agree from round to round, the second's
        # alternate in sign: its move must shrink, and neither may grow past the ceiling
        grads = [size * directions[0], size * (-1) ** t * directions[1],
                 torch.full((3, 5), math.nan), None]  # fmt: skip
        before = [a.detach().clone() for a in anchors]
        for a, g in zip(anchors, grads):
            a.grad = None if g is None else g.clone()
        outer.step()
        for k in (0, 1):
            g = grads[k]
            v[k] = 0.999 * v[k] + 0.001 * float(g.pow(2).mean())
            log_lr[k] = adapt_log_lr(
                log_lr[k], (g * m[k]).sum(), g.pow(2).sum(), m[k].pow(2).sum(),
                torch.tensor(v[k]), torch.tensor(float(g.numel())), t, config, 1.0,
                LEARNED_CEILING,
            )  # fmt: skip
            m[k].mul_(0.9).add_(g, alpha=0.1)
            want = before[k] - lr * float(torch.exp(log_lr[k])) * g
            torch.testing.assert_close(anchors[k].detach(), want, rtol=1e-5, atol=1e-6 * size)
            assert float(log_lr[k]) <= LEARNED_CEILING
        for k in (2, 3):
            assert torch.equal(anchors[k].detach(), before[k])
    assert float(log_lr[1]) < -0.5 and float(log_lr[1]) < float(log_lr[0])


def test_bytes_are_the_payload_to_every_other_rank():
    _, sim = _simulate("nesterov", world=4, steps=9)
    r = sim.ranks[0]
    one = sum(t.numel() * t.element_size() for t in r.compressor.compress(torch.randn(40)))
    one += sum(t.numel() * t.element_size() for t in r.compressor.compress(torch.randn(3, 5)))
    assert r.rounds == 3 and r.bytes_sent == 3 * 3 * one  # 3 rounds, 3 other ranks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(local_steps=0), "local_steps must be an int >= 1"),
        (dict(rank=2), "rank 2 is outside"),
        (dict(decay=0.0), "decay must be in"),
        (dict(compression="gzip"), "unknown compression"),
        (dict(world_size=None), "needs world_size"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    args = {**dict(local_steps=2, rank=0, world_size=2), **kwargs}
    with pytest.raises(ValueError, match=message):
        OuterStep([torch.zeros(3)], outer_rule("demo")[0], **args)
    with pytest.raises(ValueError, match="unknown outer rule"):
        outer_rule("adam")


def test_the_entry_flag_sets_the_modes_defaults():
    args = parse_args(["--optimizer", "adam", "--outer-step", "learned"])
    assert args.local_steps == DEFAULT_LOCAL_STEPS and args.compression == DEFAULT_COMPRESSION
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "adam", "--outer-step", "demo", "--outer", "sgd"])
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "adam", "--outer-step", "sgd"])


@pytest.mark.timeout(w.test_timeout())
def test_two_gloo_ranks_run_the_mode_as_the_simulator_does(tmp_path):
    results = launch_local(ow.outer_suite, 2, str(tmp_path), timeout=w.launch_timeout(),
                           pg_timeout=w.STARTUP)  # fmt: skip
    for rule in ("nesterov", "demo"):
        params, sim = _simulate(rule)
        for rank, res in enumerate(results):
            toy = res["toy"][rule]
            assert toy["rounds"] == 4 and toy["flushed"]
            assert toy["bytes_sent"] == sim.ranks[rank].bytes_sent
            for got, want in zip(toy["params"], params):
                assert torch.equal(got, want[rank])  # to the bit
    a, b = (res["entry"] for res in results)
    assert a["outer_step"] == "nesterov" and "local_steps=4" in format_summary(a)
    assert a["test_loss"] == b["test_loss"] and math.isfinite(a["test_loss"])
    assert a["consensus_distance"] == pytest.approx(0.0, abs=1e-12)  # one anchor after flush
    exact = results[0]["exact"]
    assert a["bytes_per_step"] < exact["bytes_per_step"] / 20
    la, lb = (res["lightning"] for res in results)
    assert la["rounds"] == 3 and la["bytes_sent"] == lb["bytes_sent"] > 0  # 7 batches, H 3
    for pa, pb in zip(la["params"], lb["params"]):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(p, q) for p, q in zip(la["params"], la["before"]))
