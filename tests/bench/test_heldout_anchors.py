"""benchmarks/heldout_anchors.py: anchors scored against the held-out suite's tuned AdamW."""

import json

import pytest

from benchmarks import heldout_anchors as ha
from benchmarks import report_heldout
from benchmarks.report_heldout import render_anchors_headline, render_heldout_anchors

CURVE_FAST = [1.0 / (t + 1) for t in range(200)]
CURVE_SLOW = [2.0 / (t + 1) for t in range(200)]
CACHE = {
    "single|task_a|constant|0.001|2000|0": CURVE_SLOW * 10,  # cut to the horizon
    "single|task_a|cosine|0.01|200|0": CURVE_FAST,  # the best at 200 steps
    "single|task_a|cosine|0.01|200|1": CURVE_SLOW,  # another seed
    "single|task_b|cosine|0.01|200|0": CURVE_SLOW,  # another task
}


def test_adamw_runs_are_the_tasks_and_seeds_own():
    assert set(ha.adamw_runs(CACHE, "task_a", 0)) == {"constant|0.001|2000", "cosine|0.01|200"}


def test_an_anchor_as_fast_as_the_best_tuned_run_scores_one_and_a_slower_one_less():
    assert ha.score(CACHE, "task_a", 200, 0, CURVE_FAST) == pytest.approx(1.0)
    assert ha.score(CACHE, "task_a", 200, 0, CURVE_SLOW) < 1.0


def test_a_missing_tuned_run_stops_with_one_line():
    with pytest.raises(SystemExit, match="no tuned AdamW run of task_c"):
        ha.score(CACHE, "task_c", 200, 0, CURVE_FAST)


def test_the_table_and_the_headline_line_name_every_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(report_heldout, "RESULTS", tmp_path)  # no suite results: as saved
    anchors = {"schedulefree_adamw": 0.5, "prodigy_constant": 0.8, "muon_adamw": 0.4}
    r = {
        "rows": [{"task": "heldout_char_lm", "horizon": 200, "learned": 2.0, "anchors": anchors}],
        "summary": {"median_speedup": anchors, "learned_median_speedup": 2.0,
                    "learned_side": "adapt_init_2x"},
        "seeds": [0], "wall_seconds": 60, "command": "python -m benchmarks.heldout_anchors",
        "date": "2026-12-03", "machine": "x86_64", "torch": "2.13.0",
    }  # fmt: skip
    table, line = render_heldout_anchors(r), render_anchors_headline(r)
    assert "| char_lm | 200 | 2.00x | 0.50x | 0.80x | 0.40x |" in table
    assert "schedule-free AdamW 0.50x" in line and "`adapt_init_2x` 2.00x" in line
    # the rule's column follows the suite's latest results, the anchors stay
    suite = {"date": "2026-12-04", "single": [
        {"task": "heldout_char_lm", "horizon": 200, "side": "adapt_init_2x", "speedup": 3.0},
        {"task": "heldout_char_lm", "horizon": 200, "side": "other", "speedup": 9.0},
    ]}  # fmt: skip
    (tmp_path / "quality_heldout.json").write_text(json.dumps(suite))
    table, line = render_heldout_anchors(r), render_anchors_headline(r)
    assert "| char_lm | 200 | 3.00x | 0.50x | 0.80x | 0.40x |" in table
    assert "measured 2026-12-04" in table and "`adapt_init_2x` 3.00x" in line


def test_without_the_suites_results_it_stops_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ha, "RESULTS", tmp_path)
    with pytest.raises(SystemExit):
        ha.main(["--seeds", "0"])
    assert "run the suite first" in capsys.readouterr().err
