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


def test_a_sample_is_the_mean_of_a_period_of_steps():
    """A step whose time alternates is timed as the mean over ``PERIOD`` steps in a row, not
    as the median of single steps (which would report the slower half)."""
    times = iter([0.001, 0.003] * 50)
    steps = {"alternating": lambda: {"step": next(times)}}
    got = so.time_turns(steps, warmup=1, repeats=5)["alternating"]["step"]
    assert so.PERIOD == 2 and got == pytest.approx(2.0)
