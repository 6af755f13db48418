"""benchmarks/registry_sides.py: the tuned rates it reads, its scoring and its refusals
(no training runs here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import registry_sides as rs
from benchmarks.report_sections import render_registry_sides


def _tuned(tmp_path, monkeypatch):
    rows = [
        {"task": t, "h200": {"best_lr": {"adam": 0.01, "sgd": 0.1}},
         "h2000": {"best_lr": {"adam": 0.003, "sgd": 0.1}}}
        for t in ("digits_mlp", "char_gru")
    ]  # fmt: skip
    path = tmp_path / "quality_single.json"
    path.write_text(json.dumps({"tasks": rows}))
    monkeypatch.setattr(rs, "TUNED", path)


def test_tuned_rates_skip_the_slow_task_unless_named(tmp_path, monkeypatch):
    _tuned(tmp_path, monkeypatch)
    rates = rs.tuned_rates(None)
    assert list(rates) == ["digits_mlp"]
    assert rates["digits_mlp"][2000] == {"adam": 0.003, "sgd": 0.1}
    assert list(rs.tuned_rates(["char_gru"])) == ["char_gru"]
    with pytest.raises(SystemExit, match="no tuned rates"):
        rs.tuned_rates(["wine_mlp"])


def test_missing_tuning_record_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(rs, "TUNED", tmp_path / "absent.json")
    with pytest.raises(SystemExit, match="quality_single.py first"):
        rs.tuned_rates(None)


def test_score_takes_the_best_baseline_per_seed_and_the_median():
    rates = {"t": {200: {"adam": 0.01, "sgd": 0.1}, 2000: {"adam": 0.01, "sgd": 0.1}}}
    slow = [1.0 - i / 4000 for i in range(2000)]  # reaches 0.5 at the last step
    fast = [1.0 - i / 2000 for i in range(1000)] + [0.5] * 1000  # reaches 0.5 at step 1000
    never = [1.0] * 2000
    curves = {}
    for s in (0, 1, 2):
        curves[rs.baseline_key("t", "adam", 0.01, s)] = slow
        curves[rs.baseline_key("t", "sgd", 0.1, s)] = never
        curves[("side", "a", "t", s)] = fast if s < 2 else slow
    sides = [("a", "adapt_init", {})]
    rows = rs.score(curves, rates, sides, [0, 1, 2])
    long = next(r for r in rows if r["horizon"] == 2000)
    assert long["speedup_by_seed"][2] == pytest.approx(1.0)  # the same curve
    assert long["speedup_by_seed"][0] == pytest.approx(2.0, rel=0.02)  # half the steps
    assert long["speedup"] == long["speedup_by_seed"][0]  # the median of 2, 2, 1
    assert all(r["diverged"] == 0 for r in rows)
    summary = rs.summarise(rows, sides)["a"]
    assert summary["median_speedup_h2000"] == long["speedup"]
    payload = {"sides": [{"label": "a", "checkpoint": "adapt_init", "fields": {}}],
               "rows": rows, "summary": {"a": summary}, "seeds": [0, 1, 2],
               "tuned_from": "quality_single.json", "wall_seconds": 60.0, "command": "c"}  # fmt: skip
    text = render_registry_sides(payload)
    assert f"| t | 2000 | {long['speedup']:.2f}x |" in text and "rows below 0.8x" in text
    assert "| **diverged runs** |  | 0 |" in text


def test_duplicate_labels_and_bad_fields_are_refused():
    with pytest.raises(SystemExit):
        rs.main(["--side", "a=adapt_init", "--side", "a=adapt_init"])
    for bad in ("no_such_field=1", "lr_adapt_rate=-1"):
        with pytest.raises(SystemExit):
            rs.main(["--side", f"a=adapt_init:{bad}"])
    with pytest.raises(SystemExit):
        rs.main(["--side", "a=no_such_checkpoint"])


def test_a_side_runs_alone_with_its_config_replaced():
    opt = rs._optimizer(("a", "adapt_init", {"step_mult": 2e-3}), "learned", 1.0)
    assert opt.kind == "learned" and opt.mixing == "none" and opt.cfg.step_mult == 2e-3
    base = rs._optimizer(None, "adam", 0.01)
    assert base.kind == "adam" and base.mixing == "none"
