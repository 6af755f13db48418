"""The long-run local-steps benchmark: its choice and a smoke run's JSON and plot."""

from __future__ import annotations

import json

import pytest

from benchmarks import common
from benchmarks import local_steps as bench


def _row(task, rule, lr, h, ratio, fewer):
    return {"task": task, "rule": rule, "lr": lr, "H": h, "compression": "topk:0.02:4",
            "loss_ratio": ratio, "bytes_reduction_x": fewer, "final": ratio,
            "passes": fewer >= 100 and ratio <= 1.05}  # fmt: skip


def test_choose_takes_the_lowest_worst_ratio_among_variants_sending_few_enough_bytes():
    rows = [_row("a", "demo", 1.0, 10, 1.01, 90.0), _row("b", "demo", 1.0, 10, 1.0, 300.0),
            _row("a", "demo", 1.0, 25, 1.04, 200.0), _row("b", "demo", 1.0, 25, 1.10, 600.0),
            _row("a", "demo", 1.0, 50, 1.20, 400.0), _row("b", "demo", 1.0, 50, 1.02, 900.0)]  # fmt: skip
    best = bench.choose(rows, ("H",))
    assert best["H"] == 25  # H 10 sends too many bytes on "a"; H 50's worst is higher
    assert best["max_loss_ratio"] == 1.10 and best["min_bytes_reduction_x"] == 200.0
    assert bench.choose(rows[:1], ("H",)) is None


def test_quick_run_writes_bytes_and_loss_side_by_side_and_the_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    assert bench.main(["--quick", "--out", "quick"]) == 0
    data = json.loads((tmp_path / "quick.json").read_text())
    assert set(data["validation"]["chosen"]) >= {"H", "compression", "nesterov", "demo"}
    rows = data["heldout"]["rows"]
    assert {r["rule"] for r in rows} == {"nesterov", "learned", "demo"}
    for r in rows:
        assert r["bytes_reduction_x"] == r["exact_bytes_per_rank"] / r["bytes_per_rank"] > 1
        assert r["loss_ratio"] == r["final"] / r["exact_final"]
    assert (tmp_path / "quick.png").stat().st_size > 0
    # the held-out rows again, nothing chosen: the same losses to the bit, the bytes replaced
    assert bench.main(["--remeasure-bytes", "--out", "quick"]) == 0
    again = json.loads((tmp_path / "quick.json").read_text())["heldout"]
    for a, b in zip(rows, again["rows"]):
        assert (a["final"], a["bytes_per_rank"]) == (b["final"], b["bytes_before"])
        assert b["bytes_per_rank"] == a["bytes_per_rank"]  # the encoding has not changed since
    assert "remeasure-bytes" in again["bytes_remeasured"]["command"]
    # one rule's held-out rows once more (at its default, the quick grid's lr): the others stay
    assert bench.main(["--rerun-heldout", "learned", "--out", "quick"]) == 0
    rerun = json.loads((tmp_path / "quick.json").read_text())["heldout"]
    mine = [[r for r in x["rows"] if r["rule"] == "learned"] for x in (again, rerun)]
    assert [r for r in rerun["rows"] if r["rule"] != "learned"] == [
        r for r in again["rows"] if r["rule"] != "learned"
    ]
    assert [r["final"] for r in mine[1]] == [r["final"] for r in mine[0]]  # same rule and lr
    assert rerun["reruns"][0]["rows_before"] == mine[0]
    data["heldout"]["rows"][0]["final"] += 1e-6  # a loss that does not come out as recorded
    (tmp_path / "quick.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="recorded"):
        bench.main(["--remeasure-bytes", "--out", "quick"])
