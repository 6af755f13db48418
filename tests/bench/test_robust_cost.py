"""benchmarks.robust_cost: the robust and the plain mix agree when nobody attacks, and the
record says what the robust one adds."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import common
from benchmarks import robust_cost as rc


def test_close_neighbours_are_not_clipped_so_both_mixes_agree():
    ys, nbs, weights = rc.tensors()
    fns, targets = rc.sides(ys, nbs, weights, compiled=False)
    fns["plain"]()
    fns["robust"]()
    for plain, robust, y in zip(targets["plain"], targets["robust"], ys):
        # scale 1 for every neighbour: the same mix (its weights rounded to float32 once)
        assert torch.allclose(plain, robust, rtol=1e-6, atol=1e-9)
        assert not torch.equal(plain, y)  # and it mixed
    assert fns["distances"]().shape == (rc.NEIGHBOURS, len(rc.SHAPES))
    assert fns["state_distances"]().shape == (rc.NEIGHBOURS, 2 * len(rc.SHAPES))


def test_the_record_sets_the_extra_cost_against_a_ranks_share(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    (tmp_path / "gossip_step.json").write_text(json.dumps({"step_ms": {rc.STEP_ROW: 20.0}}))
    assert rc.main(["--rounds", "1", "--calls", "1", "--no-compiled", "--out", "rc"]) == 0
    out = json.loads((tmp_path / "rc.json").read_text())
    assert set(out["ms"]) == {"plain", "robust", "distances", "state_distances"}
    assert out["rank_share_ms"] == 10.0  # 4 ranks on 2 cores
    assert out["extra_of_step"]["robust"] == pytest.approx(
        out["extra_ms"]["robust"] / 10.0, abs=1e-3
    )
    with pytest.raises(SystemExit):
        rc.main(["--rounds", "0"])
