"""learned_opt.wsd_schedule: held, then linear to zero over the last half."""

import pickle

import pytest
import torch

from learned_opt import LearnedOptimizer, wsd_schedule


def _multipliers(total, steps, **kw):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = LearnedOptimizer([p], lr=2.0, compile=False)
    sched = wsd_schedule(opt, total, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradient: nothing moves, but the scheduler sees a step taken
        sched.step()
    return out, sched


def test_holds_then_decays_linearly_to_zero_at_the_end():
    lrs, _ = _multipliers(10, 12)
    # the user's multiplier until the last half (5 of 10 steps), then a straight line
    # that reaches 0 at step 10, and 0 after it
    assert lrs == pytest.approx([2.0] * 6 + [1.6, 1.2, 0.8, 0.4, 0.0, 0.0])


def test_decay_fraction_sets_where_the_decay_starts():
    lrs, _ = _multipliers(10, 10, decay_fraction=0.2)
    assert lrs[:9] == [2.0] * 9 and lrs[9:] == pytest.approx([1.0])


def test_its_state_dict_resumes_the_same_schedule():
    _, sched = _multipliers(10, 9)
    state = pickle.loads(pickle.dumps(sched.state_dict()))
    assert state["lr_lambdas"][0] == {"total_steps": 10, "decay": 5.0}


@pytest.mark.parametrize(
    "total, fraction", [(0, 0.2), (2.5, 0.2), (True, 0.2), (10, 0.0), (10, 1.5)]
)
def test_bad_arguments_raise_one_line(total, fraction):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="must be"):
        wsd_schedule(torch.optim.SGD([p], lr=1.0), total, fraction)
