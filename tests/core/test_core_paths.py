"""The functional core: fast path == differentiable path, gradcheck, vmap over workers."""

from __future__ import annotations

import pytest
import torch
from optim_table import perturbed_net
from torch.func import functional_call, grad, vmap

from learned_opt._chunked import chunked_step_
from learned_opt.features import init_state
from learned_opt.flat import tensor_step
from learned_opt.workers import ChunkRunner

RUNNER = ChunkRunner(workers=2)  # the fast path's chunks on two threads, as on this machine


def _theta(net):
    return {k: v.detach() for k, v in net.named_parameters()}


def _warm_state(p, steps=3, seed=0):
    """State after a few gradient steps, so every momentum row is non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    s = init_state(p)
    for _ in range(steps):
        g = torch.randn(p.shape, generator=gen).to(s["v"].dtype)
        for k, beta in enumerate((0.9, 0.99, 0.999)):
            s["m"][k].mul_(beta).add_(g, alpha=1 - beta)
        s["v"].mul_(0.999).addcmul_(g, g, value=0.001)
    return s


def _chunked(theta, cfg, p, g, state, step, lr, chunk, runner=None):
    """The chunked layout on one tensor."""
    return chunked_step_(theta, cfg, [p], [g], [state], step, lr, chunk, runner or RUNNER)[0]


def _chunkwise_fast(theta, cfg, p, g, state, step, lr, chunk, runner=None):
    """A broken fast path: each chunk normalised on its own statistics."""
    flat_p, flat_g = p.view(-1), g.reshape(-1)
    m, v = state["m"].view(3, -1), state["v"].view(-1)
    for lo in range(0, p.numel(), chunk):
        sl = slice(lo, lo + chunk)
        piece = {"m": m[:, sl], "v": v[sl]}
        _chunked(theta, cfg, flat_p[sl], flat_g[sl], piece, step, lr, chunk)
    return True


CASES = {
    # name: (shape, dtype, chunk, non-contiguous)
    "fp32-multichunk": ((37, 53), torch.float32, 100, False),
    "fp32-onechunk": ((37, 53), torch.float32, 1 << 16, False),
    "fp32-transposed": ((40, 30), torch.float32, 64, True),
    "bf16-multichunk": ((1000,), torch.bfloat16, 64, False),
    "fp64-transposed": ((20, 30), torch.float64, 7, True),
    "fp32-scalar": ((), torch.float32, 4, False),
    "fp32-last-chunk-short": ((5, 7), torch.float32, 8, False),
}


def _compare_paths(fast_fn, width, shape, dtype, chunk, noncontig, steps=3):
    """Run both paths for a few steps from the same start (states must agree); return the
    worst difference of the new parameters beyond a few ulp, relative to the update."""
    net = perturbed_net(width, seed=width)
    theta, cfg = _theta(net), net.config
    gen = torch.Generator().manual_seed(1)
    p = (0.02 * torch.randn(shape, generator=gen)).to(dtype)  # weights-like scale
    if noncontig:
        p = p.t().contiguous().t()
        assert not p.is_contiguous()
    state = _warm_state(p)
    worst = 0.0
    for k in range(steps):
        g = torch.randn(shape, generator=gen).to(dtype)
        new_p, new_m, new_v = tensor_step(theta, cfg, p, g, state["m"], state["v"], k + 4, 0.7)
        fast_p, fast_state = p.clone(), {n: t.clone() for n, t in state.items()}
        assert fast_fn(theta, cfg, fast_p, g, fast_state, k + 4, 0.7, chunk, runner=RUNNER)
        upd = (new_p.double() - p.double()).abs().max()
        if dtype == torch.bfloat16:  # both round the same float32 result to bf16
            torch.testing.assert_close(fast_p, new_p, rtol=0, atol=float(upd) * 0.02)
        err = (fast_p.double() - new_p.double()).abs().max()
        rounding = 4 * torch.finfo(dtype).eps * new_p.double().abs().max()  # a few ulp of p
        worst = max(worst, float((err - rounding).clamp(min=0) / upd))
        torch.testing.assert_close(fast_state["m"], new_m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fast_state["v"], new_v, rtol=1e-5, atol=1e-7)
        p, state = fast_p, fast_state
    return worst


@pytest.mark.parametrize("width", [8, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_equals_differentiable_path(case, width):
    worst = _compare_paths(_chunked, width, *CASES[case])
    assert worst < 1e-5, f"fast and pure updates differ by {worst:.2e} of the update"


def test_path_comparison_catches_per_chunk_normalisation():
    worst = _compare_paths(_chunkwise_fast, 8, *CASES["fp32-multichunk"])
    assert worst > 1e-3


def test_gradcheck_wrt_theta_and_inputs():
    """float64 gradcheck of the pure step w.r.t. every theta entry it uses, p and g.

    Inputs sit away from the kinks: |g / rms(g)| <= sqrt(6) < clip_value, the direction is
    far from +-max_direction, and random pre-activations are not within eps of 0.
    """
    net = perturbed_net(width=8, noise=0.1).double()
    cfg = net.config
    names = [k for k, _ in net.named_parameters() if not k.startswith("edge")]
    theta0 = {k: v.detach() for k, v in net.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    s = _warm_state(p.detach(), seed=4)

    def step(p, g, *values):
        theta = dict(theta0, **dict(zip(names, values)))
        new_p, new_m, new_v = tensor_step(theta, cfg, p, g, s["m"], s["v"], 3, 1.0)
        return new_p, new_v

    values = [theta0[k].clone().requires_grad_(True) for k in names]
    assert torch.autograd.gradcheck(step, (p, g, *values), eps=1e-6, atol=1e-5, fast_mode=True)


def test_vmap_over_workers_equals_loop():
    """functional_call + vmap over 4 stacked workers == one call per worker; gradients
    reach theta through the vmapped step."""
    net = perturbed_net()
    theta = _theta(net)
    gen = torch.Generator().manual_seed(0)
    workers = 4
    P = torch.randn(workers, 5, 3, generator=gen)
    G = torch.randn(workers, 5, 3, generator=gen)
    states = [_warm_state(P[i], seed=i) for i in range(workers)]
    M = torch.stack([s["m"] for s in states])
    V = torch.stack([s["v"] for s in states])

    def one(theta, p, g, m, v):
        return functional_call(net, theta, (p, g, m, v, 4, 1.0))

    batched = vmap(one, in_dims=(None, 0, 0, 0, 0))(theta, P, G, M, V)
    for i in range(workers):
        looped = tensor_step(theta, net.config, P[i], G[i], M[i], V[i], 4, 1.0)
        for b, ref in zip(batched, looped):
            torch.testing.assert_close(b[i], ref, rtol=1e-6, atol=1e-8)

    def meta_loss(theta):
        new_p = vmap(one, in_dims=(None, 0, 0, 0, 0))(theta, P, G, M, V)[0]
        return new_p.square().sum()

    grads = grad(meta_loss)(theta)
    assert all(torch.isfinite(t).all() for t in grads.values())
    assert grads["elem_out.weight"].abs().sum() > 0
