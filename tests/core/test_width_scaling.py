"""Width scaling of the Adam form for wide matrices (``NetConfig.adam_max_width``): which
tensors it scales, by how much, and the refusal of bad settings. That every layout steps
like the differentiable path with it is checked in ``test_lr_adapt.py``."""

from __future__ import annotations

import math

import pytest
import torch

from learned_opt import LearnedOptimizer, LearnedOptimizerNet, NetConfig
from learned_opt.features import width_log_factor

WIDE = NetConfig(output="ortho", ortho_min_dim=16, ortho_max_dim=64, adam_max_width=48)


@pytest.mark.parametrize(
    "shape, factor",
    [
        ((96, 96), 48 / 96),  # a wide matrix on the Adam form
        ((200, 96), 48 / 96),  # the smaller dimension sets the width
        ((96, 48), 1.0),  # not wider than adam_max_width
        ((64, 32), 1.0),  # orthogonalised: its step is already width-free
        ((96, 1), 1.0),  # a thin head
        ((500,), 1.0),  # a vector
        ((96, 96, 3, 3), 1.0),  # a convolution kernel
        ((), 1.0),
    ],
)
def test_only_wide_adam_form_matrices_are_scaled(shape, factor):
    assert math.exp(width_log_factor(shape, WIDE)) == pytest.approx(factor)


def test_off_by_default_and_for_old_configs():
    assert NetConfig().adam_max_width == 0
    assert width_log_factor((4096, 4096), NetConfig()) == 0.0
    assert NetConfig.from_dict({"output": "ortho"}).adam_max_width == 0  # a card without it


def _first_steps(cfg: NetConfig, shapes, lr: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in shapes]
    start = [p.detach().clone() for p in params]
    opt = LearnedOptimizer(params, net=LearnedOptimizerNet(cfg), lr=lr)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) + 0.5
        opt.step()
    return [p.detach() - s for p, s in zip(params, start)]


@pytest.mark.parametrize("lr", [1.0, 3.0])
def test_a_wide_matrix_steps_at_its_factor_and_the_rest_as_before(lr):
    shapes = [(96, 96), (64, 32), (96,), (8, 4, 3, 3)]
    plain = _first_steps(NetConfig(output="ortho", ortho_min_dim=16, ortho_max_dim=64), shapes, lr)
    wide = _first_steps(WIDE, shapes, lr)
    # the differences of float32 parameters near 0.1 carry rounding of about 1e-8
    torch.testing.assert_close(wide[0], plain[0] * (48 / 96), rtol=1e-4, atol=1e-7)
    for a, b in zip(wide[1:], plain[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256"])
def test_bad_width_is_refused(bad):
    with pytest.raises(ValueError, match="adam_max_width"):
        NetConfig(adam_max_width=bad)
