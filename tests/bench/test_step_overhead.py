"""The step-cost benchmark's Muon row: torch's Muon takes exactly the matrices the shipped
rule orthogonalises, so the two orthogonalised steps are compared on the same work."""

from __future__ import annotations

import sys
from pathlib import Path

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
    adamw, muon = pair.optimizers
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
    opts = so.optimizers(params_of, "cpu", eager=False, no_ortho=True)
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
