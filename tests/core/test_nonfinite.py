"""A NaN or Inf in a gradient never reaches a parameter or the optimizer state."""

from __future__ import annotations

import pytest
import torch
from optim_table import fixed_grads, make_params, perturbed_net

from learned_opt import LearnedOptimizer
from learned_opt.features import init_state
from learned_opt.flat import tensor_step


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_bad_gradient_skips_only_that_tensor(bad):
    params = make_params()
    opt = LearnedOptimizer(params, net=perturbed_net())
    fixed_grads(params, 0)
    opt.step()  # a normal step first, so the state is non-trivial
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items() if torch.is_tensor(v)}

    fixed_grads(params, 1)
    params[0].grad[1, 2] = bad
    opt.step()

    assert torch.equal(params[0], before[0])
    for key, value in state_before.items():
        assert torch.equal(opt.state[params[0]][key], value), key
    for p, b in zip(params[1:], before[1:]):
        assert not torch.equal(p, b)
        assert opt.state[p]["nonfinite_skips"] == 0
    assert opt.state[params[0]]["nonfinite_skips"] == 1
    assert opt.nonfinite_skips == 1

    fixed_grads(params, 2)
    opt.step()  # recovers on the next finite gradient
    assert not torch.equal(params[0], before[0])
    assert opt.nonfinite_skips == 1


def test_bad_gradient_on_first_step_leaves_zero_state():
    params = make_params()
    opt = LearnedOptimizer(params)
    fixed_grads(params, 0)
    params[1].grad[0] = float("nan")
    before = params[1].detach().clone()
    opt.step()
    assert torch.equal(params[1], before)
    assert not opt.state[params[1]]["m"].any() and not opt.state[params[1]]["v"].any()


def test_pure_path_keeps_everything_on_bad_gradient():
    net = perturbed_net()
    theta = {k: v.detach() for k, v in net.named_parameters()}
    p = torch.randn(4, 3)
    s = init_state(p)
    s["m"].normal_()
    s["v"].uniform_()
    g = torch.randn(4, 3)
    g[2, 1] = float("inf")
    new_p, new_m, new_v = tensor_step(theta, net.config, p, g, s["m"], s["v"], 2, 1.0)
    assert torch.equal(new_p, p) and torch.equal(new_m, s["m"]) and torch.equal(new_v, s["v"])
