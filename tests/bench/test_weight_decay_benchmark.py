"""benchmarks.weight_decay: the splits are fixed and disjoint, decay shrinks the matrices
it is given, and the record holds a row per problem, optimizer and decay."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import common
from benchmarks import weight_decay as wd


def test_the_problems_hold_fixed_standardised_splits():
    first, again = wd.problems(), wd.problems()
    for name, (x, y, x_test, y_test, classes) in first.items():
        assert len(x) == wd.TRAIN and len(x_test) == wd.TOTAL - wd.TRAIN
        assert torch.equal(x, again[name][0]) and torch.equal(y_test, again[name][3])
        assert torch.allclose(x.mean(0), torch.zeros(x.shape[1]), atol=1e-5)
        assert classes == int(torch.cat([y, y_test]).max()) + 1 >= 2


@pytest.mark.parametrize("side", ["learned", "adamw"])
def test_decay_shrinks_the_matrices_of_either_optimizer(side):
    data = wd.problems()["hastie_10_2"]
    plain = wd.train(data, side, 0.0, seed=0, steps=30)
    decayed = wd.train(data, side, 1.0, seed=0, steps=30)
    assert decayed["matrix_norm"] < plain["matrix_norm"]
    assert 0.0 <= decayed["test_accuracy"] <= 1.0


def test_the_record_has_every_side(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    out = wd.main(["--steps", "2", "--seeds", "1", "--out", "wd"])
    saved = json.loads((tmp_path / "wd.json").read_text())
    assert saved["rows"] == out["rows"] and len(out["rows"]) == 2 * 2 * len(wd.DECAYS)
    assert {(r["side"], r["weight_decay"]) for r in out["rows"]} == {
        (s, d) for s in ("learned", "adamw") for d in wd.DECAYS
    }
    assert saved["command"].endswith("--steps 2 --seeds 1 --out wd")
    with pytest.raises(SystemExit):
        wd.main(["--steps", "0"])
