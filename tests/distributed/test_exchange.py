"""One exchange of a gossip step (``distributed/exchange.py``): the ``Communicator``
protocol, ``exchange_and_mix`` in place and differentiably, and DSGT's tracker."""

from __future__ import annotations

import pytest
import torch

from learned_opt.distributed import ProcessGroupCommunicator, SimulatedCommunicator
from learned_opt.distributed.exchange import Communicator, exchange_and_mix, sends_state
from learned_opt.distributed.topology import get_topology
from learned_opt.distributed.tracking import tracker_update


def _stacked(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 4, 3, generator=gen), torch.randn(n, 5, generator=gen)]


def test_both_communicators_are_communicators():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    assert isinstance(sim, Communicator)
    # the real one needs a process group to be built; its class has the protocol's methods
    for name in ("mix", "consensus_distance"):
        assert callable(getattr(ProcessGroupCommunicator, name))
    assert not isinstance(object(), Communicator)


def test_exchange_mixes_params_and_state_like_one_mix():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    params, state = _stacked(4, 0), [torch.rand(4, 7) + 0.1]
    want, want_info = sim.mix(params + state, 3, "metropolis", state=1)
    got = exchange_and_mix(sim, params, state, 3, "metropolis")
    for a, b in zip(got.params + got.state, want):
        torch.testing.assert_close(a, b)
    assert len(got.info["weights"]) == len(params)  # the parameters' weights only
    assert len(want_info["weights"]) == 3


def test_exchange_without_state_returns_no_state():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    got = exchange_and_mix(sim, _stacked(4, 1), [], 0, "uniform")
    assert got.state == []
    assert len(got.params) == 2


def test_exchange_in_place_writes_the_given_tensors():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    params, state = _stacked(4, 2), [torch.rand(4, 3)]
    want, _ = sim.mix([t.clone() for t in params + state], 0, "metropolis", state=1)
    got = exchange_and_mix(sim, params, state, 0, "metropolis", in_place=True)
    assert all(a is b for a, b in zip(got.params + got.state, params + state))
    for a, b in zip(params + state, want):
        torch.testing.assert_close(a, b)


def test_exchange_is_differentiable_without_in_place():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    params = [t.requires_grad_() for t in _stacked(4, 3)]
    got = exchange_and_mix(sim, params, [], 0, "metropolis")
    sum(p.square().sum() for p in got.params).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)


def test_simulated_out_must_match_the_tensors():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    ys = _stacked(4, 4)
    with pytest.raises(ValueError, match="out holds 1 tensors for 2"):
        sim.mix(ys, 0, out=ys[:1])


@pytest.mark.parametrize(("share", "exchange", "every", "want"), [
    (False, 1, 1, False), (True, 0, 1, True), (True, 0, 2, False), (True, 1, 2, True),
])  # fmt: skip
def test_sends_state(share, exchange, every, want):
    assert sends_state(share, exchange, every) is want


def test_tracker_update_starts_at_the_gradient_then_tracks_the_change():
    g0, g1, wy = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 1.0]), torch.tensor([0.5, 0.5])
    assert torch.equal(tracker_update(None, g0, None), g0)
    assert torch.equal(tracker_update(wy, g1, g0), torch.tensor([2.5, -0.5]))
