"""The compile-included wall-clock benchmark: its scoring and one side's run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import wallclock


def _row(horizon=6):
    return {"task": "t", "horizon": horizon, "side": "adapt_init_2x",
            "adamw": {"lr": 0.01, "schedule": "constant"}, "recorded_speedup": 1.0,
            "recorded_wall_speedup": 0.5}  # fmt: skip


def test_score_times_each_side_to_the_shared_level():
    """Both sides reach the worse of their best levels; the wall-clock speedup is the
    ratio of the seconds each took to get there, the step speedup that of the steps."""
    rule = {"curve": [4.0, 1.0, 1.0, 1.0, 1.0, 1.0], "seconds": [5.0, 5.1, 5.2, 5.3, 5.4, 5.5],
            "ready_step": None}  # fmt: skip
    adamw = {"curve": [4.0, 4.0, 4.0, 4.0, 1.0, 1.0], "seconds": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
             "ready_step": None}  # fmt: skip
    s = wallclock.score(_row(), rule, adamw)
    # smoothed (trailing mean of 10): the rule's best is its last value, AdamW's too
    assert s["steps_rule"] < s["steps_adamw"]
    assert s["speedup"] == pytest.approx(s["steps_adamw"] / s["steps_rule"], abs=1e-4)
    expected = adamw["seconds"][s["steps_adamw"] - 1] / rule["seconds"][s["steps_rule"] - 1]
    assert s["wall_speedup"] == pytest.approx(expected, abs=1e-4)
    assert s["wall_speedup"] < 1 < s["speedup"]  # fewer steps, but a slow start
    # at AdamW's step cost the fewer steps would have won: AdamW's clock at the rule's count
    paced = adamw["seconds"][s["steps_adamw"] - 1] / adamw["seconds"][s["steps_rule"] - 1]
    assert s["adamw_paced_wall_speedup"] == pytest.approx(paced, abs=1e-4)
    assert s["wall_speedup"] < 1 < s["adamw_paced_wall_speedup"]
    assert wallclock.summarise([s])["median_adamw_paced_wall_speedup"] == pytest.approx(
        s["adamw_paced_wall_speedup"]
    )


def test_paced_speedup_is_none_where_adamw_stopped_before_the_rules_step_count():
    """AdamW's run ended (a non-finite loss) after reaching the level but before the rule's
    step count: there is no clock of AdamW's to pace the rule's steps by."""
    rule = {"curve": [4.0, 3.0, 3.0, 1.0], "seconds": [1.0, 2.0, 3.0, 4.0], "ready_step": None}
    adamw = {"curve": [4.0, 2.0, float("inf"), float("inf")], "seconds": [1.0, 2.0],
             "ready_step": None}  # fmt: skip
    s = wallclock.score(_row(horizon=4), rule, adamw)
    assert (s["steps_rule"], s["steps_adamw"]) == (4, 2)  # past the end of AdamW's clock
    assert s["adamw_paced_wall_speedup"] is None
    assert wallclock.summarise([s])["median_adamw_paced_wall_speedup"] is None


def test_score_cuts_the_curves_to_the_row_horizon():
    rule = {"curve": [4.0, 3.0, 0.0, 0.0], "seconds": [1.0, 2.0, 3.0, 4.0], "ready_step": 3}
    adamw = {"curve": [4.0, 3.0, 2.0, 2.0], "seconds": [1.0, 2.0, 3.0, 4.0], "ready_step": None}
    s = wallclock.score(_row(horizon=2), rule, adamw)
    assert s["steps_rule"] == s["steps_adamw"] == 2 and s["wall_speedup"] == 1.0


def test_a_diverged_side_scores_zero_and_the_table_says_so():
    """As the suites' step speedups: no common level when a side diverged (its smoothed
    curve is all inf), so both speedups are 0 and no seconds are recorded."""
    from benchmarks.report_speed import render_wallclock

    rule = {"curve": [float("inf")] * 3, "seconds": [1.0, 2.0, 3.0], "ready_step": None}
    adamw = {"curve": [4.0, 3.0, 2.0], "seconds": [1.0, 2.0, 3.0], "ready_step": None}
    s = wallclock.score(_row(horizon=3), rule, adamw)
    assert s["speedup"] == s["wall_speedup"] == 0.0
    assert s["seconds_rule"] is s["seconds_adamw"] is None
    r = {"rows": [s], "summary": wallclock.summarise([s]), "cache": "empty", "timing_seed": 0,
         "threads": 1, "compile_after_seconds": 10.0, "source": "x.json", "wall_seconds": 60,
         "command": "c", "date": "2026-12-03", "machine": "m", "torch": "t"}  # fmt: skip
    assert "| a run diverged |" in render_wallclock(r)


def test_rows_of_a_recorded_suite(tmp_path, monkeypatch):
    recorded = {"single": [
        {"task": "a", "horizon": 200, "side": "adapt_init_2x", "speedup": 1.2,
         "wall_speedup": 0.6, "adamw_by_seed": [{"lr": 0.1, "schedule": "cosine"}]},
        {"task": "b", "horizon": 1000, "side": "adapt_init_2x", "speedup": 0.9,
         "adamw_by_seed": [{"lr": 0.01, "schedule": "constant"}]},
    ]}  # fmt: skip
    (tmp_path / "quality_heldout.json").write_text(json.dumps(recorded))
    monkeypatch.setattr(wallclock, "RESULTS", tmp_path)
    rows = wallclock.rows_of("heldout", ["a"])
    assert rows == [{"task": "a", "horizon": 200, "side": "adapt_init_2x",
                     "adamw": {"lr": 0.1, "schedule": "cosine"}, "recorded_speedup": 1.2,
                     "recorded_wall_speedup": 0.6}]  # fmt: skip


def test_repeats_take_turns_and_each_side_is_timed_by_its_median(monkeypatch):
    calls = []
    slow = {"rule": [[1.0, 2.0, 9.0], [1.0, 3.0, 4.0], [2.0, 4.0, 6.0]],
            "adamw": [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 2.0, 3.0]]}  # fmt: skip
    ready = {"rule": [None, 3, 2], "adamw": [None, None, None]}

    def fake_run(spec, cache):
        side = "rule" if spec["side"] != "adamw" else "adamw"
        k = sum(1 for c in calls if c == side)
        calls.append(side)
        return {"curve": [4.0, 3.0, 2.0], "seconds": slow[side][k], "ready_step": ready[side][k]}

    monkeypatch.setattr(wallclock, "run_fresh", fake_run)
    (row,) = wallclock.measure([_row(horizon=3)], log=lambda _: None, repeats=3, cache="empty")
    assert calls == ["rule", "adamw"] * 3  # the repeats take turns, not one side's three
    assert row["seconds_rule"] == 6.0 and row["seconds_adamw"] == 3.0  # medians of the 3rd step
    assert row["wall_speedup"] == 0.5 and row["speedup"] == 1.0
    assert row["kernel_ready_step"] == 2 and row["kernel_ready_steps"] == [None, 3, 2]


def test_a_machine_that_has_built_before_fills_one_cache_that_every_rule_run_copies(
    monkeypatch,
):
    seen = []

    def fake_run(spec, cache):
        folder = Path(cache)
        if spec.get("fill"):
            (folder / "kernel").mkdir()
            (folder / "kernel" / "package").write_text("built")
        else:
            seen.append((spec["side"], (folder / "kernel" / "package").is_file()))
            (folder / "scratch").write_text("a timed run's own files")
        return {"curve": [4.0, 3.0, 2.0], "seconds": [1.0, 2.0, 3.0], "ready_step": 1}

    monkeypatch.setattr(wallclock, "run_fresh", fake_run)
    wallclock.measure([_row(horizon=3)], log=lambda _: None, repeats=2)
    rule = [ok for side, ok in seen if side != "adamw"]
    assert rule == [True, True]  # every timed rule run starts from the filled cache
    assert [ok for side, ok in seen if side == "adamw"] == [False, False]


def test_repeats_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        wallclock.main(["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_one_side_runs_and_records_cumulative_seconds():
    out = wallclock.child({"task": "heldout_logreg_l2", "side": "adamw", "lr": 0.01,
                           "schedule": "constant", "steps": 5})  # fmt: skip
    assert len(out["curve"]) == len(out["seconds"]) == 5
    assert all(a < b for a, b in zip(out["seconds"], out["seconds"][1:]))
    assert out["ready_step"] is None


def test_the_tables_say_how_often_each_side_trained():
    from benchmarks import report_speed

    r = {"timing_seed": 0, "cache": "empty",
         "summary": {"median_wall_speedup": 1.1, "median_speedup": 1.4}}  # fmt: skip
    assert "trained once in a new process" in report_speed.render_wallclock_headline(r)
    text = report_speed.render_wallclock_headline({**r, "repeats": 3})
    assert (
        "trained 3 times, each in a new process, the repeats taking turns, and timed by the median"
        in text
    )
