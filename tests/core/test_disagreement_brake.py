"""The disagreement brake under gossip (``NetConfig.lr_adapt_max_pull``): the formula, its
flat (meta-training) and in-place (``LearnedOptimizer``) forms against each other, and the
gossip wrapper and the simulator applying it after every mix."""

from __future__ import annotations

import math

import pytest
import torch

from learned_opt import LearnedOptimizer, LearnedOptimizerNet, NetConfig
from learned_opt.distributed import GossipOptimizer
from learned_opt.features import PULL_RMS_FLOOR, brake_on_disagreement
from learned_opt.flat import flat_brake_on_disagreement
from learned_opt.segments import FlatLayout

TARGET = 0.1
BRAKE = NetConfig(output="ortho", ortho_min_dim=16, lr_adapt_rate=0.3, lr_adapt_max_gossip=7.0,
                  lr_adapt_max_pull=TARGET)  # fmt: skip


def _brake(relative_pull: float, log_lr: float = 1.0, p_ms: float = 1.0, cfg=BRAKE) -> float:
    """The new log multiplier of a 100-element tensor of mean square ``p_ms`` that a mix
    moved by ``relative_pull`` times its norm."""
    n = torch.tensor(100.0)
    p_sq = n * p_ms
    pull_sq = p_sq * relative_pull**2
    return float(brake_on_disagreement(torch.tensor(log_lr), pull_sq, p_sq, n, cfg))


def test_below_the_target_nothing_changes():
    assert _brake(0.0) == 1.0
    assert _brake(TARGET * 0.99) == 1.0


def test_above_the_target_the_step_size_shrinks_with_the_log_excess():
    rate = BRAKE.lr_adapt_rate
    assert _brake(TARGET * math.e) == pytest.approx(1.0 - rate, rel=1e-5)
    assert _brake(TARGET * math.e**0.5) == pytest.approx(1.0 - rate / 2, rel=1e-5)
    assert _brake(TARGET * 1e6) == pytest.approx(1.0 - 2 * rate, rel=1e-5)  # at most 2x
    assert _brake(TARGET * 1e6, log_lr=BRAKE.lr_adapt_min) == BRAKE.lr_adapt_min  # floor


def test_a_tiny_tensor_is_measured_against_the_rms_floor():
    # a zero-initialised bias: its norm is 0, and the floor stands in for it
    pull = 0.5 * TARGET * PULL_RMS_FLOOR  # half the target relative to the floor
    assert _brake(0.0, p_ms=0.0) == 1.0
    n = torch.tensor(100.0)
    got = brake_on_disagreement(torch.tensor(1.0), n * pull**2, torch.tensor(0.0), n, BRAKE)
    assert float(got) == 1.0
    got = brake_on_disagreement(torch.tensor(1.0), n * (10 * pull) ** 2, torch.tensor(0.0), n,
                                BRAKE)  # fmt: skip
    assert float(got) < 1.0


def test_nonfinite_sums_leave_the_step_size_alone():
    n = torch.tensor(10.0)
    for bad in (float("nan"), float("inf")):
        got = brake_on_disagreement(torch.tensor(0.5), torch.tensor(bad), n, n, BRAKE)
        assert float(got) == 0.5


def test_off_without_a_target_or_without_adaptation():
    plain = NetConfig(lr_adapt_rate=0.3)
    assert not plain.brakes_on_disagreement
    assert _brake(100.0, cfg=plain) == 1.0
    fixed = NetConfig(lr_adapt_max_pull=0.1)  # no step-size adaptation: nothing to brake
    assert not fixed.brakes_on_disagreement
    assert _brake(100.0, cfg=fixed) == 1.0


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_bad_targets_are_refused(value):
    with pytest.raises(ValueError, match="lr_adapt_max_pull"):
        NetConfig(lr_adapt_rate=0.3, lr_adapt_max_pull=value)


def test_old_checkpoints_load_without_the_brake():
    old = BRAKE.to_dict()
    del old["lr_adapt_max_pull"]  # written before the field existed
    assert NetConfig.from_dict(old).lr_adapt_max_pull == 0.0


def _mixed_pair(shapes, gen):
    before = [torch.randn(s, generator=gen) for s in shapes]
    scale = (0.01, 0.3, 3.0)  # pulls below, above and far above the target
    after = [b + k * b.abs().mean() * torch.randn(s, generator=gen)
             for b, s, k in zip(before, shapes, scale)]  # fmt: skip
    return before, after


def test_flat_and_in_place_forms_agree():
    shapes = [(20, 16), (16,), (4, 3)]
    gen = torch.Generator().manual_seed(0)
    before, after = _mixed_pair(shapes, gen)
    log_lr = torch.tensor([1.5, 0.5, -1.0])
    layout = FlatLayout(("a", "b", "c"), tuple(shapes))
    flat = flat_brake_on_disagreement(
        BRAKE, layout, torch.cat([b.reshape(-1) for b in before])[None],
        torch.cat([a.reshape(-1) for a in after])[None], log_lr[None],
    )[0]  # fmt: skip
    params = [torch.nn.Parameter(a.clone()) for a in after]
    opt = LearnedOptimizer(params, net=LearnedOptimizerNet(BRAKE))
    opt.gossip = True
    for p, value in zip(params, log_lr):
        opt.state[p]["log_lr"] = value.clone()
    opt.brake_on_disagreement(params, before)
    got = torch.stack([opt.state[p]["log_lr"] for p in params])
    torch.testing.assert_close(got, flat)
    assert got[0] == log_lr[0] and got[1] < log_lr[1] and got[2] < log_lr[2]


def test_in_place_form_only_under_gossip_and_with_state():
    p = torch.nn.Parameter(torch.ones(8))
    opt = LearnedOptimizer([p], net=LearnedOptimizerNet(BRAKE))
    assert not opt.brakes_on_disagreement  # not under gossip yet
    opt.brake_on_disagreement([p], [torch.zeros(8)])
    assert len(opt.state) == 0  # nothing was created
    opt.gossip = True
    assert opt.brakes_on_disagreement
    opt.brake_on_disagreement([p], [torch.zeros(8)])  # no state yet: left alone
    assert len(opt.state) == 0


class _TowardsTarget:
    """A one-rank stand-in for a communicator: the "mix" pulls every tensor halfway to a
    fixed far-away point, as a neighbour that disagrees strongly would."""

    topology = None
    rank = 0

    def __init__(self, targets):
        self.targets = targets

    def mix(self, ys, step, rule, theta, cfg, loss, out):
        for y, t in zip(out, self.targets):
            y.lerp_(t, 0.5)
        return out, {"weights": []}

    def consensus_distance(self, ys, step):
        return 0.0


def _run_gossip(cfg: NetConfig, steps: int = 6) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(20, 16, generator=gen)),
              torch.nn.Parameter(torch.randn(16, generator=gen))]  # fmt: skip
    far = [10 * torch.randn(p.shape, generator=gen) for p in params]
    local = LearnedOptimizer(params, net=LearnedOptimizerNet(cfg))
    opt = GossipOptimizer(local, mixing="metropolis", communicator=_TowardsTarget(far))
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)  # a consistent slope: the step size grows alone
        opt.step()
    return [float(local.state[p]["log_lr"]) for p in params]


def test_gossip_optimizer_brakes_after_every_mix():
    free = _run_gossip(NetConfig(**{**BRAKE.to_dict(), "lr_adapt_max_pull": 0.0,
                                    "time_taus": BRAKE.time_taus}))  # fmt: skip
    braked = _run_gossip(BRAKE)
    assert all(f > 0 for f in free)  # without the brake the step sizes grew
    # the brake outweighed the growth for at least three steps' worth of it
    assert all(b < f - 3 * BRAKE.lr_adapt_rate for b, f in zip(braked, free))


def test_simulated_workers_brake_as_the_gossip_optimizer_does():
    from learned_opt.meta_train.inner import inner_step, make_inner_optimizer, new_trajectory
    from learned_opt.tasks import get_task

    task = get_task("digits_mlp")
    ends = {}
    for pull in (0.0, 0.01):
        cfg = NetConfig(**{**BRAKE.to_dict(), "lr_adapt_max_pull": pull,
                           "time_taus": BRAKE.time_taus})  # fmt: skip
        opt = make_inner_optimizer("learned", net=LearnedOptimizerNet(cfg), mixing="metropolis")
        traj = new_trajectory(task, 4, "ring", "dirichlet", 0.1, 0, 20)
        for _ in range(20):
            inner_step(traj, opt)
        ends[pull] = traj.states["log_lr"]
    assert bool((ends[0.01] <= ends[0.0]).all()) and bool((ends[0.01] < ends[0.0]).any())
