"""Local steps with a compressed outer exchange: the round's math, bytes and arguments."""

from __future__ import annotations

import pytest
import torch

from learned_opt.distributed import get_topology, indices
from learned_opt.distributed.local_steps import LocalSteps, SimulatedLocalSteps, nesterov


def sgd(lr=1.0):
    return lambda anchors: torch.optim.SGD(anchors, lr=lr)


def stacked(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 5, 3, generator=gen), torch.randn(n, 7, generator=gen)]


def test_one_local_step_exact_sgd_is_a_local_step_then_gossip():
    topo = get_topology("ring", 4)
    start = [p[:1].repeat(4, *[1] * (p.dim() - 1)) for p in stacked()]  # same start everywhere
    sim = SimulatedLocalSteps(start, sgd(1.0), local_steps=1, topology=topo,
                              compression=None, tracking=False)  # fmt: skip
    w = topo.mixing_matrix(0).to(torch.float32)
    for _ in range(3):
        moved = [p + 0.1 * torch.randn_like(p) for p in start]  # the local step
        expect = [torch.einsum("ij,j...->i...", w, p) for p in moved]
        for p, m in zip(start, moved):
            p.copy_(m)
        assert sim.step() is True
        for p, e in zip(start, expect):
            torch.testing.assert_close(p, e, rtol=0, atol=1e-6)


def test_the_average_moves_by_the_outer_step_whatever_topk_drops():
    topo = get_topology("ring", 4)
    params = [p[:1].repeat(4, *[1] * (p.dim() - 1)) for p in stacked()]
    sim = SimulatedLocalSteps(params, sgd(1.0), local_steps=2, topology=topo,
                              compression="topk:0.1", tracking=False)  # fmt: skip
    for _ in range(6):
        for p in params:
            p.add_(torch.randn_like(p))  # local steps, different on every rank
        mean_before = [p.mean(0) for p in params]  # outer SGD lr 1: anchor <- x
        if sim.step():
            for p, m in zip(params, mean_before):
                torch.testing.assert_close(p.mean(0), m, rtol=0, atol=1e-5)


def test_error_feedback_keeps_what_was_not_sent_and_copies_agree():
    topo = get_topology("ring", 3)
    params = [torch.zeros(3, 100)]
    sim = SimulatedLocalSteps(params, sgd(1.0), local_steps=1, topology=topo,
                              compression="topk:0.1", tracking=False)  # fmt: skip
    target = torch.arange(1.0, 101.0)  # rank 0 moves; the others stay
    params[0][0] = target
    payloads = [r.encode() for r in sim.ranks]
    rank0 = sim.ranks[0]
    own = rank0._anchor.codec.own[0]
    sent = own != 0
    assert int(sent.sum()) == 10 and bool(own[sent].ge(91).all())  # the 10 largest entries
    residual = rank0.anchors[0].detach() - own
    assert torch.equal(residual[~sent], target[~sent])  # kept for a later round
    assert residual[sent].abs().max() < 0.5  # what bfloat16 rounding lost, kept as well
    for r in sim.ranks:
        r.finish({j: payloads[j] for j in r.neighbors})
    for j in (1, 2):  # both neighbours hold rank 0's public copy bit for bit
        assert torch.equal(sim.ranks[j]._anchor.codec.copies[0][0], own)


def test_bytes_are_counted_once_per_neighbour():
    topo = get_topology("ring", 4)  # degree 2
    for tracking, factor in ((False, 1), (True, 2)):
        params = [torch.zeros(4, 100), torch.zeros(4, 40_000)]
        sim = SimulatedLocalSteps(params, nesterov(), local_steps=3, topology=topo,
                                  compression="topk:0.1", tracking=tracking)  # fmt: skip
        assert [sim.step() for _ in range(3)] == [False, False, True]
        # 10 and 4,000 entries: coded indices (:mod:`indices`) and bfloat16 values
        one = indices.nbytes(100, 10) + 10 * 2 + indices.nbytes(40_000, 4000) + 4000 * 2
        assert sim.bytes_per_rank == factor * 2 * one
    exact = SimulatedLocalSteps([torch.zeros(4, 100)], sgd(), local_steps=1, topology=topo,
                                compression=None, tracking=False)  # fmt: skip
    exact.step()
    assert exact.bytes_per_rank == 2 * 100 * 4


def test_tracking_corrects_the_local_steps_towards_the_network_average():
    topo = get_topology("complete", 2)
    params = [torch.zeros(2, 1)]
    sim = SimulatedLocalSteps(params, sgd(1.0), local_steps=1, topology=topo,
                              compression=None, tracking=True)  # fmt: skip
    params[0][:, 0] = torch.tensor([-1.0, -3.0])  # pseudo-gradients 1 and 3
    sim.step()
    # exact mix with weight 1/2: both trackers hold the mean 2, both anchors -2
    assert torch.equal(params[0][:, 0], torch.tensor([-2.0, -2.0]))
    assert [float(r.correction[0]) for r in sim.ranks] == [-1.0, 1.0]  # (D_i - y_i) / H
    sim.step()  # no local move: the correction moves the ranks apart, D_i = 0 on both
    assert [float(r.tracker[0]) for r in sim.ranks] == [0.0, 0.0]  # the mean D is now 0
    assert torch.equal(params[0][:, 0], torch.tensor([-2.0, -2.0]))


def test_outer_learned_optimizer_runs():
    from learned_opt import LearnedOptimizer

    topo = get_topology("ring", 3)
    params = [torch.zeros(3, 4, 4)]
    sim = SimulatedLocalSteps(params, lambda a: LearnedOptimizer(a, lr=1.0, compile=False),
                              local_steps=2, topology=topo, compression="topk:0.25")  # fmt: skip
    for _ in range(4):
        params[0].add_(torch.randn_like(params[0]))
        sim.step()
    assert bool(torch.isfinite(params[0]).all()) and sim.ranks[0].rounds == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(local_steps=0), "local_steps must be an int >= 1"),
        (dict(local_steps=True), "local_steps must be an int >= 1"),
        (dict(local_steps=2.0), "local_steps must be an int >= 1"),
        (dict(compression="gzip"), "unknown compression 'gzip'"),
        (dict(compression="topk:2"), "top-k ratio must be in"),
        (dict(rank=4), "rank 4 is outside"),
        (dict(rule="learned"), "unknown mixing rule"),
        (dict(topology=get_topology("one_peer_exponential", 4)), "need a static topology"),
        (dict(compression=None, consensus_step=0.5), "need compression"),
        (dict(consensus_step=2.0), "consensus step gamma must be in"),
    ],
)
def test_bad_arguments_raise_one_line_errors(kwargs, message):
    args = dict(local_steps=2, topology=get_topology("ring", 4), rank=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        LocalSteps([torch.zeros(3)], nesterov(), **args)


def test_bad_outer_and_driver_misuse_raise():
    topo = get_topology("ring", 4)
    with pytest.raises(ValueError, match="outer lr must be > 0"):
        nesterov(0.0)
    with pytest.raises(ValueError, match="must build a torch.optim.Optimizer"):
        LocalSteps([torch.zeros(3)], lambda a: object(), local_steps=1, topology=topo, rank=0)
    ls = LocalSteps([torch.zeros(3)], nesterov(), local_steps=1, topology=topo, rank=0)
    with pytest.raises(ValueError, match="step\\(\\) needs a communicator"):
        ls.step()
    with pytest.raises(ValueError, match="flush\\(\\) needs a communicator"):
        ls.flush()
    with pytest.raises(ValueError, match="stacked tensor has 3 workers"):
        SimulatedLocalSteps([torch.zeros(3, 2)], nesterov(), local_steps=1, topology=topo)


def test_a_neighbour_missing_from_a_round_raises_and_moves_nothing():
    """A rank whose neighbour is gone (its payload missing) cannot keep its copies in step
    with the others: the round raises, naming who was expected, and leaves the parameters
    and the anchor as they were."""
    topo = get_topology("ring", 4)
    ls = LocalSteps([torch.ones(8)], nesterov(), local_steps=1, topology=topo, rank=0)
    ls.params[0].sub_(0.5)
    payload = ls.encode()
    before = ls.params[0].clone(), ls.anchors[0].detach().clone()
    with pytest.raises(
        RuntimeError, match=r"rank 0 round 0: expected payloads from \[1, 3\], got \[1\]"
    ):
        ls.finish({1: payload})
    assert torch.equal(ls.params[0], before[0]) and torch.equal(ls.anchors[0], before[1])
    assert ls.rounds == 0
