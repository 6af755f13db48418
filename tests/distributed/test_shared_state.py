"""``GossipOptimizer(share_state=...)``: a learned optimizer's second moments and momenta
travel with the parameters (the multi-process run against the simulator is in
test_process_group)."""

from __future__ import annotations

import copy

import pytest
import torch

from learned_opt import LearnedOptimizer, LearnedOptimizerNet
from learned_opt.distributed import GossipOptimizer
from learned_opt.distributed.local import gossip_local
from learned_opt.distributed.mixing import shares_state, tensor_rules
from learned_opt.distributed.packing import Layout, as_received
from learned_opt.distributed.simulated import SimulatedCommunicator
from learned_opt.distributed.topology import get_topology
from learned_opt.meta_train.inner import (
    InnerOptimizer,
    inner_step,
    make_inner_optimizer,
    new_trajectory,
)
from learned_opt.tasks import get_task


class Recorder:
    """A communicator that keeps what each mix was given and averages nothing."""

    def __init__(self, compression=None):
        self.topology = get_topology("ring", 4)
        self.compression = compression
        self.calls = []

    def mix(self, ys, step, rule="metropolis", theta=None, cfg=None, loss=None, *, out=None,
            state=0):  # fmt: skip
        self.calls.append({"ys": list(ys), "out": list(out), "state": state, "rule": rule})
        weights = [torch.full((2,), 0.25 if t < len(ys) - state else 0.5) for t in range(len(ys))]
        return ys, {"weights": weights}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _step(opt, model):
    opt.zero_grad()
    loss = model(torch.randn(8, 5)).square().mean()
    loss.backward()
    opt.step(loss=loss.detach())


def test_learned_optimizer_sends_its_moments_in_the_same_exchange():
    model = _model()
    params = list(model.parameters())
    local = LearnedOptimizer(params)
    comm = Recorder()
    opt = GossipOptimizer(local, communicator=comm, metrics_every=0)
    assert opt.share_state and opt.share_state_every == 2
    _step(opt, model)
    assert comm.calls[-1]["state"] == 0  # by default the second exchange carries it
    _step(opt, model)
    call = comm.calls[-1]
    n = len(params)
    assert call["state"] == 2 * n and len(call["ys"]) == 3 * n
    assert call["rule"] == "learned"
    for p, y, o in zip(params, call["ys"], call["out"]):
        assert y.data_ptr() == p.data_ptr() and o.data_ptr() == p.data_ptr()
    # the state itself, mixed in place: every v, then every m
    for key, first in (("v", n), ("m", 2 * n)):
        for p, y, o in zip(params, call["ys"][first:], call["out"][first:]):
            s = local.state[p][key]
            assert y.data_ptr() == s.data_ptr() == o.data_ptr() and bool(s.abs().sum() > 0)
    # the metrics average the parameters' weights, not the state's
    assert opt.metrics["gossip/edge_weight_mean"] == pytest.approx(0.25)


def test_share_state_is_off_for_other_optimizers_and_under_compression():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not GossipOptimizer(sgd, communicator=Recorder(), metrics_every=0).share_state
    with pytest.raises(ValueError, match="needs a local optimizer with shared_state"):
        GossipOptimizer(sgd, communicator=Recorder(), share_state=True)
    local = LearnedOptimizer(model.parameters())
    squeezed = Recorder(compression="int8")
    assert not GossipOptimizer(local, communicator=squeezed, metrics_every=0).share_state
    with pytest.raises(ValueError, match="compressed exchange"):
        GossipOptimizer(local, communicator=squeezed, share_state=True)
    off = GossipOptimizer(local, communicator=Recorder(), share_state=False, metrics_every=0)
    _step(off, model)
    assert off.communicator.calls[-1]["state"] == 0


def test_state_without_a_step_yet_is_sent_as_discarded_zeros():
    model = _model()
    params = list(model.parameters())
    local = LearnedOptimizer(params)
    sent = gossip_local(local).shared_state()  # before any step: no state
    assert [s.shape for s in sent] == [p.shape for p in params] + [
        (1, *p.shape) for p in params
    ]  # the rows the rule reads
    assert all(not s.any() for s in sent) and not local.state


def test_state_tensors_take_static_weights_under_the_learned_rule():
    assert tensor_rules("learned", 5, 2) == ["learned"] * 3 + ["metropolis"] * 2
    assert tensor_rules("uniform", 3, 1) == ["uniform"] * 3
    with pytest.raises(ValueError, match="state must be between"):
        tensor_rules("metropolis", 2, 3)
    # in the simulator: under the learned rule the state rows take Metropolis weights and
    # the parameter rows the learned ones, as when mixed alone
    sim = SimulatedCommunicator(get_topology("ring", 4))
    y = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    net = LearnedOptimizerNet()
    theta = {k: v.detach() + 0.3 * torch.randn(v.shape, generator=gen)
             for k, v in net.named_parameters()}  # fmt: skip
    (params, state), info = sim.mix([y, y], 0, "learned", theta, net.config, state=1)
    learned, _ = sim.mix([y], 0, "learned", theta, net.config)
    torch.testing.assert_close(params, learned[0])
    # Metropolis on the ring (1/3 each), the neighbours' state as they send it (bfloat16)
    received = y.to(torch.bfloat16).to(y.dtype)
    expected = (y + received.roll(1, 0) + received.roll(-1, 0)) / 3
    torch.testing.assert_close(state, expected)
    assert not torch.allclose(info["weights"][0], info["weights"][1])


def test_shared_state_travels_in_bfloat16_and_parameters_exactly():
    params = [torch.randn(3, 5), torch.randn(7, dtype=torch.float64)]
    state = [torch.randn(3, 5), torch.randn(7, dtype=torch.float64), torch.randn(2)]
    ys = params + state
    whole, wire = Layout.of(ys), Layout.of(ys, state=len(state))
    assert wire.dtypes == (torch.float32, torch.float64, torch.bfloat16, torch.float64,
                           torch.bfloat16)  # fmt: skip

    # float32 state at 2 bytes an element instead of 4 (float64 state travels as it is)
    def payload(layout):
        return sum(numel * dt.itemsize for dt, _, numel in layout.sections)

    assert payload(whole) - payload(wire) == 2 * (15 + 2)
    assert wire.nbytes < whole.nbytes
    buf = torch.empty(wire.nbytes, dtype=torch.uint8)
    assert wire.pack(ys, 0.5, buf)
    got = wire.unpack(buf)
    for sent, arrived in zip(params + state[1:2], got[:2] + got[3:4]):
        assert arrived.dtype == sent.dtype and torch.equal(arrived, sent)
    for sent, arrived in zip(state[0::2], got[2::2]):
        assert arrived.dtype == torch.bfloat16
        assert torch.equal(arrived, sent.to(torch.bfloat16))
        assert torch.equal(as_received(sent), arrived.to(sent.dtype))
    # a non-finite value in the state still marks the buffer
    state[2][0] = float("inf")
    assert not wire.pack(ys, None, buf)


def test_the_finite_flag_reads_every_wire_dtype_without_false_alarms():
    """The sender's finite check sums each section: a NaN in bfloat16 state marks the
    buffer, and finite float16 values whose sum passes float16's range (65504) do not."""
    half = torch.full((100,), 60000.0, dtype=torch.float16)  # sum 6e6: inf in float16
    state = [torch.randn(3, 5)]
    layout = Layout.of([half, *state], state=1)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    assert layout.pack([half, *state], 0.5, buf)
    assert float(layout.header(buf)[1]) == 1.0
    state[0][1, 2] = float("nan")
    assert not layout.pack([half, *state], 0.5, buf)
    assert float(layout.header(buf)[1]) == 0.0
    big = [torch.full((4,), 3e38)]  # bfloat16 state whose sum overflows float32 too
    layout = Layout.of(big, state=1)
    assert not layout.pack(big, None, torch.empty(layout.nbytes, dtype=torch.uint8))


def test_the_simulator_mixes_the_state_as_received_and_stays_differentiable():
    sim = SimulatedCommunicator(get_topology("ring", 4))
    y = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
    (param, state), _ = sim.mix([y, y], 0, "metropolis", state=1)
    received = y.detach().to(torch.bfloat16).float()
    expected = (y.detach() + received.roll(1, 0) + received.roll(-1, 0)) / 3
    torch.testing.assert_close(state.detach(), expected)
    assert not torch.equal(state, param)  # the parameters' neighbours arrive exactly
    state.sum().backward()
    torch.testing.assert_close(y.grad, torch.ones_like(y))  # the rounding passes it straight


def test_share_state_every_k_sends_the_state_in_one_exchange_of_k():
    assert [shares_state(i, 3) for i in range(7)] == [False, False, True] * 2 + [False]
    assert all(shares_state(i, 1) for i in range(5))
    model = _model()
    local = LearnedOptimizer(model.parameters())
    comm = Recorder()
    opt = GossipOptimizer(local, communicator=comm, share_state_every=3, metrics_every=0)
    for _ in range(6):
        _step(opt, model)
    n = len(list(model.parameters()))
    assert [c["state"] for c in comm.calls] == [0, 0, 2 * n] * 2
    assert [len(c["ys"]) for c in comm.calls] == [n, n, 3 * n] * 2
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="share_state_every must be an int >= 1"):
            GossipOptimizer(local, communicator=Recorder(), share_state_every=bad)
        with pytest.raises(ValueError, match="share_state_every must be an int >= 1"):
            InnerOptimizer("learned", share_state_every=bad)


def test_the_simulator_shares_the_state_by_the_same_rule():
    # every=2: the first exchange leaves each worker's moments as its own step left them;
    # the second mixes them with Metropolis weights, as every exchange does for every=1
    task = get_task("wine_mlp")
    opt = make_inner_optimizer("learned", net=LearnedOptimizerNet(), mixing="metropolis")
    alone = copy.copy(opt)
    alone.share_state = False
    opt.share_state_every = 2
    traj = new_trajectory(task, 4, "ring", "dirichlet", 0.3, 0, 4)
    twin = copy.deepcopy(traj)
    inner_step(traj, opt)
    inner_step(twin, alone)
    for key in ("v", "m"):
        torch.testing.assert_close(traj.states[key], twin.states[key], atol=0, rtol=0)
    inner_step(traj, opt)
    inner_step(twin, alone)
    torch.testing.assert_close(traj.params, twin.params, atol=0, rtol=0)
    (v,), _ = twin.comm.mix([twin.states["v"]], 1, rule="metropolis")
    torch.testing.assert_close(traj.states["v"], v)
    assert not torch.allclose(v, twin.states["v"])
