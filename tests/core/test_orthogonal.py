"""The "ortho" output parameterisation: Newton-Schulz, the zero-heads rule, both layouts."""

from dataclasses import replace

import pytest
import torch
from torch.func import grad, vmap

from learned_opt import LearnedOptimizer, LearnedOptimizerNet, NetConfig, save_checkpoint
from learned_opt.features import init_state
from learned_opt.kernel import step_tensors
from learned_opt.orthogonal import (
    gram_polynomial,
    is_matrix,
    newton_schulz,
    newton_schulz_reusing,
    ns_due,
    ortho_direction,
    ortho_input,
    reuses_gram,
    shape_direction,
    takes_nesterov,
    unit_rms,
)
from learned_opt.segments import FlatLayout
from learned_opt.step import ALL_PARTS, flat_step, init_flat_state

ORTHO = NetConfig(output="ortho")


@pytest.mark.parametrize("shape", [(16, 16), (8, 16), (8, 40), (40, 8), (3, 5, 7)])
def test_newton_schulz_brings_singular_values_near_one(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x * torch.logspace(0, -1, shape[-1], dtype=torch.float64)  # condition number 10
    s = torch.linalg.svdvals(newton_schulz(x, 5))
    assert s.min() > 0.5 and s.max() < 1.3, s
    assert torch.equal(newton_schulz(torch.zeros(shape), 5), torch.zeros(shape))


@pytest.mark.parametrize("shape", [(8, 24), (12, 40), (40, 12)])
def test_the_gram_iteration_gives_the_plain_iteration(shape):
    """A wide (or tall) matrix iterates on its Gram matrix: the same values, up to rounding,
    as the iteration on the matrix itself, written out here."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = x if shape[0] <= shape[1] else x.T
    y0 = y = y / (torch.linalg.vector_norm(y) + 1e-7)  # as newton_schulz scales it
    for _ in range(5):
        gram = y @ y.T
        y = 3.4445 * y + (-4.7750 * gram + 2.0315 * gram @ gram) @ y
    expect = y if shape[0] <= shape[1] else y.T
    torch.testing.assert_close(newton_schulz(x, 5), expect, rtol=1e-9, atol=1e-10)
    q = gram_polynomial(y0.unsqueeze(0), 5)[0]  # the polynomial itself, applied to y0
    torch.testing.assert_close(q @ y0, y, rtol=1e-9, atol=1e-10)


def test_matrices_of_equal_or_transposed_shapes_share_one_iteration_with_the_same_result():
    """Packed layers of one shape (or transposed shapes) take one batched Newton-Schulz
    iteration; each gets the direction it gets alone, in every row (worker)."""
    shapes = [(16, 48), (48, 16), (8,), (16, 48), (24, 24), (16, 40)]
    matrices = [is_matrix(s, ORTHO) for s in shapes]
    assert matrices == [True, True, False, True, True, True]
    numels = [torch.Size(s).numel() for s in shapes]
    gen = torch.Generator().manual_seed(0)
    m1 = torch.randn(3, sum(numels), generator=gen, dtype=torch.float64)
    direction = torch.randn(3, sum(numels), generator=gen, dtype=torch.float64)
    got = shape_direction(ORTHO, shapes, direction, m1, None, matrices)[0].split(numels, dim=-1)
    for shape, matrix, m, dk, out in zip(shapes, matrices, m1.split(numels, -1),
                                         direction.split(numels, -1), got):  # fmt: skip
        alone = dk
        if matrix:
            z = ortho_input(m, m.square().mean(dim=-1, keepdim=True), None)
            alone = ortho_direction(ORTHO, shape, z)
        torch.testing.assert_close(out, alone, rtol=1e-9, atol=1e-12)


def test_which_tensors_are_matrices():
    assert is_matrix((64, 32), ORTHO) and not is_matrix((64, 32), NetConfig())
    assert not is_matrix((64,), ORTHO) and not is_matrix((8, 1, 3, 3), ORTHO)
    assert not is_matrix((1, 30), ORTHO)  # a row vector takes the Adam form
    assert not is_matrix((300, 1000), ORTHO)  # too costly to orthogonalise by default
    assert is_matrix((300, 1000), NetConfig(output="ortho", ortho_max_dim=300))
    with pytest.raises(ValueError, match="output must be one of"):
        NetConfig(output="sgd")


def _net(cfg):
    return LearnedOptimizerNet(cfg)  # zero output heads


def test_zero_heads_step_is_the_base_rule(tmp_path):
    """Matrices: lr * ortho_step_mult along NS(m1) at unit RMS; vectors: exactly Adam."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 20))
    b = torch.nn.Parameter(torch.randn(20))
    path = tmp_path / "ortho.pt"
    save_checkpoint(_net(ORTHO), path, {"name": "test"})
    opt = LearnedOptimizer([w, b], checkpoint=str(path), lr=0.5)
    adam = torch.optim.Adam([b0 := torch.nn.Parameter(b.detach().clone())], lr=0.5e-3)
    w0, m1 = w.detach().clone(), torch.zeros(12, 20)
    for _ in range(3):
        gw, gb = torch.randn(12, 20), torch.randn(20)
        w.grad, b.grad, b0.grad = gw, gb, gb.clone()
        m1 = 0.9 * m1 + 0.1 * gw
        expect = w0 - 0.5 * ORTHO.ortho_step_mult * unit_rms(newton_schulz(m1, 5), (-2, -1))
        opt.step()
        adam.step()
        torch.testing.assert_close(w.detach(), expect, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b.detach(), b0.detach(), rtol=1e-4, atol=1e-6)
        w0 = w.detach().clone()


def _random_theta(cfg, seed=1):
    net = _net(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in net.parameters():
            t.add_(0.3 * torch.randn(t.shape, generator=gen))
    return net.theta()


@pytest.mark.parametrize("normalize", [False, True])
def test_layouts_agree(normalize):
    """The flat step (many segments) and the in-place step (one tensor each) agree."""
    cfg = NetConfig(output="ortho", normalize=normalize)
    theta = _random_theta(cfg)
    gen = torch.Generator().manual_seed(2)
    shapes = [(6, 10), (10,), (4, 3, 3), (10, 6), (1, 7)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    layout = FlatLayout(tuple(map(str, range(len(shapes)))), tuple(shapes))
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts]).unsqueeze(0)  # noqa: E731
    state = init_flat_state(flat(params))
    new_p, _, _ = flat_step(
        theta, cfg, layout, flat(params), flat(grads), state["m"], state["v"], 1
    )
    # the in-place step, one tensor at a time
    ps = [p.clone() for p in params]
    states = [{**init_state(p), "step": torch.tensor(0.0)} for p in ps]
    step_tensors(theta, cfg, ALL_PARTS, ps, grads, states, torch.tensor(1.0))
    torch.testing.assert_close(flat(ps), new_p, rtol=1e-5, atol=1e-6)


def test_meta_gradient_flows_through_the_orthogonalisation_under_vmap():
    cfg = ORTHO
    theta = _random_theta(cfg)
    layout = FlatLayout(("w", "b"), ((5, 7), (7,)))
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(3, 42, generator=gen), torch.randn(3, 42, generator=gen)
    st = init_flat_state(p)

    def loss(th):
        step = vmap(
            lambda p_, g_, m_, v_: flat_step(
                th, cfg, layout, p_[None], g_[None], m_[None], v_[None], 1
            )[0][0]
        )
        return step(p, g, st["m"], st["v"]).square().sum()

    gr = grad(loss)(theta)
    assert all(torch.isfinite(t).all() for t in gr.values())
    assert gr["elem_out.weight"].abs().sum() > 0


REUSE = NetConfig(output="ortho", ns_every=2, ns_reuse_min_dim=8)


@pytest.mark.parametrize("shape", [(8, 24), (12, 12), (40, 12)])
def test_a_kept_polynomial_is_applied_to_the_new_input(shape):
    """Refreshed, the reusing iteration gives Newton-Schulz's values and keeps the Gram
    polynomial; not refreshed, it applies the kept polynomial to the new input at unit
    norm, in the input's own layout (a tall matrix on its transpose)."""
    gen = torch.Generator().manual_seed(3)
    x1, x2 = (torch.randn(2, *shape, generator=gen, dtype=torch.float64) for _ in range(2))
    r = min(shape)
    fresh, q = newton_schulz_reusing(x1, torch.zeros(2, r, r, dtype=torch.float64), True, 5)
    torch.testing.assert_close(fresh, newton_schulz(x1, 5), rtol=1e-9, atol=1e-10)
    reused, kept = newton_schulz_reusing(x2, q, False, 5)
    assert torch.equal(kept, q)
    wide = x2 if shape[0] <= shape[1] else x2.transpose(-1, -2)
    y = wide / torch.linalg.vector_norm(wide, dim=(-2, -1), keepdim=True)
    expect = q @ y
    expect = expect if shape[0] <= shape[1] else expect.transpose(-1, -2)
    torch.testing.assert_close(reused, expect, rtol=1e-6, atol=1e-9)
    as_tensor = newton_schulz_reusing(x2, q, torch.tensor(False), 5)  # the kernel's branch
    torch.testing.assert_close(as_tensor[0], reused)


def test_matrices_iterate_on_every_other_step_of_their_own():
    """Under ``ns_every=2``, steps 1, 3, 5... run Newton-Schulz; rows stepped together
    iterate when any of them is due."""
    assert [ns_due(REUSE, t) for t in range(1, 6)] == [True, False, True, False, True]
    assert ns_due(REUSE, torch.tensor([[2.0], [4.0]])) is False
    assert ns_due(REUSE, torch.tensor([[2.0], [3.0]])) is True
    assert all(ns_due(ORTHO, t) for t in range(1, 4))
    assert [reuses_gram(s, REUSE) for s in [(8, 24), (4, 24), (24,), (300, 300)]] == [
        True, False, False, False,
    ]  # fmt: skip


def test_the_optimizer_keeps_each_matrix_s_polynomial_between_iterations(tmp_path):
    """The optimizer holds ``q`` for the matrices that keep one (not for a small matrix, a
    vector or an embedding table), refreshes it on the due steps from the unit-norm
    orthogonalised input (the 0.9 momentum at zero heads) and keeps it between; the
    first step is Newton-Schulz's."""
    path = save_checkpoint(LearnedOptimizerNet(REUSE), tmp_path / "reuse.pt")
    plain_path = save_checkpoint(LearnedOptimizerNet(ORTHO), tmp_path / "plain.pt")
    gen = torch.Generator().manual_seed(4)
    shapes = [(8, 24), (24, 8), (4, 24), (24,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    table = torch.nn.Parameter(torch.randn(40, 8, generator=gen))  # an embedding's rows
    opt = LearnedOptimizer([*params, table], checkpoint=path, compile=False)
    ref = LearnedOptimizer(plain, checkpoint=plain_path, compile=False)
    kept = []
    for t in range(1, 5):
        for p, q in zip(params, plain):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        table.grad = torch.zeros_like(table)
        table.grad[:3] = 1.0
        opt.step()
        ref.step()
        if t == 1:
            for p, q in zip(params, plain):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        kept.append(opt.state[params[0]]["q"].clone())
        m = opt.state[params[0]]["m"][0]
        y = m / torch.linalg.vector_norm(m)
        if t % 2 == 1:
            torch.testing.assert_close(kept[-1], gram_polynomial(y[None], REUSE.ns_steps)[0])
        else:
            assert torch.equal(kept[-1], kept[-2])
    assert [("q" in opt.state[p]) for p in [*params, table]] == [True, True, False, False, False]
    assert opt.state[params[1]]["q"].shape == (8, 8)


def test_a_saved_polynomial_of_the_wrong_shape_is_refused(tmp_path):
    path = save_checkpoint(LearnedOptimizerNet(REUSE), tmp_path / "reuse.pt")
    p = torch.nn.Parameter(torch.randn(8, 24))
    opt = LearnedOptimizer([p], checkpoint=path, compile=False)
    p.grad = torch.randn(8, 24)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["q"] = torch.zeros(24, 24)
    with pytest.raises(ValueError, match="saved q"):
        opt.load_state_dict(saved)
    del saved["state"][0]["q"]  # saved before polynomials were kept: starts from I
    opt.load_state_dict(saved)
    p.grad = torch.randn(8, 24)
    opt.step()
    assert torch.equal(opt.state[p]["q"], torch.eye(8))


def test_a_config_that_stops_keeping_polynomials_drops_them(tmp_path):
    """A config transform under which a matrix no longer keeps a polynomial (here: no
    matrix is orthogonalised) steps it without one, and its ``q`` is dropped."""
    import dataclasses

    path = save_checkpoint(LearnedOptimizerNet(REUSE), tmp_path / "reuse.pt")
    p = torch.nn.Parameter(torch.randn(8, 24))
    opt = LearnedOptimizer([p], checkpoint=path, compile=False)
    p.grad = torch.randn(8, 24)
    opt.step()
    assert "q" in opt.state[p]
    opt.config_transform = lambda cfg: dataclasses.replace(cfg, output="adam")
    opt.step()
    assert "q" not in opt.state[p]


def test_a_non_finite_gradient_leaves_the_kept_polynomial_as_it_was():
    """A matrix whose gradient holds NaN is not stepped: its ``q`` stays, while the other
    matrix of the same flat step takes a new one."""
    layout = FlatLayout(("a", "b"), ((8, 24), (8, 24)))
    p = torch.randn(1, layout.size, generator=torch.Generator().manual_seed(5))
    g = torch.randn(1, layout.size, generator=torch.Generator().manual_seed(6))
    g[0, 3] = float("nan")
    state = init_flat_state(p, layout)
    q = torch.rand(1, 2 * 64, generator=torch.Generator().manual_seed(7))
    theta = {k: v.detach() for k, v in LearnedOptimizerNet(REUSE).named_parameters()}
    out = flat_step(theta, REUSE, layout, p, g, state["m"], state["v"], 1, q=q,
                    return_finite=True)  # fmt: skip
    new_q, ok = out[-2], out[-1]
    assert ok.tolist() == [[False, True]]
    assert torch.equal(new_q[:, :64], q[:, :64]) and not torch.equal(new_q[:, 64:], q[:, 64:])


NESTEROV = NetConfig(output="ortho", ns_reuse_min_dim=8, ortho_nesterov=0.1)


def test_wide_matrices_orthogonalise_the_nesterov_momentum():
    """A matrix at least ``ns_reuse_min_dim`` wide orthogonalises ``0.9 m1 + 0.1 g``: its
    step is the plain rule's step from a momentum that updates to exactly that; a narrower
    matrix and a vector take the plain rule's step, and a config without it selects none."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(8, 24), (4, 24), (24,)]
    layout = FlatLayout(("w", "narrow", "b"), tuple(shapes))
    n = layout.size
    p, g = (torch.randn(1, n, generator=gen, dtype=torch.float64) for _ in range(2))
    m = torch.randn(1, 3, n, generator=gen, dtype=torch.float64)
    v = torch.rand(1, n, generator=gen, dtype=torch.float64) + 0.1
    theta = LearnedOptimizerNet(NESTEROV).theta()
    takes = [mt and takes_nesterov(s, NESTEROV) for mt, s in zip(layout.matrices(NESTEROV), shapes)]
    assert takes == [True, False, False]
    assert not any(takes_nesterov(s, ORTHO) for s in shapes)
    m1 = 0.9 * m[:, 0] + 0.1 * g
    wide = slice(0, 8 * 24)
    nesterov = 0.9 * m1[:, wide] + 0.1 * g[:, wide]
    got = flat_step(theta, NESTEROV, layout, p, g, m, v, 2)[0]
    # the plain rule from the momentum m' whose update 0.9 m' + 0.1 g is the Nesterov input
    m_plain = m.clone()
    m_plain[:, 0, wide] = (nesterov - 0.1 * g[:, wide]) / 0.9
    plain = replace(NESTEROV, ortho_nesterov=0.0)
    want = flat_step(theta, plain, layout, p, g, m_plain, v, 2)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    unchanged = flat_step(theta, plain, layout, p, g, m, v, 2)[0]
    assert not torch.allclose(got[:, wide], unchanged[:, wide])
    torch.testing.assert_close(got[:, 8 * 24 :], unchanged[:, 8 * 24 :], rtol=0, atol=0)


def test_the_nesterov_weight_is_checked():
    with pytest.raises(ValueError, match="ortho_nesterov must be in"):
        NetConfig(output="ortho", ortho_nesterov=1.5)
