"""The reporting draw: the tuned AdamW baseline (its grid extended at an edge), the scores and
the summary, and one whole run on short draws."""

import dataclasses

import pytest

from benchmarks import report_draw as rd
from benchmarks import rules
from learned_opt.tasks.distribution import draw


def flat(level, n=20):
    return {"curve": [float(level)] * n, "seconds": 1.0}


def test_the_grid_is_extended_where_its_best_sits_at_an_edge():
    runs = {s: flat(1.0) for s in rd.ADAMW_SIDES}
    assert rd.edge(runs) == pytest.approx(rd.ADAMW_LRS[0] / 3)  # a tie goes to the first name
    runs["adamw:0.03:cosine"] = flat(0.5)
    assert rd.edge(runs) == pytest.approx(0.09)
    runs.update({"adamw:0.09": flat(0.4), "adamw:0.09:cosine": flat(0.6)})
    assert rd.edge(runs) == pytest.approx(0.27)
    runs.update({"adamw:0.27": flat(0.3), "adamw:0.27:cosine": flat(0.6)})
    assert rd.edge(runs) is None  # twice at most
    inner = {s: flat(1.0) for s in rd.ADAMW_SIDES} | {"adamw:0.001": flat(0.5)}
    assert rd.edge(inner) is None


def test_the_entry_keeps_the_best_curve_and_the_anchors_speedups():
    runs = {s: flat(1.0) for s in rd.ADAMW_SIDES}
    runs["adamw:0.003"] = {"curve": [2.0] * 10 + [0.5] * 10, "seconds": 1.0}
    runs["sfadamw"] = {"curve": [2.0] * 5 + [0.5] * 15, "seconds": 1.0}  # 5 steps sooner
    runs["prodigy"] = {"curve": [2.0] * 5 + [float("inf")] * 15, "seconds": 1.0}
    runs["muon"] = runs["adamw:0.003"]
    entry = rd.baseline_entry(runs)
    assert entry["best"] == "adamw:0.003" and entry["curve"] == runs["adamw:0.003"]["curve"]
    assert entry["anchors"]["sfadamw"] == pytest.approx(20 / 15)
    assert entry["anchors"]["prodigy"] == 0.0  # diverged
    assert entry["anchors"]["muon"] == 1.0


def test_the_summary_names_the_worst_kind_and_the_anchors():
    rows = [{"kind": "mlp", "rule": 2.0, "time": 1.0, "rule_diverged": False, "sfadamw": 0.5, "prodigy": 1.0, "muon": 0.0},
            {"kind": "rnn", "rule": 0.5, "time": 0.25, "rule_diverged": False, "sfadamw": 1.0, "prodigy": 1.0, "muon": 1.0}]  # fmt: skip
    s = rd.summary(rows)
    assert s["geomean"]["rule"] == pytest.approx(1.0) and s["won"] == 0.5
    assert s["geomean"]["time"] == pytest.approx(0.5) and s["kinds"]["rnn"]["time"] == 0.25
    assert s["worst_kind"] == "rnn" and not s["ahead_of_every_anchor_on_every_kind"]
    assert s["kinds"]["mlp"]["muon"] == pytest.approx(1 / 20)  # a diverged anchor counts 1/20


def test_one_whole_report_on_short_draws(tmp_path, monkeypatch):
    short = lambda seed: dataclasses.replace(draw(seed), horizon=15)  # noqa: E731
    monkeypatch.setattr(rd, "draw", short)
    monkeypatch.setattr(rd, "CACHE", tmp_path / "cache.json.gz")
    monkeypatch.setattr(rd, "ADAMW_SIDES", rd.adamw_sides((1e-3, 1e-2)))
    monkeypatch.setattr(rd, "write_json", lambda name, payload, quiet=False: payload)
    monkeypatch.setattr(rd, "read_cache", lambda path=None: {})
    monkeypatch.setattr(rd, "write_cache", lambda cache, path=None: None)
    out = rd.main(["--draws", "2", "--jobs", "1", "--side", "adamw:0.003"])
    assert [r["seed"] for r in out["rows"]] == [0, 1]
    assert set(out["summary"]["geomean"]) == {"rule", "time", *rules.ANCHORS}
    assert all(r["adamw"].startswith("adamw:") for r in out["rows"])
    assert all(r["adamw_seconds"] > 0 for r in out["rows"])
    assert all((r["time"] > 0) != r["rule_diverged"] for r in out["rows"])
    assert out["of"] == rd.DRAWS


def test_a_row_scores_time_from_the_runs_made_side_by_side(monkeypatch):
    base = {"best": "adamw:0.001", "curve": [2.0] * 10 + [0.5] * 10, "anchors": {"muon": 1.5}}
    rule = {"curve": [2.0] * 5 + [0.5] * 15, "seconds": 4.0}  # 5 steps sooner, 2x the cost
    r = rd.row(3, {"rule": rule, "adamw": {"curve": base["curve"], "seconds": 2.0}}, base)
    assert r["rule"] == pytest.approx(20 / 15)  # as the anchors' score of the same curves
    assert r["time"] == pytest.approx(r["rule"] / 2) and r["muon"] == 1.5
    broken = {"curve": [2.0] * 5 + [float("inf")] * 15, "seconds": 1.0}
    r = rd.row(3, {"rule": broken, "adamw": {"curve": base["curve"], "seconds": 2.0}}, base)
    assert r["rule"] == 0.0 and r["time"] == 0.0 and r["rule_diverged"]


def _edge_run(seed, side):
    """Seed 0's best AdamW run sits at the grid's top edge; every other seed's inside it."""
    lr = float(side.split(":")[1]) if side.startswith("adamw:") else 0.0
    final = 0.5 - lr if seed == 0 else 0.5 if lr == 1e-3 else 1.0
    return {"curve": [2.0] * 5 + [final] * 15, "seconds": 0.1}


def test_draws_complete_in_order_with_their_extensions_first(monkeypatch):
    """A draw's extension runs before the next draw's runs, so a stopped fill keeps every
    draw before the one in flight."""
    monkeypatch.setattr(rd, "_run", _edge_run)
    monkeypatch.setattr(rd, "write_cache", lambda cache, path=None: None)
    logs, cache = [], {}
    rd.fill_cache([0, 1, 2], 1, cache, log=logs.append)
    assert [line.split()[2] for line in logs[1:]] == ["0", "1", "2"]
    assert cache[draw(0).describe()]["best"] == "adamw:0.27"  # extended twice, to 0.09 then 0.27
