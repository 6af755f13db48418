"""torch.optim's generic contract, run on an ``OptimizerInfo`` for ``LearnedOptimizer``.

``LEARNED_INFO`` is built with ``torch.testing._internal.common_optimizers`` (it ships in
the torch wheel; torch's own ``test/test_optim.py`` does not). Every check below runs over
every configuration of ``LEARNED_INFO.optim_inputs_func``, with torch's error inputs for
all optimizers plus ours, on CPU. ``tests/core/test_optim_table.py`` covers the rest of the
contract (descent, bit-for-bit resume, schedulers scaling the step, param groups, dtypes,
``grad=None``, sparse gradients rejected).

Generic checks that do not apply, and why:

- foreach / fused / differentiable / capturable: no such flags. One dispatcher picks the
  implementation by device and tensor size (``supported_impls=()``).
- maximize: not an argument of a learned optimizer (the network decides the update).
  ``weight_decay`` is AdamW's decoupled decay, relative to each tensor's step size; it
  runs here as one more configuration (``tests/core/test_weight_decay.py`` checks what
  it does).
- complex parameters (``supports_complex=False``): the features are real; complex
  parameters are refused with a ``ValueError``.
- sparse gradients (``supports_sparse=False``): refused with a clear ``RuntimeError``.
- CUDA and multi-device checks: CPU here; the CUDA path is checked by
  ``tests/core/test_cuda.py`` on a GPU machine.
- ``torch.compile`` through inductor takes minutes on 2 cores, so that parity check is
  ``slow``; the same parity through dynamo with the eager backend runs in the fast suite.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
)

from learned_opt import LearnedOptimizer


def _inputs(device, dtype=None):
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.5}, desc="lr 0.5"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.5)}, desc="Tensor lr"),
        OptimizerInput(params=None, kwargs={"checkpoint": "adam_init"}, desc="adam_init"),
        OptimizerInput(params=None, kwargs={"compile": False}, desc="reference only"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1}, desc="weight decay"),
    ]


def _error_inputs(device, dtype):
    def bad_lr(lr, desc, regex):
        return ErrorOptimizerInput(
            OptimizerInput(params=None, kwargs={"lr": lr}, desc=desc),
            error_type=ValueError,
            error_regex=regex,
        )

    return get_error_inputs_for_all_optims(device, dtype) + [
        bad_lr(-1.0, "negative lr", "finite and >= 0"),
        bad_lr(float("inf"), "infinite lr", "finite and >= 0"),
        bad_lr(float("nan"), "nan lr", "finite and >= 0"),
        bad_lr("0.1", "string lr", "must be a number"),
        ErrorOptimizerInput(
            OptimizerInput(params=None, kwargs={"weight_decay": -0.1}, desc="negative decay"),
            error_type=ValueError,
            error_regex="Invalid weight_decay",
        ),
        ErrorOptimizerInput(
            OptimizerInput(params=None, kwargs={"compile": "yes"}, desc="compile 'yes'"),
            error_type=ValueError,
            error_regex="Invalid compile",
        ),
    ]


LEARNED_INFO = OptimizerInfo(
    LearnedOptimizer,
    optim_inputs_func=_inputs,
    optim_error_inputs_func=_error_inputs,
    scheduler_inputs=(
        [lambda opt: StepLR(opt, gamma=0.9, step_size=10)],
        [lambda opt: ReduceLROnPlateau(opt)],
    ),
    supported_impls=(),
    supports_complex=False,
    supports_sparse=False,
)
INPUTS = LEARNED_INFO.optim_inputs_func("cpu")


def _problem(seed: int = 0):
    """Weight, bias and the loss closure factory of torch's basic test problem."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(10, 5, generator=gen).requires_grad_()
    bias = torch.randn(10, generator=gen).requires_grad_()
    x = torch.randn(5, generator=gen)

    def closure_for(opt):
        def closure():
            opt.zero_grad()
            loss = (weight.mv(x) + bias).pow(2).sum()
            loss.backward()
            return loss

        return closure

    return [weight, bias], closure_for


def _build(optim_input, params):
    return LEARNED_INFO.optim_cls(params, **optim_input.kwargs)


def _run(optim_input, steps: int, seed: int = 0):
    params, closure_for = _problem(seed)
    opt = _build(optim_input, params)
    closure = closure_for(opt)
    for _ in range(steps):
        opt.step(closure)
    return opt, params, closure


by_desc = pytest.mark.parametrize("optim_input", INPUTS, ids=lambda i: i.desc)


@pytest.mark.parametrize(
    "error_input",
    LEARNED_INFO.optim_error_inputs_func("cpu", torch.float32),
    ids=lambda e: e.optimizer_error_input.desc,
)
def test_errors(error_input):
    optim_input = error_input.optimizer_error_input
    params = optim_input.params
    if params is None:
        params = [torch.nn.Parameter(torch.randn(2, 3))]
    assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR
    if issubclass(error_input.error_type, Warning):
        with pytest.warns(error_input.error_type, match=error_input.error_regex):
            LearnedOptimizer(params, **optim_input.kwargs)
    else:
        with pytest.raises(error_input.error_type, match=error_input.error_regex):
            LearnedOptimizer(params, **optim_input.kwargs)


@by_desc
@pytest.mark.parametrize("schedulers", [[], *LEARNED_INFO.scheduler_inputs], ids=len)
def test_goes_right_direction(optim_input, schedulers):
    params, closure_for = _problem()
    opt = _build(optim_input, params)
    scheds = [make(opt) for make in schedulers]
    closure = closure_for(opt)
    initial = float(closure())
    for _ in range(20):
        loss = opt.step(closure)
        for sched in scheds:
            sched.step(loss) if isinstance(sched, ReduceLROnPlateau) else sched.step()
    assert float(closure()) < initial


@by_desc
def test_optimizer_can_be_printed(optim_input):
    params, _ = _problem()
    text = repr(_build(optim_input, params))
    assert "LearnedOptimizer" in text and "Parameter Group 0" in text


def test_tensor_lr_matches_float_lr():
    runs = [_run(OptimizerInput(None, {"lr": lr}), 5)[1] for lr in (0.5, torch.tensor(0.5))]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [-5.0, float("inf"), float("nan"), torch.tensor(float("nan"))])
def test_lr_is_checked_at_every_step(bad):
    params, closure_for = _problem()
    opt = LearnedOptimizer(params)
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["lr"] = bad
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\].*finite and >= 0"):
        opt.step(closure_for(opt))
    assert all(torch.equal(a, b) for a, b in zip(before, params)), "nothing was stepped"
    with pytest.raises(ValueError, match="finite and >= 0"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": bad})


@by_desc
def test_step_is_noop_when_params_have_no_grad(optim_input):
    params, _ = _problem()
    opt = _build(optim_input, params)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert len(opt.state) == 0


@by_desc
def test_step_is_noop_for_zero_grads(optim_input):
    params, _ = _problem()
    opt = _build(optim_input, params)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))


@by_desc
def test_state_dict_deterministic_and_weights_only_round_trip(optim_input):
    opt, params, _ = _run(optim_input, 3)
    opt_c, params_c, closure_c = _run(optim_input, 3)
    torch.testing.assert_close(opt.state_dict(), opt_c.state_dict(), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh, closure = _problem()
    with torch.no_grad():
        for p, q in zip(fresh, params):
            p.copy_(q)
    loaded = _build(optim_input, fresh)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    closure = closure(loaded)
    for _ in range(3):
        loaded.step(closure)
        opt_c.step(closure_c)
    for a, b in zip(fresh, params_c):
        assert torch.equal(a, b)


def test_can_load_older_state_dict():
    """A state dict without the group's ``step`` (as an older version wrote) loads and steps."""
    opt, params, closure = _run(INPUTS[0], 2)
    state = opt.state_dict()
    for group in state["param_groups"]:
        del group["step"]
    opt.load_state_dict(state)
    assert opt.param_groups[0]["step"] == 0
    opt.step(closure)


def test_loaded_state_takes_the_parameters_dtype():
    opt, params, _ = _run(INPUTS[0], 2)
    state = opt.state_dict()
    params64 = [p.detach().double().requires_grad_() for p in params]
    opt64 = LearnedOptimizer(params64)
    opt64.load_state_dict(state)
    for p in params64:
        assert opt64.state[p]["m"].dtype == opt64.state[p]["v"].dtype == torch.float64


@by_desc
def test_deepcopy_and_pickle_copy_everything_and_step_alike(optim_input):
    for make_copy in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        opt, params, _ = _run(optim_input, 2)
        copied = make_copy(opt)
        public = {k for k in opt.__dict__ if not k.startswith("_")}
        assert {k for k in copied.__dict__ if not k.startswith("_")} == public
        assert copied.card == opt.card and copied.compile == opt.compile
        twin = [p for g in copied.param_groups for p in g["params"]]
        for p, q in zip(params, twin):
            p.grad = torch.full_like(p, 0.3)
            q.grad = p.grad.clone()
        copied.step()
        opt.step()
        for a, b in zip(params, twin):
            assert torch.equal(a, b)


def test_step_hooks_and_state_dict_hooks():
    params, closure_for = _problem()
    opt = LearnedOptimizer(params)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    opt.step(closure_for(opt))
    state = opt.state_dict()
    assert state["extra"] == 1
    opt.load_state_dict(state)
    assert calls == ["pre", "post", "sd_pre", "load_pre", "load_post"]


def test_step_returns_the_closure_loss_and_never_edits_grads():
    params, closure_for = _problem()
    opt = LearnedOptimizer(params)
    returned = []

    def closure():
        returned.append(closure_for(opt)())
        return returned[-1]

    assert opt.step(closure) is returned[0]
    grads = [p.grad.clone() for p in params]
    opt.step()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


def test_complex_parameters_are_refused():
    with pytest.raises(ValueError, match="floating-point"):
        LearnedOptimizer([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])


def _compiled_matches_eager(backend: str) -> None:
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        params, _ = _problem()
        opt = LearnedOptimizer(params)
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        for k in range(2):  # from zero state, then with state (each step recompiles)
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (k + 1))
            step()
        runs.append(params)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_step_matches_eager_dynamo():
    """torch.compile(opt.step) traces (dynamo, eager backend) and matches eager."""
    _compiled_matches_eager("eager")


@pytest.mark.slow
def test_compiled_step_matches_eager_inductor():
    _compiled_matches_eager("inductor")


def test_unpickling_without_a_network_says_so():
    opt = LearnedOptimizer.__new__(LearnedOptimizer)
    with pytest.raises(ValueError, match="holds no network"):
        opt.__setstate__({"defaults": {"lr": 1.0}, "state": {}, "param_groups": []})
