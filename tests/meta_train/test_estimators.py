"""Meta-gradient estimators against finite differences on a one-parameter inner problem."""

from __future__ import annotations

import math

import torch

from learned_opt.config import NetConfig
from learned_opt.meta_train.estimators import PES, TBPTT, truncation_meta_loss, unroll
from learned_opt.meta_train.inner import make_inner_optimizer, new_trajectory
from learned_opt.network import LearnedOptimizerNet

STEPS = 6


def _net():
    torch.manual_seed(0)
    net = LearnedOptimizerNet(NetConfig(width=8)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return net


def _meta_loss(net, task, theta=None):
    traj = new_trajectory(task, 1, "ring", "iid", 1.0, 0, 100)
    opt = make_inner_optimizer("learned", lr=30.0, net=net)
    if theta is not None:
        opt.theta = theta
    return unroll(traj, opt, STEPS, loss_clip=4.0)


def _flat(grads):
    return torch.cat([g.reshape(-1) for g in grads])


def _exact_and_fd(net, task):
    est = TBPTT(second_order=True)
    traj = new_trajectory(task, 1, "ring", "iid", 1.0, 0, 100)
    opt = make_inner_optimizer("learned", lr=30.0, net=net)
    _, grads = est.estimate(net, opt, [[traj]], STEPS)
    exact = _flat(grads)
    names = [n for n, _ in net.named_parameters()]
    base = {n: p.detach() for n, p in net.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    directional = []
    for _ in range(4):
        u = {n: torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in base.items()}
        h = 1e-5
        with torch.no_grad():
            lp = _meta_loss(net, task, {n: base[n] + h * u[n] for n in names})
            lm = _meta_loss(net, task, {n: base[n] - h * u[n] for n in names})
        directional.append(
            (float((lp - lm) / (2 * h)), float(exact @ _flat([u[n] for n in names])))
        )
    return exact, directional


def test_meta_loss_is_log_of_mean_ratio_with_floor_and_clip():
    losses = [torch.tensor([2.0, 0.0]), torch.tensor([float("nan"), 1.0])]
    value = truncation_meta_loss(losses, loss0=2.0, loss_clip=4.0)
    expected = math.log((1.0 + 0.0 + 4.0 + 0.5) / 4 + 1e-6)
    assert abs(float(value) - expected) < 1e-6
    zero = truncation_meta_loss([torch.zeros(3)], loss0=1.0, loss_clip=4.0)
    assert torch.isfinite(zero) and abs(float(zero) - math.log(1e-6)) < 1e-5


def test_tbptt_second_order_matches_finite_differences(one_param_task):
    exact, directional = _exact_and_fd(_net(), one_param_task)
    assert exact.abs().sum() > 0
    for fd, analytic in directional:
        assert abs(fd - analytic) <= 1e-4 + 1e-3 * abs(fd), (fd, analytic)


def test_first_order_tbptt_and_pes_point_the_same_way(one_param_task):
    net = _net()
    exact, _ = _exact_and_fd(net, one_param_task)

    traj = new_trajectory(one_param_task, 1, "ring", "iid", 1.0, 0, 100)
    opt = make_inner_optimizer("learned", lr=30.0, net=net)
    _, g1 = TBPTT().estimate(net, opt, [[traj]], STEPS)
    first = _flat(g1)
    cos = float(first @ exact / (first.norm() * exact.norm()))
    assert cos > 0.8, cos

    pes = PES(pes_sigma=1e-3, pes_pairs=200)
    traj = new_trajectory(one_param_task, 1, "ring", "iid", 1.0, 0, 100)
    _, g2 = pes.estimate(net, opt, [pes.particles(traj)], STEPS)
    est = _flat(g2)
    cos = float(est @ exact / (est.norm() * exact.norm()))
    assert cos > 0.3, cos
