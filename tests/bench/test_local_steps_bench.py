"""The long-run local-steps benchmark: its choice and a smoke run's JSON and plot."""

from __future__ import annotations

import json

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
