"""The local optimizer as gossip sees it: the ``GossipLocal`` protocol, its adapters, and
the announced switch to the shipped decentralized rule."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from learned_opt import (
    LearnedOptimizer,
    LearnedOptimizerNet,
    MixingConfig,
    NetConfig,
    load_checkpoint,
)
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.distributed import GossipOptimizer
from learned_opt.distributed.local import (
    GossipLocal,
    LearnedLocal,
    TorchLocal,
    gossip_local,
)
from learned_opt.distributed.topology import get_topology

ADAPT = NetConfig(lr_adapt_rate=0.5)
MIXING = MixingConfig(lr_adapt_max_gossip=0.5)


class Recorder:
    """A communicator that keeps what each mix was given and averages nothing."""

    def __init__(self):
        self.topology = get_topology("ring", 4)
        self.calls = []

    def mix(self, ys, step, rule="metropolis", theta=None, cfg=None, loss=None, *, out=None,
            state=0):  # fmt: skip
        self.calls.append({"rule": rule, "theta": theta, "cfg": cfg, "loss": loss, "state": state})
        return ys, {"weights": [torch.full((2,), 0.25) for _ in ys]}


class Counting:
    """A local optimizer of one's own that implements the protocol: SGD plus a counter it
    shares with the neighbours."""

    has_shared_state = True

    def __init__(self, params):
        self.sgd = torch.optim.SGD(params, lr=0.1)
        self.count = torch.zeros(())
        self.joined = 0

    @property
    def param_groups(self):
        return self.sgd.param_groups

    def step(self, closure=None):
        self.count += 1
        return self.sgd.step(closure)

    def zero_grad(self, set_to_none=True):
        self.sgd.zero_grad(set_to_none)

    def state_dict(self):
        return self.sgd.state_dict()

    def load_state_dict(self, state_dict):
        self.sgd.load_state_dict(state_dict)

    def shared_state(self):
        return [self.count]

    def mixing_net(self):
        return None

    def mixing_theta(self, device):
        raise AssertionError("no network")

    def join_gossip(self):
        self.joined += 1


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def _grads(params):
    for p in params:
        p.grad = torch.full_like(p, 0.3)


def test_learned_optimizer_knows_nothing_of_gossip():
    opt = LearnedOptimizer(_params())
    for name in ("gossip", "use_gossip", "gossip_net", "shared_state", "last_loss"):
        assert not hasattr(opt, name)
    with pytest.raises(TypeError):
        opt.step(loss=1.0)  # the batch loss goes to the gossip wrapper, not here
    assert not isinstance(opt, GossipLocal)


def test_gossip_local_adapts_each_kind_of_optimizer():
    params = _params()
    sgd, learned, own = (
        torch.optim.SGD(params, lr=0.1),
        LearnedOptimizer(params, net=LearnedOptimizerNet(ADAPT, MIXING)),
        Counting(params),
    )
    assert type(gossip_local(sgd)) is TorchLocal
    assert type(gossip_local(learned)) is LearnedLocal
    assert gossip_local(own) is own  # an implementation of the protocol is used as it is
    for local in (gossip_local(sgd), gossip_local(learned), own):
        assert isinstance(local, GossipLocal)
        assert local.param_groups is local.param_groups  # the optimizer's own
    plain = gossip_local(sgd)
    assert not plain.has_shared_state and plain.shared_state() == []
    assert plain.mixing_net() is None
    plain.join_gossip()  # changes nothing
    assert gossip_local(learned).mixing_net() is learned.net


def test_step_returns_the_batch_loss_and_the_wrapper_mixes_with_it():
    params = _params()
    comm = Recorder()
    opt = GossipOptimizer(torch.optim.SGD(params, lr=0.1), communicator=comm, metrics_every=0)
    _grads(params)
    assert float(opt.step(lambda: torch.tensor(2.5))) == 2.5
    assert float(comm.calls[-1]["loss"]) == 2.5  # the closure's loss, for the mixing
    opt.step(loss=torch.tensor(1.5))
    assert float(comm.calls[-1]["loss"]) == 1.5


def test_joining_sets_the_gossip_bounds_through_a_generic_hook():
    params = _params()
    opt = LearnedOptimizer(params, net=LearnedOptimizerNet(ADAPT, MIXING))
    twin = LearnedOptimizer(
        [p.detach().clone().requires_grad_() for p in params], net=copy.deepcopy(opt.net)
    )
    twin.net.config = MIXING.under_gossip(ADAPT)  # what the step should run with
    assert opt.config_transform is None
    gossip_local(opt).join_gossip()
    assert opt.config_transform(opt.config) == MIXING.under_gossip(ADAPT) != ADAPT
    others = [p for g in twin.param_groups for p in g["params"]]
    for _ in range(3):
        _grads(params)
        _grads(others)
        opt.step()
        twin.step()
    for p, q in zip(params, others):
        assert torch.equal(p, q)
    for make_copy in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        copied = make_copy(opt)
        assert copied.config_transform(copied.config) == MIXING.under_gossip(ADAPT)


def test_a_protocol_of_ones_own_is_joined_once_and_its_state_mixed():
    params = _params()
    own, comm = Counting(params), Recorder()
    opt = GossipOptimizer(own, communicator=comm, share_state_every=1, metrics_every=0)
    assert own.joined == 1 and opt.share_state and opt.mixing == "metropolis"
    _grads(params)
    opt.step()
    assert comm.calls[-1]["state"] == 1 and float(own.count) == 1


def test_one_rule_alone_and_under_gossip_silently():
    params = _params()
    fresh = LearnedOptimizer(params)
    net, card = fresh.net, fresh.card
    assert fresh.checkpoint_path.stem == DEFAULT_CHECKPOINT
    local = gossip_local(fresh)
    assert local.mixing_net() is net  # the edge head of the optimizer's own network
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to announce: the rule is the same
        local.join_gossip()
        gossip_local(fresh).join_gossip()  # wrapped again: the same
    assert fresh.net is net and fresh.card == card == load_checkpoint(DEFAULT_CHECKPOINT)[1]
    assert fresh.config_transform == net.mixing.under_gossip
    # under gossip the adapted step sizes keep gossip's own bounds
    bounded = fresh.config_transform(net.config)
    assert bounded.lr_adapt_max == net.mixing.lr_adapt_max_gossip < net.config.lr_adapt_max


def test_pickles_of_earlier_versions_keep_their_settings():
    opt = LearnedOptimizer(_params())
    state = opt.__getstate__()
    del state["config_transform"]
    state.update(gossip=True, shipped_default=True, checkpoint_by_default=True,
                 last_loss=torch.tensor(1.0))  # fmt: skip
    old = LearnedOptimizer.__new__(LearnedOptimizer)
    old.__setstate__(state)
    assert old.config_transform == old.net.mixing.under_gossip
    for stale in ("gossip", "last_loss", "shipped_default", "checkpoint_by_default"):
        assert not hasattr(old, stale)
    # pickled before MixingConfig: the transform was NetConfig.under_gossip, by name
    opt.config_transform = NetConfig.under_gossip
    moved = pickle.loads(pickle.dumps(opt))
    assert moved.config_transform == moved.net.mixing.under_gossip
    assert moved.config_transform(moved.config).lr_adapt_max == moved.net.mixing.lr_adapt_max_gossip
    with pytest.raises(TypeError, match="MixingConfig.under_gossip"):
        NetConfig().under_gossip()  # the old call names the new one
