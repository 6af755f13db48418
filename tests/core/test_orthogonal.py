"""The "ortho" output parameterisation: Newton-Schulz, the zero-heads rule, both layouts."""

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
    ortho_direction,
    ortho_input,
    shape_direction,
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
    got = shape_direction(ORTHO, shapes, direction, m1, None, matrices).split(numels, dim=-1)
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
