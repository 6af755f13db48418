"""The learned optimizer on CUDA agrees with the CPU: ``LearnedOptimizer`` (its chunked and
its batched small-tensor path), ``flat_step`` (and its gradient in theta), bfloat16, and a
NaN/Inf gradient never reaching the parameter. Skipped without CUDA.

The measuring helpers take the device as an argument and return plain dicts with an
``ok`` verdict, so ``benchmarks/cuda_check.py`` records the numbers these tests assert on.
"""

from __future__ import annotations

import pytest
import torch
from optim_table import perturbed_net

from learned_opt import LearnedOptimizer
from learned_opt.features import init_state
from learned_opt.segments import FlatLayout
from learned_opt.step import flat_step, init_flat_state, tensor_step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

#: One tensor on the chunked path (several ``CHUNK``s on the CPU; CUDA uses its own,
#: larger chunk), the rest at most ``small_tensor_size`` elements (stepped together
#: through ``packed_step_``).
SHAPES = [(300, 400), (400,), (17, 3), ()]
CHUNK = 1 << 15
#: More elements than one accelerator chunk (``learned_opt._chunked.ACCELERATOR_CHUNK``).
MULTICHUNK = (1 << 22) + 4096
STEPS = 5
#: Worst CPU/CUDA difference allowed, relative to the largest update (or state entry),
#: beyond ``ROUNDING_ULPS`` units of rounding of the parameter itself.
FP32_TOL = 1e-5
ROUNDING_ULPS = 4
#: The theta gradient through a few ``flat_step`` calls sums over every element.
GRAD_TOL = 1e-4
#: bfloat16 parameters: the two devices may round the same float32 value differently.
BF16_MAX_ULPS = 1.0
BF16_MAX_MISMATCH = 1e-3


def _rel_err(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, ulps: float = 0.0) -> float:
    """``max |a - b| / max |ref|`` in float64, after forgiving ``ulps`` units of rounding of
    ``b`` (as ``test_core_paths``: parameters are stored rounded, updates are small)."""
    rounding = ulps * torch.finfo(b.dtype).eps * float(b.double().abs().max()) if b.numel() else 0.0
    err = float((a.double() - b.double()).abs().max()) if b.numel() else 0.0
    scale = float(ref.double().abs().max()) if ref.numel() else 0.0
    err = max(err - rounding, 0.0)
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ``|a - b|`` in units of the bfloat16 spacing at ``b``."""
    b32 = b.float()
    ulp = torch.ldexp(torch.ones_like(b32), torch.frexp(b32).exponent - 8)
    return (a.float() - b32).abs() / ulp.clamp_min(torch.finfo(torch.bfloat16).tiny)


def learned_run(device, dtype=torch.float32, steps=STEPS, nonfinite=None) -> dict:
    """Start, parameters and state before the last step, and final ones, of ``steps``
    learned steps with fixed gradients on ``device`` (all returned on the CPU).

    Everything random is drawn on the CPU, so every device sees the same numbers.
    ``nonfinite=(tensor, value)`` writes ``value`` into one gradient element of that
    tensor at the last step.
    """
    gen = torch.Generator().manual_seed(0)
    start = [0.02 * torch.randn(s, generator=gen) for s in SHAPES]
    params = [torch.nn.Parameter(t.to(device=device, dtype=dtype, copy=True)) for t in start]
    opt = LearnedOptimizer(params, net=perturbed_net(8, seed=3))
    for k in range(steps):
        grads = [1e-3 * torch.randn(p.shape, generator=gen) for p in params]
        if k == steps - 1:
            before = _snapshot(params, opt)
            if nonfinite is not None:
                grads[nonfinite[0]].view(-1)[grads[nonfinite[0]].numel() // 2] = nonfinite[1]
        for p, g in zip(params, grads):
            p.grad = g.to(device=device, dtype=dtype)
        opt.step()
    return {
        "start": [t.to(dtype) for t in start],
        "before_last": before,
        "final": _snapshot(params, opt),
        "nonfinite_skips": opt.nonfinite_skips,
    }


def _snapshot(params, opt) -> list[dict]:
    """CPU copies of every parameter (``p``) and its state (``m``, ``v``)."""
    return [
        {"p": p.detach().cpu().clone(), **{n: opt.state[p][n].cpu().clone() for n in "mv"}}
        if opt.state[p] else {"p": p.detach().cpu().clone()}
        for p in params
    ]  # fmt: skip


def learned_agreement(device, dtype=torch.float32) -> dict:
    """How far ``LearnedOptimizer`` on ``device`` is from the CPU (worst over tensors);
    ``ok`` says whether that is within the tolerances."""
    ref, run = learned_run("cpu", dtype), learned_run(device, dtype)
    pairs = list(zip(run["final"], ref["final"], ref["start"]))
    out = {
        "dtype": str(dtype),
        "device": str(device),
        "param_rel_err": max(
            _rel_err(a["p"], b["p"], b["p"].double() - s, ROUNDING_ULPS) for a, b, s in pairs
        ),
        "state_rel_err": max(_rel_err(a[n], b[n], b[n]) for a, b, _ in pairs for n in "mv"),
        "min_update": min(float((b["p"].double() - s.double()).abs().max()) for _, b, s in pairs),
        "param_dtype": str(run["final"][0]["p"].dtype),
        "state_dtype": str(run["final"][0]["v"].dtype),
    }
    # every tensor moved (else the comparison is empty) and the state agrees
    ok = out["min_update"] > 0 and out["state_rel_err"] <= FP32_TOL
    if dtype == torch.bfloat16:
        ulps = torch.cat([_bf16_ulps(a["p"], b["p"]).reshape(-1) for a, b, _ in pairs])
        out["bf16_max_ulps"] = float(ulps.max())
        out["bf16_mismatch_fraction"] = float((ulps > 0).double().mean())
        ok = ok and out["param_dtype"] == str(dtype) and out["state_dtype"] == "torch.float32"
        ok = ok and out["bf16_max_ulps"] <= BF16_MAX_ULPS
        ok = ok and out["bf16_mismatch_fraction"] <= BF16_MAX_MISMATCH
    else:
        ok = ok and out["param_rel_err"] <= FP32_TOL
    return {**out, "ok": bool(ok)}


def nonfinite_check(device, tensor: int, value: float) -> dict:
    """A NaN/Inf gradient element in ``tensor`` at the last step on ``device``: ``ok`` when
    that tensor (parameter and state) stayed exactly as before, the others moved, all is
    finite and the skip was counted once."""
    run = learned_run(device, nonfinite=(tensor, value))
    before, after = run["before_last"], run["final"]
    out = {
        "tensor": tensor,
        "value": str(value),
        "bad_tensor_unchanged": all(
            torch.equal(before[tensor][k], after[tensor][k]) for k in "pmv"
        ),
        "other_tensors_moved": all(
            not torch.equal(b["p"], a["p"])
            for i, (b, a) in enumerate(zip(before, after))
            if i != tensor
        ),
        "all_finite": all(bool(torch.isfinite(a["p"]).all()) for a in after),
        "nonfinite_skips": run["nonfinite_skips"],
    }
    flags = ("bad_tensor_unchanged", "other_tensors_moved", "all_finite")
    return {**out, "ok": all(out[k] for k in flags) and out["nonfinite_skips"] == 1}


def multichunk_check(device, steps: int = 2) -> dict:
    """A tensor of more than one CUDA chunk: ``LearnedOptimizer``'s chunked fast path
    against the pure, differentiable ``tensor_step`` on the same device."""
    net = perturbed_net(8, seed=4)
    theta = {k: v.detach().to(device) for k, v in net.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    start = (0.02 * torch.randn(MULTICHUNK, generator=gen)).to(device)
    p = torch.nn.Parameter(start.clone())
    opt = LearnedOptimizer(
        [p],
        net=net,
    )
    q, state = start.clone(), init_state(start)
    m, v = state["m"], state["v"]
    for k in range(steps):
        p.grad = (1e-3 * torch.randn(MULTICHUNK, generator=gen)).to(device)
        opt.step()
        with torch.no_grad():
            q, m, v = tensor_step(theta, net.config, q, p.grad, m, v, k + 1)
    err = _rel_err(p.detach().cpu(), q.cpu(), (q - start).cpu(), ROUNDING_ULPS)
    ok = err <= FP32_TOL and bool(torch.isfinite(p).all())
    return {"elements": MULTICHUNK, "param_rel_err": err, "ok": ok}


FLAT_SHAPES = {"w": (40, 30), "b": (30,), "n": (7,), "s": ()}
FLAT_LAYOUT = FlatLayout(tuple(FLAT_SHAPES), tuple(FLAT_SHAPES.values()))
WORKERS = 3


def flat_run(device, steps: int = 3, nan_worker: int | None = None) -> dict:
    """``steps`` chained ``flat_step`` calls on ``WORKERS`` workers on ``device``, and the
    gradient of ``sum(p^2)`` at the end w.r.t. theta; results on the CPU. ``nan_worker``
    gets a NaN in its first tensor's gradient at the last step."""
    net = perturbed_net(8, seed=5)
    theta = {k: v.detach().to(device).requires_grad_() for k, v in net.named_parameters()}
    gen = torch.Generator().manual_seed(2)
    p = (0.02 * torch.randn(WORKERS, FLAT_LAYOUT.size, generator=gen)).to(device)
    state = init_flat_state(p)
    m, v, start = state["m"], state["v"], p
    for k in range(steps):
        g = 1e-3 * torch.randn(WORKERS, FLAT_LAYOUT.size, generator=gen)
        if k == steps - 1:
            before = {"p": p.detach().cpu(), "m": m.detach().cpu(), "v": v.detach().cpu()}
            if nan_worker is not None:
                g[nan_worker, 0] = float("nan")
        p, m, v, finite = flat_step(
            theta, net.config, FLAT_LAYOUT, p, g.to(device), m, v, k + 1, return_finite=True
        )
    grads = torch.autograd.grad(p.square().sum(), list(theta.values()), allow_unused=True)
    out = {"start": start.cpu(), "p": p.detach().cpu(), "m": m.detach().cpu()}
    out.update(v=v.detach().cpu(), finite=finite.cpu(), before_last=before)
    out["grads"] = {k: t.cpu() for k, t in zip(theta, grads) if t is not None}  # no edge head
    return out


def flat_agreement(device) -> dict:
    """How far ``flat_step`` (values and theta gradient) on ``device`` is from the CPU."""
    ref, run = flat_run("cpu"), flat_run(device)
    out = {
        "device": str(device),
        "param_rel_err": _rel_err(run["p"], ref["p"], ref["p"] - ref["start"], ROUNDING_ULPS),
        "state_rel_err": max(_rel_err(run[n], ref[n], ref[n]) for n in "mv"),
        "theta_grad_rel_err": max(_rel_err(run["grads"][k], g, g) for k, g in ref["grads"].items()),
        "theta_grads": len(ref["grads"]),
    }
    ok = max(out["param_rel_err"], out["state_rel_err"]) <= FP32_TOL
    return {**out, "ok": ok and out["theta_grad_rel_err"] <= GRAD_TOL}


def flat_nonfinite_check(device) -> dict:
    """A NaN in one worker's first tensor at the last ``flat_step``: ``ok`` when exactly
    that segment is flagged and left as it was (values and state), the same segment of
    another worker moved, and everything, theta's gradient included, is finite."""
    run = flat_run(device, nan_worker=1)
    seg, before, finite = slice(0, FLAT_LAYOUT.numels[0]), run["before_last"], run["finite"]
    out = {
        "only_that_segment_flagged": not finite[1, 0] and int(finite.sum()) == finite.numel() - 1,
        "segment_unchanged": all(
            torch.equal(run[k][1, ..., seg], before[k][1, ..., seg]) for k in "pmv"
        ),
        "other_worker_moved": not torch.equal(run["p"][0, seg], before["p"][0, seg]),
        "all_finite": all(bool(torch.isfinite(t).all()) for t in [run["p"], run["m"], run["v"]])
        and all(bool(torch.isfinite(g).all()) for g in run["grads"].values()),
    }
    return {**out, "ok": all(out.values())}


def determinism_check(device) -> dict:
    """Whether two identical runs on ``device`` are bitwise equal, as resuming from a
    ``state_dict`` bit-for-bit needs: ``LearnedOptimizer`` (chunked tensor, batched small
    tensors) and ``flat_step`` (whose segment sums avoid ``index_add``'s atomics on CUDA)."""
    a, b = learned_run(device), learned_run(device)
    fa, fb = flat_run(device), flat_run(device)
    out = {
        "learned_chunked": all(torch.equal(a["final"][0][k], b["final"][0][k]) for k in "pmv"),
        "learned_batched": all(
            torch.equal(x[k], y[k]) for x, y in zip(a["final"][1:], b["final"][1:]) for k in "pmv"
        ),
        "flat_step": all(torch.equal(fa[k], fb[k]) for k in "pmv"),
    }
    return {**out, "ok": all(out.values())}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_learned_optimizer_cuda_matches_cpu(dtype):
    res = learned_agreement("cuda", dtype)
    assert res["ok"], res


@needs_cuda
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("tensor", [0, 2], ids=["chunked", "batched"])
def test_nonfinite_gradient_on_cuda_never_reaches_the_parameter(tensor, value):
    res = nonfinite_check("cuda", tensor, value)
    assert res["ok"], res


@needs_cuda
def test_cuda_multichunk_fast_path_matches_pure_path():
    res = multichunk_check("cuda")
    assert res["ok"], res


@needs_cuda
def test_flat_step_cuda_matches_cpu():
    res = flat_agreement("cuda")
    assert res["ok"], res


@needs_cuda
def test_flat_step_cuda_nan_gradient_leaves_that_segment():
    res = flat_nonfinite_check("cuda")
    assert res["ok"], res


@needs_cuda
def test_cuda_runs_are_bitwise_repeatable():
    res = determinism_check("cuda")
    assert res["ok"], res


@needs_cuda
def test_cuda_tensors_step_the_reference_and_queue_no_kernel(monkeypatch):
    """CUDA packages crashed ``aoti_load_package`` (``learned_opt.kernel.KERNEL_DEVICES``):
    with the compile enabled and its thresholds at zero, CUDA tensors still queue no build
    and step like the reference."""
    from learned_opt import LearnedOptimizer, kernel

    monkeypatch.setattr(kernel, "COMPILE_AFTER", 0)
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.delenv(kernel.COMPILE_ENV, raising=False)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 64, device="cuda")) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = LearnedOptimizer(ps), LearnedOptimizer(qs, compile=False)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = q.grad = torch.randn_like(p)
        opt.step(), ref.step()
    assert not opt._kernels._entries and not kernel._worker().busy()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
