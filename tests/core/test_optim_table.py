"""Every optimizer in the table passes every generic check; every check catches a bug."""

from __future__ import annotations

import pytest
import torch
from optim_table import GENERIC_CHECKS, MUTANTS, OPTIMIZERS, make_params, perturbed_net, train

from learned_opt import LearnedOptimizer


@pytest.mark.parametrize("check", GENERIC_CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
def test_generic_check(info, check):
    check(info)


@pytest.mark.parametrize(
    "check, broken", MUTANTS, ids=[f"{c.__name__}-{m.name}" for c, m in MUTANTS]
)
def test_check_catches_its_bug(check, broken):
    with pytest.raises(AssertionError):
        check(broken)


def _adam_vs_learned(net=None, steps: int = 10) -> float:
    """Largest difference between LearnedOptimizer and torch Adam(lr=1e-3) over ``steps``."""
    a, b = make_params(), make_params()
    learned = (
        LearnedOptimizer(a, checkpoint="adam_init") if net is None else LearnedOptimizer(a, net=net)
    )
    adam = torch.optim.Adam(b, lr=1e-3)
    train(learned, a, steps)
    train(adam, b, steps)
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b))


def test_hand_initialised_checkpoint_is_adam():
    """The shipped hand-initialised checkpoint is exactly Adam(lr=1e-3), up to rounding."""
    assert _adam_vs_learned() < 1e-7


def test_is_adam_check_can_fail():
    """A perturbed network is not Adam: the same comparison notices."""
    assert _adam_vs_learned(perturbed_net()) > 1e-5
