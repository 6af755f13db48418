"""A NaN or Inf in a gradient never reaches a parameter or the optimizer state, and one in
a parameter never spreads over its tensor: on every layout, the tensor is skipped and
counted (``nonfinite_skips``)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from optim_table import fixed_grads, make_params, perturbed_net

from learned_opt import LearnedOptimizer
from learned_opt.features import init_state
from learned_opt.segments import FlatLayout
from learned_opt.step import flat_step, init_flat_state, tensor_step


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


def _same(a, b) -> bool:
    """Bitwise-equal values, NaN where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bad_parameter_skips_only_that_tensor_and_warns_once(bad):
    """A NaN or Inf in a parameter (finite gradient) does not spread over its tensor: the
    tensor is skipped and counted, the others step as if it were not there, and one warning
    names the parameter."""
    params, clean = make_params(), make_params()
    params.append(torch.nn.Parameter(params[0].detach().clone()))  # a twin shape to stack
    clean.append(torch.nn.Parameter(clean[0].detach().clone()))
    opt = LearnedOptimizer(params, net=perturbed_net())
    ref = LearnedOptimizer(clean[1:], net=perturbed_net())
    with torch.no_grad():
        params[0][1, 2] = bad
    before = params[0].detach().clone()
    fixed_grads(params, 0)
    fixed_grads(clean, 0)
    with pytest.warns(RuntimeWarning, match=r"parameter 0 of param group 0 \(shape \(7, 5\)\)"):
        opt.step()
    ref.step()
    assert _same(params[0], before)
    assert not opt.state[params[0]]["m"].any() and not opt.state[params[0]]["v"].any()
    assert [opt.state[p]["nonfinite_skips"] for p in params] == [1, 0, 0, 0]
    assert opt.nonfinite_skips == 1
    for p, q in zip(params[1:], clean[1:]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second skip is counted, not warned
        opt.step()
    assert opt.nonfinite_skips == 2


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")])
def test_pure_path_keeps_everything_on_bad_parameter(bad):
    net = perturbed_net()
    p = torch.randn(4, 3)
    p[0, 1] = bad
    s = init_state(p)
    s["m"].normal_()
    s["v"].uniform_()
    new_p, new_m, new_v = tensor_step(
        net.theta(), net.config, p, torch.randn(4, 3), s["m"], s["v"], 2
    )
    assert _same(new_p, p)
    assert torch.equal(new_m, s["m"]) and torch.equal(new_v, s["v"])


def test_flat_step_confines_a_bad_parameter_to_its_segment_and_theta_grad_stays_finite():
    """In meta-training a NaN parameter of one worker's tensor leaves that segment as it
    was, steps every other segment and worker, and its NaN never reaches theta's gradient."""
    net = perturbed_net()
    shapes = ((4, 3), (5,), (2, 2))
    layout = FlatLayout(tuple("abc"), shapes)
    gen = torch.Generator().manual_seed(0)
    p = 0.1 * torch.randn(2, layout.size, generator=gen)
    g = 0.01 * torch.randn(2, layout.size, generator=gen)
    state = init_flat_state(p)
    theta = {k: v.detach().clone().requires_grad_(True) for k, v in net.theta().items()}
    clean = flat_step(theta, net.config, layout, p, g, state["m"], state["v"], 1)[0]
    bad = p.clone()
    bad[1, 13] = float("nan")  # worker 1, segment "b"
    new_p, new_m, new_v, ok = flat_step(
        theta, net.config, layout, bad, g, state["m"], state["v"], 1, return_finite=True
    )
    assert ok.tolist() == [[True, True, True], [True, False, True]]
    seg_b = slice(12, 17)
    assert _same(new_p[1, seg_b], bad[1, seg_b])
    assert not new_m[1, :, seg_b].any() and not new_v[1, seg_b].any()
    keep = torch.ones_like(p, dtype=torch.bool)
    keep[1, seg_b] = False
    torch.testing.assert_close(new_p[keep], clean[keep])
    loss = torch.where(keep, new_p, 0.0).square().sum()
    grads = torch.autograd.grad(loss, list(theta.values()), allow_unused=True)
    assert all(t is None or torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize("bad_segment", [None, 1])
def test_reading_the_mask_on_the_host_gives_the_same_step(bad_segment):
    """``read_mask`` leaves the masking out only where every segment is stepped: bitwise
    the same step with and without it, a NaN gradient or not."""
    net = perturbed_net()
    theta = {k: v.detach() for k, v in net.theta().items()}
    layout = FlatLayout(tuple("abc"), ((4, 3), (5,), (2, 2)))
    gen = torch.Generator().manual_seed(0)
    p = 0.1 * torch.randn(1, layout.size, generator=gen)
    g = 0.01 * torch.randn(1, layout.size, generator=gen)
    if bad_segment is not None:
        g[0, 14] = float("nan")  # segment "b"
    state = init_flat_state(p)
    state["m"].normal_(generator=gen)
    state["v"].uniform_(generator=gen)
    args = (theta, net.config, layout, p, g, state["m"], state["v"], 3)
    masked = flat_step(*args, return_finite=True)
    read = flat_step(*args, return_finite=True, read_mask=True)
    for a, b in zip(masked, read):
        assert _same(a, b)
    assert masked[-1].tolist() == [[True, bad_segment is None, True]]


def test_a_bad_parameter_in_a_later_group_is_named_by_its_own_group():
    """Groups step in one call; a skipped tensor is still counted and named by its own
    group and position, and the other group steps."""
    params = make_params()
    opt = LearnedOptimizer(
        [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}],
        net=perturbed_net(),
    )
    with torch.no_grad():
        params[2].view(-1)[0] = float("nan")
    before = [p.detach().clone() for p in params]
    fixed_grads(params, 0)
    shape = tuple(params[2].shape)
    with pytest.warns(
        RuntimeWarning, match=re.escape(f"parameter 1 of param group 1 (shape {shape})")
    ):
        opt.step()
    assert [opt.state[p]["nonfinite_skips"] for p in params] == [0, 0, 1] + [0] * (len(params) - 3)
    assert _same(params[2], before[2])
    assert not torch.equal(params[0], before[0]) and not torch.equal(params[1], before[1])


def _stalled_model():
    """A small model whose first weight holds one NaN: the loss and every gradient are NaN
    from then on, so every tensor's update is skipped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight[2, 3] = float("nan")
    return model


def _train_step(model, opt):
    x, y = torch.randn(4, 6), torch.randn(4, 2)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_a_stalled_run_raises_naming_the_parameter():
    """One NaN weight: one warning at once, then, on the ``stall_steps``-th step in a row on
    which every update was skipped, a ``StalledError`` naming the cause and the parameter;
    nothing moved."""
    from learned_opt import StalledError

    model = _stalled_model()
    opt = LearnedOptimizer(model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="holds NaN or Inf"):
        _train_step(model, opt)
    for _ in range(opt.stall_steps - 2):
        _train_step(model, opt)  # counted, not raised yet
    with pytest.raises(StalledError) as info:
        _train_step(model, opt)
    message = str(info.value)
    assert f"every update was skipped on the last {opt.stall_steps} steps" in message
    assert "0.weight of param group 0 (shape (8, 6))" in message
    assert "0.bias" not in message and "2.weight" not in message  # finite, named only if bad
    assert "\n" not in message
    for p, b in zip(model.parameters(), before):
        assert _same(p, b)
    assert opt.nonfinite_skips == opt.stall_steps * len(before)


def test_stall_over_gradients_alone_says_the_parameters_are_finite():
    from learned_opt import StalledError

    params = make_params()
    opt = LearnedOptimizer(params, net=perturbed_net())
    opt.stall_steps = 3
    for k in range(2):
        fixed_grads(params, k)
        for p in params:
            p.grad.fill_(float("nan"))
        opt.step()
    fixed_grads(params, 2)
    params[0].grad[0] = float("inf")
    for p in params[1:]:
        p.grad.fill_(float("nan"))
    with pytest.raises(StalledError, match=r"every gradient held NaN or Inf \(the parameters"):
        opt.step()


def test_one_tensor_stepped_or_stall_steps_none_keeps_a_run_going():
    """A step on which any tensor stepped resets the count; ``stall_steps=None`` never
    raises."""
    params = make_params()
    opt = LearnedOptimizer(params, net=perturbed_net())
    for k in range(3 * opt.stall_steps):
        fixed_grads(params, k)
        last = k % opt.stall_steps == opt.stall_steps - 1
        for p in params[1:] if last else params:  # every tensor skipped, but on every
            p.grad.fill_(float("nan"))  # stall_steps-th step, where the first one steps
        opt.step()
    assert opt.nonfinite_skips == 3 * (opt.stall_steps * len(params) - 1)
    model = _stalled_model()
    opt = LearnedOptimizer(model.parameters())
    opt.stall_steps = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(10):
            _train_step(model, opt)
    assert opt.nonfinite_skips == 10 * len(list(model.parameters()))


def test_stall_steps_travels_with_a_copy():
    import copy
    import pickle

    opt = LearnedOptimizer(make_params(), net=perturbed_net())
    opt.stall_steps = None
    assert copy.deepcopy(opt).stall_steps is None
    assert pickle.loads(pickle.dumps(opt)).stall_steps is None
    assert LearnedOptimizer(make_params()).stall_steps == 5
