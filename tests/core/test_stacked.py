"""Large tensors of one shape stepped together, stacked (the default on accelerators)."""

from __future__ import annotations

import pytest
import torch
from optim_table import perturbed_net

from learned_opt import LearnedOptimizer
from learned_opt._stacked import stacked_step_
from learned_opt.features import init_state
from learned_opt.flat import tensor_step
from learned_opt.functional import stacks


def _shapes():
    # repeated shapes (as in a transformer's layers), a singleton, an empty tensor
    return [(40, 30), (30, 40), (40, 30), (40, 30), (700,), (0, 5), (30, 40)]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in _shapes():
        p = 0.1 * torch.randn(shape, generator=gen)
        params.append(torch.nn.Parameter(p.to(dtype)))
    params[2] = torch.nn.Parameter(params[2].detach().t().contiguous().t())  # non-contiguous
    return params


def test_stacked_step_equals_the_pure_step_per_tensor():
    net = perturbed_net(8)
    theta, cfg = net.theta(), net.config
    gen = torch.Generator().manual_seed(1)
    params = [0.1 * torch.randn(6, 5, generator=gen) for _ in range(3)]
    grads = [torch.randn(6, 5, generator=gen) for _ in range(3)]
    grads[1][2, 3] = float("nan")
    states = [init_state(p) for p in params]
    expected = [
        tensor_step(theta, cfg, p, g, s["m"], s["v"], 3, 0.5)
        for p, g, s in zip(params, grads, states)
    ]
    before = [p.clone() for p in params]
    flags = stacked_step_(theta, cfg, params, grads, states, 3, 0.5)
    assert flags.tolist() == [True, False, True]
    assert torch.equal(params[1], before[1]) and not states[1]["v"].any()
    for i in (0, 2):
        new_p, new_m, new_v = expected[i]
        torch.testing.assert_close(params[i], new_p, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(states[i]["m"], new_m, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(states[i]["v"], new_v, rtol=1e-5, atol=1e-10)


def test_stacked_step_rejects_mixed_shapes():
    net = perturbed_net(8)
    params = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match="one shape"):
        stacked_step_(net.theta(), net.config, params, params, [init_state(p) for p in params], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_stacked_path_matches_chunked_path(dtype):
    runs = {}
    for stack in (False, True):
        params = _params(dtype)
        opt = LearnedOptimizer(
            params, net=perturbed_net(8), small_tensor_size=0, stack_same_shape=stack
        )
        gen = torch.Generator().manual_seed(2)
        for k in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            if k == 1:
                params[3].grad[0, 0] = float("inf")
            opt.step()
        runs[stack] = (params, opt)
    (chunked, a), (stacked, b) = runs[False], runs[True]
    assert a.nonfinite_skips == b.nonfinite_skips == 1
    for x, y in zip(chunked, stacked):
        if dtype == torch.bfloat16:  # both round the same float32 value; allow one ulp
            torch.testing.assert_close(x, y, rtol=1e-2, atol=1e-3)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a.state[x]["m"], b.state[y]["m"], rtol=1e-5, atol=1e-6)


def test_stacks_group_by_shape_under_the_cap():
    items = [(torch.empty(s), None, None) for s in [(4, 5), (4, 5), (4, 5), (5, 4), (30,), (0,)]]
    groups, rest = stacks(items, cap=40)
    shapes = sorted([tuple(it[0].shape) for it in s] for s in groups)
    assert shapes == [[(4, 5)], [(4, 5), (4, 5)], [(5, 4)], [(30,)]]
    assert [tuple(it[0].shape) for it in rest] == [(0,)]
    groups, rest = stacks(items, cap=25)
    assert [tuple(it[0].shape) for it in rest] == [(30,), (0,)]
