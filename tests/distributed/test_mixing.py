"""The one mixing function and the simulated communicator."""

import pytest
import torch

from learned_opt.distributed import (
    SimulatedCommunicator,
    get_topology,
    learned_edge_weight,
    metropolis_weight,
    mix,
)
from learned_opt.network import LearnedOptimizerNet


def _random_theta(seed):
    net = LearnedOptimizerNet()
    gen = torch.Generator().manual_seed(seed)
    theta = {k: torch.randn(v.shape, generator=gen) for k, v in net.theta().items()}
    return theta, net.config


def _stacked(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 6, 5, generator=gen), torch.randn(n, 7, generator=gen) * 3]


def test_mix_formula_and_no_input_mutation():
    x, a, b = torch.randn(5), torch.randn(5), torch.randn(5)
    x0 = x.clone()
    out = mix(x, [a, b], [0.25, torch.tensor(0.5)])
    torch.testing.assert_close(out, x + 0.25 * (a - x) + 0.5 * (b - x))
    assert torch.equal(x, x0)
    assert mix(x, [], []) is x
    with pytest.raises(ValueError):
        mix(x, [a], [])


def test_metropolis_weight():
    assert metropolis_weight(2, 2) == pytest.approx(1 / 3)
    assert metropolis_weight(1, 4) == pytest.approx(1 / 5)


def test_learned_weight_zero_head_is_metropolis_and_symmetric():
    net = LearnedOptimizerNet()
    ya, yb = torch.randn(10), torch.randn(10)
    w = learned_edge_weight(net.theta(), net.config, ya, yb, 1.0, 2.0, 3, 5)
    assert w.dim() == 0 and float(w.detach()) == pytest.approx(1 / 4)
    theta, cfg = _random_theta(1)
    w_ab = learned_edge_weight(theta, cfg, ya, yb, torch.tensor(1.0), torch.tensor(2.0), 3, 5)
    w_ba = learned_edge_weight(theta, cfg, yb, ya, torch.tensor(2.0), torch.tensor(1.0), 3, 5)
    torch.testing.assert_close(w_ab, w_ba)  # symmetric features, not only the rank ordering
    assert 0 <= float(w_ab.detach()) <= 1 / 3


def test_zero_edge_head_skips_the_features_with_the_same_weight(monkeypatch):
    """With a zero edge head and no gradient wanted, a learned weight is the head's value
    at z = 0, bitwise, without the features (which read both tensors); with theta that
    requires gradients under autograd (meta-training) the head is evaluated, so it learns."""
    import learned_opt.distributed.mixing as mixing

    net = LearnedOptimizerNet()
    ya, yb = torch.randn(10), torch.randn(10)
    with torch.no_grad():
        full = mixing.edge_weight(
            net.theta(), net.config, mixing.edge_features(ya, yb, 1.0, 2.0, 3),
            3, mixing.time_features(5, net.config, torch.zeros(5)),
        )  # fmt: skip
    calls = []
    features = mixing.edge_features
    monkeypatch.setattr(mixing, "edge_features", lambda *a: calls.append(1) or features(*a))
    with torch.no_grad():
        lean = mixing.learned_edge_weight(net.theta(), net.config, ya, yb, 1.0, 2.0, 3, 5)
    assert torch.equal(lean, full) and not calls
    theta = {k: v.detach().clone().requires_grad_(True) for k, v in net.theta().items()}
    w = mixing.learned_edge_weight(theta, net.config, ya, yb, 1.0, 2.0, 3, 5)
    w.backward()
    assert calls and theta["edge_out.weight"].grad.abs().sum() > 0
    trained = {k: v.detach().clone() for k, v in net.theta().items()}
    trained["edge_out.bias"] += 0.5
    calls.clear()
    with torch.no_grad():
        mixing.learned_edge_weight(trained, net.config, ya, yb, 1.0, 2.0, 3, 5)
    assert calls


@pytest.mark.parametrize(
    "name,n",
    [
        ("ring", 8),
        ("exponential", 8),
        ("random_regular", 9),
        ("torus", 12),
        ("one_peer_exponential", 8),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_loss", [True, False])
def test_learned_mixing_preserves_mean_for_random_theta(name, n, seed, with_loss):
    theta, cfg = _random_theta(seed)
    sim = SimulatedCommunicator(get_topology(name, n))
    ys = _stacked(n, seed)
    losses = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 5 if with_loss else None
    for step in range(3):
        out, info = sim.mix(ys, step, "learned", theta, cfg, losses)
        for y, o, w in zip(ys, out, info["weights"]):
            assert o.shape == y.shape
            torch.testing.assert_close(o.mean(0), y.mean(0), atol=1e-6, rtol=0)
            deg = torch.tensor(
                [
                    max(sim.topology.degree(i, step), sim.topology.degree(j, step))
                    for i, j in info["edges"]
                ]
            )
            assert ((w >= 0) & (w <= 1 / deg + 1e-7)).all()
        ys = out


@pytest.mark.parametrize("rule", ["metropolis", "uniform"])
def test_static_rules_match_mixing_matrix(rule):
    topo = get_topology("random_regular", 8, degree=3, seed=2)
    sim = SimulatedCommunicator(topo)
    ys = _stacked(8, 3)
    out, info = sim.mix(ys, 0, rule)
    w = topo.mixing_matrix(0, rule).float()
    for y, o in zip(ys, out):
        torch.testing.assert_close(o, torch.einsum("ij,j...->i...", w, y), atol=1e-6, rtol=0)
    assert info["edges"] == topo.edges()


def test_learned_mixing_matches_per_edge_calls():
    theta, cfg = _random_theta(4)
    topo = get_topology("ring", 5)
    sim = SimulatedCommunicator(topo)
    ys = _stacked(5, 4)
    losses = torch.rand(5)
    out, info = sim.mix(ys, 2, "learned", theta, cfg, losses)
    for y, o, w in zip(ys, out, info["weights"]):
        for e, (a, b) in enumerate(topo.edges(2)):
            ref = learned_edge_weight(theta, cfg, y[a], y[b], losses[a], losses[b], 2, 2)
            torch.testing.assert_close(w[e], ref)
        i = 0
        nbrs = topo.neighbors(i)
        ws = [w[topo.edges().index((min(i, j), max(i, j)))] for j in nbrs]
        torch.testing.assert_close(o[i], mix(y[i], [y[j] for j in nbrs], ws))


def test_learned_mixing_is_differentiable():
    theta, cfg = _random_theta(5)
    theta = {k: v.requires_grad_(True) for k, v in theta.items()}
    sim = SimulatedCommunicator(get_topology("ring", 6))
    ys = [y.requires_grad_(True) for y in _stacked(6, 5)]
    out, _ = sim.mix(ys, 0, "learned", theta, cfg, torch.rand(6))
    loss = sum(o.square().sum() for o in out)
    loss.backward()
    assert theta["edge_out.weight"].grad.abs().sum() > 0
    assert all(y.grad is not None and torch.isfinite(y.grad).all() for y in ys)


def test_consensus_distance_and_mixing_shrinks_it():
    sim = SimulatedCommunicator(get_topology("ring", 8))
    ys = _stacked(8, 6)
    ref = sum(((y - y.mean(0)) ** 2).sum() for y in ys) / 8
    torch.testing.assert_close(sim.consensus_distance(ys), ref)
    before = sim.consensus_distance(ys)
    for step in range(10):
        ys, _ = sim.mix(ys, step)
    assert sim.consensus_distance(ys) < 0.5 * before


def test_simulator_rejects_bad_input():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    with pytest.raises(ValueError):
        sim.mix(_stacked(5, 0), 0)
    with pytest.raises(ValueError):
        sim.mix(_stacked(4, 0), 0, "learned")
    with pytest.raises(ValueError):
        sim.mix(_stacked(4, 0), 0, "bogus")


def test_single_worker_is_identity():
    sim = SimulatedCommunicator(get_topology("ring", 1))
    ys = _stacked(1, 0)
    out, info = sim.mix(ys, 0)
    assert info["edges"] == [] and all(torch.equal(a, b) for a, b in zip(out, ys))
