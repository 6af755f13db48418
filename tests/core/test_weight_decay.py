"""Decoupled weight decay (``weight_decay``, per param group): every tensor is multiplied by
``1 - weight_decay * step_mult * lr`` before its update (see
:attr:`learned_opt.config.NetConfig.weight_decay`), and the keys of torch's other
optimizers are refused instead of being ignored."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from learned_opt import LearnedOptimizer, kernel
from learned_opt.kernel import (
    StepModule,
    kernel_inputs,
    kernels,
    package_path,
    state_keys,
    theta_inputs,
)
from learned_opt.kernel.export import step_args, tensor_stats

#: A vector, a small matrix that takes the Adam form and one that is orthogonalised.
SHAPES = [(8,), (3, 5), (32, 64)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _after_steps(groups_of, steps: int = 1, **kwargs):
    """The parameters before and after ``steps`` steps of an optimizer built on
    ``groups_of(params)``, the same gradients whatever the settings."""
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = LearnedOptimizer(groups_of(params), compile=False, **kwargs)
    for k in range(steps):
        _grads(params, k)
        opt.step()
    return before, [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("lr", [1.0, 0.5])
def test_decay_is_adamw_s_at_the_rule_s_base_step(lr):
    """Decay subtracts ``weight_decay * step_mult * lr * p`` on top of the same update, on
    every kind of tensor (a vector, an Adam-form matrix, an orthogonalised one), whatever
    the adapted step sizes: AdamW's decay at ``lr=step_mult`` (1e-3) times the multiplier."""
    before, plain, opt = _after_steps(list, lr=lr)
    _, decayed, _ = _after_steps(list, lr=lr, weight_decay=0.1)
    base = opt.config.step_mult * lr
    for p, new, new_decayed in zip(before, plain, decayed):
        torch.testing.assert_close(new_decayed - new, -0.1 * base * p, atol=5e-7, rtol=0)


def test_no_decay_is_the_rule_itself_bitwise():
    """``weight_decay`` None (the rule's own: 0 for every shipped rule) and 0 give the same
    parameters and state as each other, over steps that run and reuse Newton-Schulz."""
    _, plain, opt = _after_steps(list, steps=3)
    _, zero, opt_zero = _after_steps(list, steps=3, weight_decay=0.0)
    for a, b in zip(plain, zero):
        assert torch.equal(a, b)
    for s, t in zip(opt.state.values(), opt_zero.state.values()):
        assert all(torch.equal(s[k], t[k]) for k in s if torch.is_tensor(s[k]))


def test_a_group_without_decay_steps_as_without_weight_decay():
    """The usual groups: decay for the matrices, none for the vector (bias, norm)."""
    _, plain, _ = _after_steps(list, steps=2)
    _, mixed, opt = _after_steps(
        lambda ps: [{"params": ps[1:], "weight_decay": 0.1}, {"params": ps[:1], "weight_decay": 0}],
        steps=2,
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert torch.equal(mixed[0], plain[0])
    assert not torch.equal(mixed[2], plain[2])


def test_decay_follows_the_lr_multiplier():
    """At ``lr=0`` nothing moves, decay included (it scales with the multiplier, as
    AdamW's scales with its learning rate, so a schedule that ends at 0 ends decay too)."""
    before, after, _ = _after_steps(list, lr=0.0, weight_decay=0.5)
    for p, new in zip(before, after):
        assert torch.equal(p, new)


def test_the_kernel_s_traced_step_decays_as_the_reference(tmp_path, monkeypatch):
    """The compiled kernel is the exported step of one tensor with its decay an input: run
    eagerly (no compile here), it steps as the reference, and the decayed group's tensors
    use the package of the undecayed ones."""
    params = _params()
    opt = LearnedOptimizer(params, weight_decay=0.1, compile=False)
    _grads(params, 0)
    opt.step()  # state to step from
    _grads(params, 1)
    rule = replace(opt.config, weight_decay=0.0)
    theta = opt.theta(torch.device("cpu"), torch.float32)
    traced = []
    lr, decay = torch.tensor(1.0), torch.tensor(0.1)
    for p in params:
        state = kernel.kernel_state(opt.state[p])
        copy = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        kind = kernel.tensor_kind(rule, p, p.grad, copy)
        module = StepModule(rule, opt.parts, sorted(theta), kind, state_keys(copy))
        args = [p.detach().clone(), p.grad.clone(), copy, lr, decay, tensor_stats(rule, p, copy)]
        inputs = kernel_inputs(theta_inputs(theta), kind, *args)
        program = torch.export.export(module, (inputs,))
        program.module()(kernel_inputs(theta_inputs(theta), kind, *args))
        traced.append(args[0])
    opt.step()
    for p, new in zip(params, traced):
        torch.testing.assert_close(new, p.detach(), atol=1e-6, rtol=1e-5)
    monkeypatch.setenv(kernel.KERNEL_DIR_ENV, str(tmp_path))
    p, state = params[0], opt.state[params[0]]
    kind = kernel.tensor_kind(rule, p, p.grad, state)
    assert package_path(step_args(theta, rule, opt.parts, kind, p, p.grad, state)) == package_path(
        step_args(theta, replace(rule, weight_decay=0.0), opt.parts, kind, p, p.grad, state)
    )


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, "0.1", True])
def test_an_invalid_weight_decay_is_refused_in_one_line(bad):
    with pytest.raises(ValueError) as info:
        LearnedOptimizer(_params(), weight_decay=bad)
    assert "weight_decay" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError):
        LearnedOptimizer([{"params": _params(), "weight_decay": bad}])


def test_a_weight_decay_made_invalid_after_building_is_refused_at_the_step():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = LearnedOptimizer(params, weight_decay=0.1, compile=False)
    opt.param_groups[0]["weight_decay"] = -1.0
    _grads(params, 0)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decay'\]"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


@pytest.mark.parametrize("key, value", [("betas", (0.9, 0.95)), ("eps", 1e-8), ("momentum", 0.9)])
def test_keys_of_torch_s_other_optimizers_are_refused_not_ignored(key, value):
    with pytest.raises(ValueError) as info:
        LearnedOptimizer([{"params": _params(), key: value}])
    message = str(info.value)
    assert key in message and "remove them" in message and "\n" not in message
    opt = LearnedOptimizer(_params())
    with pytest.raises(ValueError):
        opt.add_param_group({"params": _params(1), key: value})
    assert len(opt.param_groups) == 1


def test_weight_decay_survives_a_state_dict_and_older_state_dicts_load():
    """A state dict carries each group's decay; one saved before weight decay existed
    (groups without the key) loads as the rule's own, None."""
    _, _, opt = _after_steps(list, weight_decay=0.1)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["weight_decay"] == 0.1
    fresh = LearnedOptimizer(_params(), compile=False)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["weight_decay"] == 0.1
    del saved["param_groups"][0]["weight_decay"]
    older = LearnedOptimizer(_params(), weight_decay=0.3, compile=False)
    older.load_state_dict(saved)
    assert older.param_groups[0]["weight_decay"] is None


def test_a_tensor_whose_gradient_is_nan_is_neither_stepped_nor_decayed():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = LearnedOptimizer(params, weight_decay=1.0, compile=False)
    _grads(params, 0)
    params[1].grad[0, 0] = float("nan")
    opt.step()
    assert torch.equal(params[1].detach(), before[1])
    assert not torch.equal(params[0].detach(), before[0])
    assert opt.nonfinite_skips == 1


def test_param_groups_step_in_one_reference_call_as_they_would_apart(monkeypatch):
    """The usual split (decay on the matrices, none on the vector), here also with another
    ``lr`` per group, steps in one call of the reference, with each tensor's own ``lr``
    and decay: the same parameters and state as two optimizers, one per group, over steps
    that run and reuse Newton-Schulz."""
    calls = []
    step_tensors = kernel.step_tensors
    monkeypatch.setattr(
        kernels, "step_tensors", lambda *a, **k: calls.append(len(a[3])) or step_tensors(*a, **k)
    )

    def params_of():  # and two matrices too large to pack (stepped as rows of one call)
        gen = torch.Generator().manual_seed(3)
        large = [torch.nn.Parameter(torch.randn(300, 240, generator=gen)) for _ in range(2)]
        return _params() + large

    params, apart = params_of(), params_of()
    together = LearnedOptimizer(
        [
            {"params": params[1:4], "weight_decay": 0.1, "lr": 0.5},
            {"params": params[:1] + params[4:]},
        ],
        compile=False,
    )
    alone = [
        LearnedOptimizer(apart[1:4], weight_decay=0.1, lr=0.5, compile=False),
        LearnedOptimizer(apart[:1] + apart[4:], compile=False),
    ]
    for k in range(4):
        _grads(params, k)
        _grads(apart, k)
        together.step()
        for opt in alone:
            opt.step()
    assert calls == [5, 3, 2] * 4  # one call for both groups, then one each apart
    for p, q in zip(params, apart):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6)
        s, t = together.state[p], next(o.state[q] for o in alone if q in o.state)
        for key in ("m", "v", "log_lr", "step"):
            torch.testing.assert_close(s[key], t[key], atol=1e-7, rtol=1e-6)


def test_groups_whose_rules_differ_beyond_decay_are_not_stepped_together():
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    opt = LearnedOptimizer(params, compile=False)
    opt.step()
    theta = opt.theta(torch.device("cpu"), torch.float32)
    other = replace(opt.config, lr_adapt_rate=0.5)
    groups = [
        kernel.Group(opt.config, params[:1], [params[0].grad], [opt.state[params[0]]], 1.0),
        kernel.Group(other, params[1:], [p.grad for p in params[1:]],
                     [opt.state[p] for p in params[1:]], 1.0),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="differ at most in weight_decay"):
        opt._kernels.step_groups(theta, opt.parts, groups)
