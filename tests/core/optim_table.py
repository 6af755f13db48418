"""A table of optimizer configurations and the generic checks every one of them must pass.

In the style of torch's ``OptimizerInfo``: each check is a plain function of an
:class:`OptimInfo` that raises ``AssertionError`` on failure. ``test_optim_table.py`` runs
every check over :data:`OPTIMIZERS` (torch's Adam included as a control) and runs each
check against a deliberately broken optimizer (:data:`MUTANTS`) to show it can fail.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from learned_opt import LearnedOptimizer, LearnedOptimizerNet, NetConfig


def perturbed_net(width: int = 8, noise: float = 0.1, seed: int = 0) -> LearnedOptimizerNet:
    """The hand-initialised network plus Gaussian noise on every entry of theta, so the
    output heads (direction, magnitude, step scale, context) are all non-trivial."""
    net = LearnedOptimizerNet(NetConfig(width=width))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return net


@dataclass(frozen=True)
class OptimInfo:
    """One optimizer configuration: ``make(params)`` builds it; ``lr`` is its default lr
    (the unit that param-group and scheduler checks scale)."""

    name: str
    make: Callable[..., torch.optim.Optimizer]
    lr: float


OPTIMIZERS = [
    OptimInfo("learned-default", lambda params: LearnedOptimizer(params), 1.0),
    OptimInfo(
        "learned-perturbed", lambda params: LearnedOptimizer(params, net=perturbed_net()), 1.0
    ),
    OptimInfo(
        "learned-perturbed-w32",
        lambda params: LearnedOptimizer(params, net=perturbed_net(32, seed=1)),
        1.0,
    ),
    OptimInfo("torch-adam", lambda params: torch.optim.Adam(params, lr=1e-3), 1e-3),
]


# ----------------------------------------------------------------------------- helpers
def make_params(dtype=torch.float32, seed: int = 0, scale: float = 0.02) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    return [nn.Parameter((scale * torch.randn(s, generator=gen)).to(dtype)) for s in shapes]


def quadratic(params) -> torch.Tensor:
    """0.5 * sum_i c_i x_i^2 with fixed positive curvatures per tensor."""
    return sum(0.5 * (1.0 + i) * p.float().square().sum() for i, p in enumerate(params))


def fixed_grads(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (1e-2 * torch.randn(p.shape, generator=gen)).to(p.dtype)


def train(opt, params, steps: int, seed: int = 100, scheduler=None) -> None:
    """``steps`` steps with gradients that depend only on (seed, step), not on params."""
    for k in range(steps):
        fixed_grads(params, seed + k)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def clone(params) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def first_update(info: OptimInfo, lr_factor: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    params = make_params(seed=seed)
    before = [p.detach().clone() for p in params]
    opt = info.make(params)
    for group in opt.param_groups:
        group["lr"] = info.lr * lr_factor
    train(opt, params, 1)
    return [p.detach() - b for p, b in zip(params, before)]


# ------------------------------------------------------------------------------ checks
def check_descends_quadratic(info: OptimInfo) -> None:
    params = make_params()
    opt = info.make(params)
    loss0 = float(quadratic(params).detach())
    for _ in range(40):
        opt.zero_grad()
        loss = quadratic(params)
        loss.backward()
        opt.step()
    loss1 = float(quadratic(params).detach())
    assert loss1 < 0.5 * loss0, f"{info.name}: loss {loss0:.3g} -> {loss1:.3g}"


def check_state_dict_resume(info: OptimInfo) -> None:
    """k steps, save, rebuild from the saved state, continue: bit-for-bit the same as
    an uninterrupted run. The state dict travels through torch.save/load(weights_only)."""
    params = make_params()
    opt = info.make(params)
    train(opt, params, 3, seed=10)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    saved_params = clone(params)
    train(opt, params, 3, seed=20)  # uninterrupted

    buffer.seek(0)
    resumed = saved_params
    opt2 = info.make(resumed)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    train(opt2, resumed, 3, seed=20)
    for a, b in zip(params, resumed):
        assert torch.equal(a, b), f"{info.name}: resumed run differs by {(a - b).abs().max()}"


def check_scheduler_lr_zero(info: OptimInfo) -> None:
    params = make_params()
    before = clone(params)
    opt = info.make(params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0)
    train(opt, params, 2, scheduler=sched)
    for a, b in zip(params, before):
        assert torch.equal(a, b), f"{info.name}: lr=0 still moved the parameters"


def check_scheduler_halves_update(info: OptimInfo) -> None:
    """Half the lr, half the first update (LambdaLR); StepLR halves the second update."""
    full = first_update(info)
    params = make_params()
    before = clone(params)
    opt = info.make(params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)
    train(opt, params, 1, scheduler=sched)
    for u, p, b in zip(full, params, before):
        torch.testing.assert_close(p.detach() - b, 0.5 * u, rtol=1e-4, atol=1e-9)

    runs = []
    for gamma in (1.0, 0.5):
        params = make_params()
        opt = info.make(params)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
        train(opt, params, 1, scheduler=sched)
        mid = clone(params)
        train(opt, params, 1, seed=101)
        runs.append([p.detach() - m for p, m in zip(params, mid)])
    assert opt.param_groups[0]["lr"] == info.lr * 0.5
    for u1, u2 in zip(*runs):
        torch.testing.assert_close(u2, 0.5 * u1, rtol=1e-4, atol=1e-9)


def check_param_groups(info: OptimInfo) -> None:
    """Different lr per group; a group added later gets its own lr and fresh state."""
    a, b = make_params()[:2], make_params()[:2]
    opt = info.make([{"params": a}, {"params": b, "lr": 0.5 * info.lr}])
    before = clone(a)
    fixed_grads(a, 0)
    for pa, pb in zip(a, b):
        pb.grad = pa.grad.clone()
    opt.step()
    for pa, pb, p0 in zip(a, b, before):
        torch.testing.assert_close(pb.detach() - p0, 0.5 * (pa.detach() - p0), rtol=1e-4, atol=1e-9)

    params = make_params()
    opt = info.make(params[:1])
    train(opt, params[:1], 2)
    extra = make_params(seed=5)[1:2]
    opt.add_param_group({"params": extra, "lr": 0.25 * info.lr})
    before = clone(extra)
    fixed_grads(params[:1], 7)
    fixed_grads(extra, 7)
    opt.step()
    fresh = clone(before)
    fresh_opt = info.make(fresh)
    fresh_opt.param_groups[0]["lr"] = 0.25 * info.lr
    fixed_grads(fresh, 7)
    fresh_opt.step()
    assert not torch.equal(extra[0], before[0]), f"{info.name}: added group not updated"
    torch.testing.assert_close(extra[0], fresh[0], rtol=1e-5, atol=1e-9)


def check_dtypes(info: OptimInfo) -> None:
    """float32, float64 and bfloat16 parameters: dtype kept, state finite, loss falls."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        params = make_params(dtype)
        opt = info.make(params)
        loss0 = float(quadratic(params).detach())
        for _ in range(10):
            opt.zero_grad()
            quadratic(params).backward()
            opt.step()
        for p in params:
            assert p.dtype == dtype, f"{info.name}: {dtype} parameter became {p.dtype}"
            assert torch.isfinite(p).all()
            for value in opt.state[p].values():
                if torch.is_tensor(value):
                    assert torch.isfinite(value).all(), f"{info.name}: {dtype} state not finite"
        assert float(quadratic(params).detach()) < loss0, f"{info.name}: {dtype} loss did not fall"


def check_grad_none_skipped(info: OptimInfo) -> None:
    params = make_params()
    frozen = params[1]
    before = frozen.detach().clone()
    opt = info.make(params)
    for k in range(2):
        fixed_grads(params, k)
        frozen.grad = None
        opt.step()
    assert torch.equal(frozen, before), f"{info.name}: a parameter without grad moved"
    assert len(opt.state.get(frozen, {})) == 0, f"{info.name}: state made for a grad-less param"


def check_sparse_rejected(info: OptimInfo) -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    opt = info.make(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        assert "sparse" in str(exc).lower(), f"{info.name}: unclear error: {exc}"
        return
    raise AssertionError(f"{info.name}: a sparse gradient was accepted")


def check_zero_grad(info: OptimInfo) -> None:
    params = make_params()
    opt = info.make(params)
    quadratic(params).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params), info.name
    opt.zero_grad()
    assert all(p.grad is None for p in params), f"{info.name}: zero_grad() left gradients"


GENERIC_CHECKS = [
    check_descends_quadratic,
    check_state_dict_resume,
    check_scheduler_lr_zero,
    check_scheduler_halves_update,
    check_param_groups,
    check_dtypes,
    check_grad_none_skipped,
    check_sparse_rejected,
    check_zero_grad,
]


# ----------------------------------------------------------------------------- mutants
class _Mutant(LearnedOptimizer):
    """The learned optimizer with one deliberate bug, selected by ``bug``."""

    def __init__(self, params, bug: str):
        self.bug = bug
        super().__init__(params, net=perturbed_net())

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if self.bug == "ascends":
            before = [p.detach().clone() for p in params]
        if self.bug == "ignores_lr":
            for g in self.param_groups:
                g["lr"] = 1.0
        if self.bug == "first_group_lr":
            for g in self.param_groups:
                g["lr"] = self.param_groups[0]["lr"]
        if self.bug == "invents_grad":  # (an all-zero gradient would leave it alone)
            for p in params:
                if p.grad is None:
                    p.grad = torch.full_like(p, 1e-6)
        if self.bug == "densifies_sparse":
            for p in params:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
        out = super().step(closure)
        if self.bug == "ascends":
            with torch.no_grad():
                for p, b in zip(params, before):
                    p.copy_(2 * b - p)
        if self.bug == "upcasts_bf16":
            for p in params:
                if p.dtype == torch.bfloat16:
                    p.data = p.data.float()
        return out

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.bug == "forgets_state":
            self.state.clear()

    def zero_grad(self, set_to_none: bool = True):
        if self.bug != "keeps_grads":
            super().zero_grad(set_to_none)


def mutant(bug: str) -> OptimInfo:
    return OptimInfo(f"mutant-{bug}", lambda params: _Mutant(params, bug), 1.0)


#: (check, broken optimizer that the check must catch)
MUTANTS = [
    (check_descends_quadratic, mutant("ascends")),
    (check_state_dict_resume, mutant("forgets_state")),
    (check_scheduler_lr_zero, mutant("ignores_lr")),
    (check_scheduler_halves_update, mutant("ignores_lr")),
    (check_param_groups, mutant("first_group_lr")),
    (check_dtypes, mutant("upcasts_bf16")),
    (check_grad_none_skipped, mutant("invents_grad")),
    (check_sparse_rejected, mutant("densifies_sparse")),
    (check_zero_grad, mutant("keeps_grads")),
]
