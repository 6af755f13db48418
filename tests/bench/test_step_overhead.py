"""The step-cost benchmark's Muon row: torch's Muon takes exactly the matrices the shipped
rule orthogonalises, so the two orthogonalised steps are compared on the same work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import step_overhead as so  # noqa: E402
from learned_opt import LearnedOptimizer  # noqa: E402


def test_muon_takes_the_matrices_the_rule_orthogonalises():
    params = so.make_params(so.transformer_shapes(vocab=300, d=32, layers=1))
    cfg = LearnedOptimizer(params).config
    pair = so.muon_adamw(params, cfg)
    adamw, muon = pair.opts
    taken = {id(p) for p in muon.param_groups[0]["params"]}
    assert isinstance(muon, torch.optim.Muon)
    assert taken and len(taken) + len(adamw.param_groups[0]["params"]) == len(params)
    for p in params:  # 32-wide matrices are orthogonalised; vectors and the rest are not
        assert (id(p) in taken) == (p.dim() == 2 and cfg.ortho_min_dim <= min(p.shape))
    before = [p.detach().clone() for p in params]
    pair.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_the_no_ortho_side_steps_every_matrix_in_the_adam_form():
    """``learned_no_ortho`` is the shipped rule with orthogonalisation off: its first step
    on a matrix is Adam's first step (sign of the gradient times the step size), which the
    orthogonalised step is not."""
    torch.manual_seed(0)
    params_of = lambda: so.make_params([(32, 32), (32,)])  # noqa: E731
    opts = so.optimizers(params_of, "cpu", eager=False, variants=["learned_no_ortho"])
    rule, plain = opts["learned_no_ortho"], opts["learned_default"]
    moved = {}
    for name, opt in (("no_ortho", rule), ("default", plain)):
        p = opt.param_groups[0]["params"][0]
        before = p.detach().clone()
        opt.step()
        moved[name] = (p.detach() - before) / p.grad.sign()
    spread = {k: float(m.std() / m.mean().abs()) for k, m in moved.items()}
    assert (moved["no_ortho"] < 0).all() and spread["no_ortho"] < 0.01  # one size: Adam's
    assert spread["default"] > 0.1  # the orthogonalised step


def test_the_every_step_side_iterates_where_the_shipped_rule_reuses_its_polynomial():
    """``learned_ns_every_step`` is the shipped rule with Newton-Schulz at every step: the
    same first step on a matrix at least 64 wide, another second step (the shipped rule
    applies the polynomial it kept), and no ``q`` in its state."""
    torch.manual_seed(0)
    params_of = lambda: so.make_params([(64, 96), (96,)])  # noqa: E731
    opts = so.optimizers(params_of, "cpu", eager=False, variants=["learned_ns_every_step"])
    every, shipped = opts["learned_ns_every_step"], opts["learned_default"]
    p, q = (o.param_groups[0]["params"][0] for o in (every, shipped))
    every.step()
    shipped.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    grad = torch.randn(p.shape) * 1e-3
    p.grad, q.grad = grad.clone(), grad.clone()
    every.step()
    shipped.step()
    assert (p.detach() - q.detach()).abs().max() > 1e-5
    assert "q" in shipped.state[q] and "q" not in every.state[p]


def test_a_sample_is_the_mean_of_a_period_of_steps():
    """A step whose time alternates is timed as the mean over ``PERIOD`` steps in a row, not
    as the median of single steps (which would report the slower half)."""
    times = iter([0.001, 0.003] * 50)
    steps = {"alternating": lambda: {"step": next(times)}}
    got = so.time_turns(steps, warmup=1, repeats=5)["alternating"]["step"]
    assert so.PERIOD == 2 and got == pytest.approx(2.0)
