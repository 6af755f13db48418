"""Small tensors stepped together (``packed_step_``) equal one chunked call per tensor."""

from __future__ import annotations

import pytest
import torch
from optim_table import perturbed_net
from torch import nn

from learned_opt import LearnedOptimizer
from learned_opt.segments import FlatLayout, segment_sum


def _params(seed: int = 0) -> list[nn.Parameter]:
    """Mixed sizes, dtypes and layouts in one group: some batched, some chunked."""
    gen = torch.Generator().manual_seed(seed)
    specs = [
        ((7, 5), torch.float32),
        ((5,), torch.float32),
        ((), torch.float32),
        ((30, 40), torch.float32),  # above the threshold used below: chunked
        ((6, 4), torch.bfloat16),
        ((3, 4), torch.float64),
        ((2, 3), torch.float64),
    ]
    params = [nn.Parameter((0.02 * torch.randn(s, generator=gen)).to(d)) for s, d in specs]
    with torch.no_grad():  # a non-contiguous parameter
        params[0].data = params[0].data.t().contiguous().t()
    assert not params[0].is_contiguous()
    return params


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize("width", [8, 32])
def test_batched_small_tensors_equal_per_tensor_calls(width):
    net = perturbed_net(width, seed=width)
    a, b = _params(), _params()
    batched = LearnedOptimizer(a, net=net, small_tensor_size=500, lr=0.7)
    single = LearnedOptimizer(b, net=net, small_tensor_size=0, lr=0.7, chunk_size=16)
    for step in range(4):
        _grads(a, step)
        _grads(b, step)
        batched.step()
        single.step()
    for x, y in zip(a, b):
        tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(x, y, rtol=tol, atol=1e-7)
        for key, atol in (("m", 1e-6), ("v", 1e-7)):  # as in test_core_paths
            torch.testing.assert_close(
                batched.state[x][key], single.state[y][key], rtol=1e-5, atol=atol
            )


def test_batched_bad_gradient_skips_only_that_tensor():
    params = _params()
    opt = LearnedOptimizer(params, net=perturbed_net(), small_tensor_size=500)
    _grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in opt.state[params[1]].items() if torch.is_tensor(v)}
    _grads(params, 1)
    params[1].grad[2] = float("nan")
    opt.step()
    assert torch.equal(params[1], before[1])
    for key, value in state_before.items():
        assert torch.equal(opt.state[params[1]][key], value), key
    changed = [not torch.equal(p, q) for p, q in zip(params, before)]
    assert changed == [True, False, True, True, True, True, True]
    assert [opt.state[p]["nonfinite_skips"] for p in params] == [0, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("bad", [-1, 1.5, "8"])
def test_small_tensor_size_is_validated(bad):
    with pytest.raises(ValueError, match="small_tensor_size"):
        LearnedOptimizer([nn.Parameter(torch.zeros(3))], small_tensor_size=bad)


@pytest.mark.parametrize("method", ["index_add", "padded", "blocked"])
@pytest.mark.parametrize("big", [False, True])
def test_segment_sum_methods_agree_and_differentiate(method, big):
    # one long segment (several sum blocks) among short and empty ones, or only short ones
    shapes = ((3, 4), (5,), (), (2, 2, 2), (0, 3)) + (((1500, 2),) if big else ())
    layout = FlatLayout(tuple(map(str, range(len(shapes)))), shapes)
    x = torch.randn(2, 3, layout.size, dtype=torch.float64, requires_grad=True)
    expected = torch.stack([t.sum(-1) for t in x.split(layout.numels, dim=-1)], dim=-1)
    got = segment_sum(x, layout, method)
    torch.testing.assert_close(got, expected)
    if not big:  # gradcheck is slow on the long layout; the sums above cover it
        assert torch.autograd.gradcheck(lambda t: segment_sum(t, layout, method), (x,))


def test_segment_sum_rejects_unknown_method():
    layout = FlatLayout(("a",), ((3,),))
    with pytest.raises(ValueError, match="unknown segment_sum method"):
        segment_sum(torch.ones(3), layout, "atomic")
