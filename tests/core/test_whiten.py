"""The whitened cosine of the step-size adaptation (``NetConfig.ortho_whiten``): the
cosine itself, its blend by width inside the step, its setting under gossip and the
shipped rule's values."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from learned_opt import LearnedOptimizerNet, MixingConfig, NetConfig, load_checkpoint
from learned_opt.config import split_config
from learned_opt.orthogonal import whitened_cosine
from learned_opt.segments import FlatLayout
from learned_opt.step import flat_step

REUSE = NetConfig(output="ortho", ortho_min_dim=8, ns_every=2, ns_reuse_min_dim=8,
                  lr_adapt_rate=0.2)  # fmt: skip


def _spectral(u: torch.Tensor, s: list[float], v: torch.Tensor) -> torch.Tensor:
    return u @ torch.diag(torch.tensor(s, dtype=u.dtype)) @ v.T


def _bases(rows: int, cols: int):
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, rows, generator=gen, dtype=torch.float64))
    return u, v


@pytest.mark.parametrize("tall", [False, True])
def test_the_whitened_cosine_weighs_every_singular_direction_alike(tall):
    """A gradient that opposes the momentum along its top singular direction and agrees
    along the three weak ones: the plain cosine is about -0.94 (the top direction decides),
    while in the basis where ``Q`` maps the momentum to ``U V^T`` each direction counts
    one quarter, (-1 + 3) / 4 = 0.5. A tall matrix takes ``Q`` from the right, transposed,
    and gives the same cosine."""
    u, v = _bases(4, 8)
    m = _spectral(u, [10.0, 1.0, 1.0, 1.0], v)
    g = _spectral(u, [-10.0, 1.0, 1.0, 1.0], v)
    q = _spectral(u, [0.1, 1.0, 1.0, 1.0], u)  # Q m = U V^T
    if tall:
        m, g = m.T, g.T
    plain = float((g * m).sum() / (g.norm() * m.norm()))
    white = whitened_cosine(g.unsqueeze(0), m.unsqueeze(0), q.unsqueeze(0))
    assert plain == pytest.approx(-97 / 103)
    assert white.shape == (1,)
    assert float(white[0]) == pytest.approx(0.5, abs=1e-12)
    identity = torch.eye(4, dtype=torch.float64).unsqueeze(0)
    same = whitened_cosine(g.unsqueeze(0), m.unsqueeze(0), identity)
    assert float(same[0]) == pytest.approx(plain, abs=1e-12)


def _step_log_lr(cfg: NetConfig, q: torch.Tensor, g: torch.Tensor, m1: torch.Tensor) -> float:
    """One flat step of a lone kept matrix (gradient ``g``, 0.9 momentum ``m1``, ``q`` its
    kept polynomial) from a warm state; its new log step multiplier (from 0)."""
    gen = torch.Generator().manual_seed(1)
    n = g.numel()
    p = 0.1 * torch.randn(1, n, generator=gen)
    m = torch.randn(1, 3, n, generator=gen)
    m[0, 0] = m1.reshape(-1)
    v = torch.full((1, n), 1e-4)  # a small running second moment: no brake on growth
    theta = dict(LearnedOptimizerNet(cfg).named_parameters())
    out = flat_step(
        theta, cfg, FlatLayout(("w",), (tuple(g.shape),)), p, g.reshape(1, -1), m, v, 10,
        1.0, log_lr=torch.zeros(1, 1), q=q.reshape(1, -1),
    )  # fmt: skip
    return float(out[3][0, 0])


def test_the_step_blends_the_two_cosines_by_the_matrix_s_width():
    """``ortho_whiten / k`` of the whitened cosine (here 8 / 16 = one half) and the rest of
    the plain one move the log multiplier, by the rate times the blend (the gradient is
    not small, so no brake); ``ortho_whiten=0`` is the plain rule, and a width of ``k`` or
    more reads the whitened cosine alone."""
    u, v = _bases(16, 32)
    spectrum = [10.0] + [1.0] * 15
    m1 = _spectral(u, spectrum, v).float()
    g = _spectral(u, [-10.0] + [1.0] * 15, v).float()
    q = _spectral(u, [1 / x for x in spectrum], u).float()
    plain = _step_log_lr(REUSE, q, g, m1)
    half = _step_log_lr(replace(REUSE, ortho_whiten=8.0), q, g, m1)
    full = _step_log_lr(replace(REUSE, ortho_whiten=16.0), q, g, m1)
    wider = _step_log_lr(replace(REUSE, ortho_whiten=64.0), q, g, m1)
    cos_plain = (-100 + 15) / (100 + 15)
    cos_white = (-1 + 15) / 16
    rate = REUSE.lr_adapt_rate
    assert plain == pytest.approx(rate * cos_plain, abs=1e-5)
    assert half == pytest.approx(rate * (cos_plain + cos_white) / 2, abs=1e-5)
    assert full == pytest.approx(rate * cos_white, abs=1e-5)
    assert wider == pytest.approx(full, abs=1e-7)


def test_under_gossip_the_whitening_width_is_the_gossip_one():
    cfg = replace(REUSE, ortho_whiten=64.0)
    assert MixingConfig().under_gossip(cfg).ortho_whiten == 64.0  # None: the rule's own
    off = MixingConfig(ortho_whiten_gossip=0.0).under_gossip(cfg)
    assert off.ortho_whiten == 0.0
    assert off.lr_adapt_max == MixingConfig().lr_adapt_max_gossip  # the other bounds too


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"ortho_whiten": -1.0}, "ortho_whiten"),
        ({"ortho_whiten": float("nan")}, "ortho_whiten"),
        ({"ortho_whiten": float("inf")}, "ortho_whiten"),
        ({"ortho_whiten_gossip": -1.0}, "ortho_whiten_gossip"),
        ({"ortho_whiten_gossip": float("nan")}, "ortho_whiten_gossip"),
    ],
)
def test_bad_whitening_widths_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        split_config(fields)


def test_the_shipped_rule_whitens_alone_and_not_under_gossip():
    net, _ = load_checkpoint("adapt_init_2x")
    assert net.config.ortho_whiten == 64.0
    assert net.mixing.under_gossip(net.config).ortho_whiten == 0.0


def test_meta_training_differentiates_through_the_whitened_cosine():
    """The unrolled inner optimizer (batched rows, as meta-training runs it) steps a kept
    matrix with the whitened cosine, and theta's gradient through it is finite."""
    from learned_opt.meta_train.inner import InnerOptimizer

    cfg = replace(REUSE, ortho_whiten=8.0)
    net = LearnedOptimizerNet(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in net.parameters():
            t.add_(0.05 * torch.randn(t.shape, generator=gen))
    theta = {k: v.detach().requires_grad_() for k, v in net.named_parameters()}
    layout = FlatLayout(("w", "b"), ((16, 24), (16,)))
    opt = InnerOptimizer("learned", theta=theta, cfg=cfg)
    p = 0.1 * torch.randn(2, layout.size, generator=gen)
    state = opt.init(p, layout)
    assert "q" in state
    for step in range(1, 5):
        p, state = opt.update(layout, p, torch.sin(3 * p) + p, state, step)
    p.square().sum().backward()
    grads = [t.grad for t in theta.values() if t.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    plain = InnerOptimizer("learned", theta=theta, cfg=REUSE)
    x0 = 0.1 * torch.randn(2, layout.size, generator=torch.Generator().manual_seed(0))
    runs = {}
    with torch.no_grad():
        for name, inner in (("white", opt), ("plain", plain)):
            x, s = x0, inner.init(x0, layout)
            for step in range(1, 5):
                x, s = inner.update(layout, x, torch.sin(3 * x) + x, s, step)
            runs[name] = s["log_lr"]
    assert not torch.equal(runs["white"], runs["plain"])  # the setting is read
