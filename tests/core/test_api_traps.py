"""Habits from ``torch.optim`` that must fail at once with one line, changing nothing:
a positional learning rate, and a state dict of another optimizer or other parameters."""

from __future__ import annotations

import pytest
import torch
from optim_table import fixed_grads, make_params, perturbed_net

from learned_opt import LearnedOptimizer


@pytest.mark.parametrize("second", [1e-3, "adapt_init_2x"])
def test_positional_second_argument_is_refused_in_one_line(second):
    with pytest.raises(TypeError) as info:
        LearnedOptimizer(make_params(), second)
    message = str(info.value)
    assert "\n" not in message
    assert "keyword-only" in message and "multiplier of the learned step (default 1.0" in message
    assert "checkpoint='name or path'" in message and repr(second) in message


def _stepped(params, steps: int = 2) -> LearnedOptimizer:
    opt = LearnedOptimizer(params, net=perturbed_net())
    for k in range(steps):
        fixed_grads(params, k)
        opt.step()
    return opt


def _snapshot(opt):
    return {
        id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
        for p, s in opt.state.items()
    }, [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _adam_state(params):
    adam = torch.optim.Adam(params, lr=3e-4)
    fixed_grads(params, 0)
    adam.step()
    return adam.state_dict()


def _other_shapes_state(params):
    other = [torch.nn.Parameter(torch.zeros(p.shape[0] + 1, *p.shape[1:])) for p in params]
    return _stepped(other).state_dict()


@pytest.mark.parametrize(
    "saved, fragment",
    [
        (
            _adam_state,
            "parameter 0 (shape (7, 5)): saved state has keys ['exp_avg', 'exp_avg_sq', 'step']",
        ),
        (
            lambda params: torch.optim.Adam(params, lr=3e-4).state_dict(),
            "param_groups[0] holds amsgrad, betas, eps: a state dict of another optimizer",
        ),
        (
            _other_shapes_state,
            "parameter 0 (shape (7, 5)): saved m has shape (3, 8, 5), expected (1, 7, 5) or (2, 7, 5) "
            "or (3, 7, 5)",
        ),
        (lambda params: {"state": {}}, "not an optimizer state dict"),
    ],
)
def test_foreign_or_mismatched_state_dict_is_refused_and_nothing_changes(saved, fragment):
    params = make_params()
    opt = _stepped(params)
    before_state, before_groups = _snapshot(opt)
    state_dict = saved(make_params())
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(state_dict)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    after_state, after_groups = _snapshot(opt)
    assert after_groups == before_groups
    assert before_state.keys() == after_state.keys()
    for key, tensors in before_state.items():
        assert all(torch.equal(v, after_state[key][name]) for name, v in tensors.items())


def test_own_state_dict_still_loads():
    params = make_params()
    opt = _stepped(params)
    fresh = LearnedOptimizer(params, net=perturbed_net())
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["step"] == 2
    assert all(torch.equal(fresh.state[p]["v"], opt.state[p]["v"]) for p in params)


def test_the_state_of_a_table_whose_batches_leave_rows_out_reloads_and_continues():
    """A row-sparse table (an embedding whose batches leave rows out) keeps two momenta;
    its saved state loads back (it was refused as state of other parameters) and the run
    goes on as if never saved."""
    import copy
    import io

    torch.manual_seed(0)
    emb = torch.nn.Embedding(30, 8)
    twin = copy.deepcopy(emb)
    opts = [LearnedOptimizer(m.parameters(), compile=False) for m in (emb, twin)]

    def step(k: int) -> None:
        gen = torch.Generator().manual_seed(k)
        g = torch.randn(30, 8, generator=gen)
        g[k % 2 :: 2] = 0  # half the rows absent from each batch
        for m, opt in zip((emb, twin), opts):
            m.weight.grad = g.clone()
            opt.step()

    step(0), step(1)
    assert opts[0].state[emb.weight]["m"].shape == (2, 30, 8)
    saved = io.BytesIO()
    torch.save(opts[0].state_dict(), saved)
    saved.seek(0)
    opts[0] = LearnedOptimizer(emb.parameters(), compile=False)
    opts[0].load_state_dict(torch.load(saved, weights_only=True))
    step(2), step(3)
    assert torch.equal(emb.weight, twin.weight)


@pytest.mark.parametrize(
    "build",
    [
        lambda params: LearnedOptimizer(params, lr=3e-4),
        lambda params: LearnedOptimizer([{"params": params, "lr": 1e-3}]),
        lambda params: LearnedOptimizer(params[:1]).add_param_group(
            {"params": params[1:], "lr": 1e-2}
        ),
    ],
    ids=["keyword", "group", "added group"],
)
def test_an_adam_sized_lr_warns_at_the_caller_s_line(build):
    """``lr=3e-4`` given by keyword, the habit of a script written for AdamW, makes every
    step thousands of times smaller than the rule's: one warning, at the caller's line."""
    with pytest.warns(UserWarning, match="is a multiplier of the learned step") as record:
        build(make_params())
    assert len(record) == 1 and record[0].filename == __file__
    assert "\n" not in str(record[0].message) and "x smaller" in str(record[0].message)


def test_a_multiplier_or_a_schedule_lowering_it_does_not_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = make_params()
        opt = LearnedOptimizer(params, lr=0.5)
        LearnedOptimizer(make_params())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1e-4)
        fixed_grads(params, 0)
        opt.step()
        sched.step()
        fixed_grads(params, 1)
        opt.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-4)


def test_one_cycle_runs_on_the_multiplier_once_told_not_to_cycle_momentum():
    """``OneCycleLR`` and ``CyclicLR`` also cycle a momentum by default, which the rule does
    not take from its param groups: torch refuses that at construction (one line, the
    README says what to pass), and with ``cycle_momentum=False`` the multiplier follows
    the cycle without a warning."""
    import warnings

    params = make_params()
    opt = LearnedOptimizer(params)
    with pytest.raises(ValueError, match="cycle_momentum"):
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1.0, total_steps=100, cycle_momentum=False
        )
        lrs = []
        for k in range(4):
            fixed_grads(params, k)
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    assert lrs == sorted(lrs) and 0.04 < lrs[0] < lrs[-1] <= 1.0  # warming up to max_lr
    assert all(torch.isfinite(p).all() for p in params)


def test_calling_the_network_points_to_the_step():
    """The network holds theta; the step lives in ``learned_opt.step`` (which imports the
    network, not the other way round), and a call says where."""
    with pytest.raises(TypeError, match=r"learned_opt\.step\.tensor_step"):
        perturbed_net()(torch.zeros(3), torch.zeros(3))
