"""Robust mixing (``robust="clip"``): self-centred clipping of what each neighbour sends."""

import pytest
import torch

from learned_opt.distributed import SimulatedCommunicator, get_topology, mix
from learned_opt.distributed.gossip import resolve_communicator
from learned_opt.distributed.mixing import (
    CLIP_MULTIPLE,
    REDESCEND,
    parse_robust,
    robust_weight_lists,
)
from learned_opt.distributed.train import parse_args


def _near(x, count, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    return [x + scale * torch.randn(x.shape, generator=gen) for _ in range(count)]


@pytest.mark.parametrize("bad", ["scaled", "sign_flip", "random"])
def test_clip_bounds_a_bad_neighbours_pull(bad):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=gen)
    honest = _near(x, 2, 0.01, 1)
    sent = {"scaled": 100 * x, "sign_flip": -x, "random": torch.randn(50, generator=gen) * 1e3}
    neighbours, weights = [*honest, sent[bad]], [0.25] * 3
    tau = CLIP_MULTIPLE * min(float(torch.dist(h, x)) for h in honest)
    plain = mix(x, neighbours, weights)
    robust = mix(x, neighbours, weights, robust="clip")
    assert float(torch.dist(plain, x)) > 10 * sum(weights) * tau  # plain follows the bad one
    assert float(torch.dist(robust, x)) <= sum(weights) * tau * (1 + 1e-6)
    clipped = robust_weight_lists([x], [neighbours], [weights])[0]
    assert clipped[:2] == pytest.approx(weights[:2])  # the honest ones, within 2 tau
    bad_pull = clipped[2] * float(torch.dist(sent[bad], x))
    assert bad_pull <= 0.25 * REDESCEND * tau**2 / float(torch.dist(sent[bad], x)) * (1 + 1e-6)


def test_honest_neighbours_within_tau_are_not_clipped():
    x = torch.zeros(8)
    near, farther = torch.full((8,), 0.1), torch.full((8,), 0.15)  # within 2x the closest
    weights = [0.3, 0.3]
    torch.testing.assert_close(
        mix(x, [near, farther], weights, robust="clip"), mix(x, [near, farther], weights)
    )
    w = robust_weight_lists([x], [[near, torch.full((8,), 0.5)]], [weights])[0]
    assert w == pytest.approx([0.3, 0.3 * 0.2 / 0.5])  # at 5x the closest: clipped to 2x


def test_no_attacker_and_large_tau_is_plain_mixing():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, generator=gen)
    neighbours = [torch.randn(6, 5, generator=gen) * s for s in (0.1, 1.0, 10.0)]
    weights = [0.2, torch.tensor(0.25), 0.1]
    plain = mix(x, neighbours, weights)
    torch.testing.assert_close(mix(x, neighbours, weights, robust="clip:1e9"), plain)
    out = x.clone()  # in place, as a real worker mixes its parameters
    mix(out, neighbours, weights, out=out, robust="clip:1e9")
    torch.testing.assert_close(out, plain)


STAR = [(0, j) for j in range(1, 8)] + [(1, 2)]  # uneven degrees: padded neighbour slots


@pytest.mark.parametrize("name", ["ring", "exponential", "custom"])
@pytest.mark.parametrize("robust", ["clip", "clip:1e9"])
def test_simulator_clips_each_worker_as_a_real_worker_does(name, robust):
    topo = get_topology(name, 8, **({"edges": STAR} if name == "custom" else {}))
    gen = torch.Generator().manual_seed(1)
    ys = [torch.randn(8, 4, 3, generator=gen), torch.randn(8, 5, generator=gen)]
    ys[0][2] *= 100  # one worker far from the others
    mixed, _ = SimulatedCommunicator(topo, robust=robust).mix(ys, 0)
    for i in range(8):
        peers = topo.neighbors(i, 0)
        weights = [topo.weight(i, j, 0, "metropolis") for j in peers]
        for y, out in zip(ys, mixed):
            expect = mix(y[i], [y[j] for j in peers], weights, robust=robust)
            torch.testing.assert_close(out[i], expect)
    if robust == "clip:1e9":
        plain, _ = SimulatedCommunicator(topo).mix(ys, 0)
        for a, b in zip(mixed, plain):
            torch.testing.assert_close(a, b)


def test_identical_or_weightless_neighbours_do_not_set_tau():
    x = torch.zeros(4)
    others = [x.clone(), torch.full((4,), 1e-9), torch.ones(4), torch.full((4,), 1.5)]
    w = robust_weight_lists([x], [others], [[0.2, 0.0, 0.2, 0.2]])[0]
    assert w == pytest.approx([0.2, 0.0, 0.2, 0.2])  # tau from the third: 2 * 2, none clipped


def test_robust_mixing_is_differentiable():
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(8, 6, generator=gen, requires_grad=True)
    mixed, _ = SimulatedCommunicator(get_topology("ring", 8), robust="clip").mix([y * 1.0], 3)
    mixed[0].square().sum().backward()
    assert y.grad is not None and torch.isfinite(y.grad).all()


@pytest.mark.parametrize(
    "spec,message",
    [
        ("trim", "unknown robust mixing 'trim'"),
        ("clip:0", "must be a number > 0"),
        ("clip:x", "must be a number > 0"),
        (True, "unknown robust mixing True"),
    ],
)
def test_bad_robust_specs_are_refused(spec, message):
    assert parse_robust("clip:3") == 3.0 and parse_robust(None) is None
    with pytest.raises(ValueError, match=message):
        parse_robust(spec)
    with pytest.raises(ValueError, match=message):
        SimulatedCommunicator(get_topology("ring", 4), robust=spec)
    with pytest.raises(ValueError, match=message):
        mix(torch.zeros(2), [], [], robust=spec)
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "adam", "--robust", str(spec)])


def test_robust_for_a_given_communicator_must_match_it():
    comm = SimulatedCommunicator(get_topology("ring", 4), robust="clip")
    assert resolve_communicator(comm, None, 1.0, "GossipOptimizer", robust="clip") is comm
    with pytest.raises(ValueError, match="robust=None"):
        resolve_communicator(
            SimulatedCommunicator(get_topology("ring", 4)), None, 1.0, "x", robust="clip"
        )
    assert parse_args(["--optimizer", "adam", "--robust", "clip:1.5"]).robust == "clip:1.5"
