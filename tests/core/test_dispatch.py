"""``learned_step`` hands each tensor to the layout its device and size call for."""

from __future__ import annotations

import pytest
import torch
from optim_table import perturbed_net, spy_layouts

from learned_opt import functional
from learned_opt.features import init_state


def _step(**kwargs):
    net = perturbed_net()
    shapes = [(64, 32), (64, 32), (32, 64), (5,), (3, 2)]
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    states = [init_state(p) for p in params]
    return functional.learned_step(net.theta(), net.config, params, grads, states, 1, **kwargs)


def test_cpu_default_packs_small_tensors_and_chunks_the_rest(monkeypatch):
    seen = spy_layouts(monkeypatch)
    assert _step(small_tensor_size=100) == [True] * 5
    assert seen == {
        "packed": [[(3, 2), (5,)]],
        "stacked": [],
        "chunked": [[(32, 64), (64, 32), (64, 32)]],
    }


def test_stack_same_shape_stacks_tensors_of_one_shape(monkeypatch):
    seen = spy_layouts(monkeypatch)
    assert _step(small_tensor_size=0, stack_same_shape=True) == [True] * 5
    assert sorted(seen["stacked"]) == [[(3, 2)], [(5,)], [(32, 64)], [(64, 32), (64, 32)]]
    assert seen["packed"] == seen["chunked"] == []


def test_mismatched_lists_are_refused():
    net = perturbed_net()
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="one gradient and one state per parameter"):
        functional.learned_step(net.theta(), net.config, p, [], [init_state(p[0])], 1)
