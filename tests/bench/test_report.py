"""The generated pages: markers with views and arguments, and the step-cost tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import report, report_speed  # noqa: E402

NEW_ROW = {
    "workload": "w", "params": 10, "tensors": 2, "load": "as is", "threads": 1,
    "adamw_foreach_step_ms": 1.0, "learned_default_step_ratio": 4.0,
    "learned_default_train_ratio": 1.5, "learned_reference_step_ratio": 12.0,
}  # fmt: skip
MACHINE = {"processor": "x86_64", "cpu_count": 2, "torch": "2.13.0+cpu"}


def _result(row: dict, **extra) -> dict:
    return {"rows": [row], "machine": MACHINE, "date": "2026-12-01", "command": "c", **extra}


def test_step_tables_name_their_columns_and_the_first_steps():
    new = report_speed.render_step_overhead(
        _result(NEW_ROW, cold_start={"first_step_seconds": 0.4})
    )
    assert "eager reference: step / AdamW" in new and "the first step took 0.4 s" in new
    assert "learned_reference" not in new  # private names
    brief = report_speed.render_step_overhead_brief(_result(NEW_ROW))
    assert "| w | 10 | 1 | 4.0x | 1.50x |" in brief


def test_the_cold_start_says_when_and_what():
    cold = {"first_step_seconds": 0.04, "note": "Another run took longer."}
    text = report_speed.render_step_overhead(_result(NEW_ROW, cold_start=cold))
    assert "Measured 2026-12-01 on x86_64" in text
    assert "the first step took 0.04 s" in text and "Another run took longer." in text


def test_markers_take_a_view_and_an_argument(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setitem(report.RENDERERS, "thing:card", lambda r, arg: seen.append(arg) or "T")
    (tmp_path / "thing.json").write_text(json.dumps({}))
    page = "a\n<!-- results:thing:card:x -->\nold\n<!-- /results:thing:card:x -->\nb"
    assert report.render(page, tmp_path) == page.replace("old", "T")
    assert seen == ["x"]
    missing = "<!-- results:absent -->\nkept\n<!-- /results:absent -->"
    assert report.render(missing, tmp_path) == missing


def test_a_section_that_nothing_renders_is_reported(tmp_path, monkeypatch):
    """A marker whose name has no renderer or no result file is listed by ``unserved`` (and
    fails ``report.py``), so that a table no run regenerates cannot go stale unseen."""
    monkeypatch.setitem(report.RENDERERS, "thing", lambda r: "T")
    (tmp_path / "thing.json").write_text(json.dumps({}))
    page = (
        "<!-- results:thing -->\nold\n<!-- /results:thing -->\n"
        "<!-- results:absent -->\nx\n<!-- /results:absent -->\n"
        "<!-- results:nothing_renders:brief -->\ny\n<!-- /results:nothing_renders:brief -->"
    )
    (tmp_path / "nothing_renders.json").write_text(json.dumps({}))
    assert report.unserved(page, tmp_path) == ["absent", "nothing_renders:brief"]


def test_every_page_section_is_served():
    for page in report.pages():
        assert report.unserved(page.read_text()) == [], page


def test_the_reporting_draw_says_how_many_of_its_draws_it_covers():
    from benchmarks import report_choices

    kinds = {"mlp": {"n": 2, "rule": 1.5, "time": 0.8, "sfadamw": 0.5, "prodigy": 0.4, "muon": 1.1}}
    summary = {"n": 2, "geomean": kinds["mlp"], "won": 0.5, "divergences": 0,
               "kinds": kinds, "worst_kind": "mlp"}  # fmt: skip
    partial = {"of": 150, "summary": summary}
    head = report_choices.report_draw_headline(partial)
    assert (
        "the first 2 of its 150 jobs" in head
        and "**1.50x**" in head
        and "**0.80x** in time" in head
    )
    table = report_choices.report_draw_table(partial)
    assert "| mlp | 2 | 1.50x | 0.80x | 0.50x | 0.40x | 1.10x |" in table
    assert "The first 2 of its 150 draws" in table
    assert "All 2 draws" in report_choices.report_draw_table({"of": 2, "summary": summary})


def test_the_ledger_names_this_checkout_by_its_commit():
    from benchmarks.report_choices import _pinned

    assert _pinned(".:step_mult=0.003", "380c96c") == "380c96c:step_mult=0.003"
    assert _pinned(".", "380c96c") == "380c96c"
    assert (
        _pinned("bbd8f5d", "bbd8f5d") == "bbd8f5d" and _pinned("adamw:0.001", None) == "adamw:0.001"
    )
