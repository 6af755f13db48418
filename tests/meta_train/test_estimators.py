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


def test_one_worker_gradients_equal_the_vmapped_transform():
    # A single worker's gradient is taken by plain autograd (inner._one_worker_grad), not
    # vmap(grad_and_value): same values, and the same derivatives through the parameters
    # (the loss always; the gradient too with second_order), tracked or not.
    from torch.func import grad_and_value, vmap

    from learned_opt.meta_train.inner import _one_worker_grad

    torch.manual_seed(0)
    w, x, y = torch.randn(5, 3, dtype=torch.double), torch.randn(1, 7, 5), torch.randn(1, 7, 3)

    def loss_fn(flat, b):
        return torch.tanh(b[0].double() @ flat.view(5, 3)).sub(b[1]).square().mean()

    batch = (x, y)
    for second_order in (False, True):
        theta = torch.tensor(0.7, dtype=torch.double, requires_grad=True)
        params = (theta * w).reshape(1, -1)
        g_ref, l_ref = vmap(grad_and_value(loss_fn))(params, batch)
        g, loss = _one_worker_grad(loss_fn, params, batch, second_order)
        assert torch.allclose(g, g_ref) and torch.allclose(loss, l_ref)
        (d_ref,) = torch.autograd.grad(l_ref.sum(), theta, retain_graph=True)
        (d,) = torch.autograd.grad(loss.sum(), theta, retain_graph=True)
        assert torch.allclose(d, d_ref)
        if second_order:
            (h_ref,) = torch.autograd.grad(g_ref.sum(), theta, retain_graph=True)
            (h,) = torch.autograd.grad(g.sum(), theta)
            assert torch.allclose(h, h_ref)
        else:
            assert not g.requires_grad
    with torch.no_grad():  # untracked (PES): no graph is kept
        g, loss = _one_worker_grad(loss_fn, w.reshape(1, -1), batch, False)
    g_ref, l_ref = vmap(grad_and_value(loss_fn))(w.reshape(1, -1), batch)
    assert torch.allclose(g, g_ref) and torch.allclose(loss, l_ref)
    assert not g.requires_grad and not loss.requires_grad
    g, loss = _one_worker_grad(lambda flat, b: b[1].sum(), w.reshape(1, -1), batch, False)
    assert torch.equal(g, torch.zeros(1, 15, dtype=torch.double)) and float(loss) == float(y.sum())
