"""benchmarks.meta_stages: the stages' table against the hand-set rule, from the records."""

from __future__ import annotations

import json

from benchmarks import common
from benchmarks import meta_stages as ms


def _record(path, rule, median, lowest=0.8):
    summary = {"median_speedup": median, "median_speedup_short": median,
               "median_speedup_long": median, "min_speedup": lowest,
               "rows_below_0.9": ["x@2000"] if lowest < 0.9 else [], "divergences": 0}  # fmt: skip
    record = {"benchmark": "validation", "side": {"checkpoint": rule}, "date": "2026-12-06",
              "summary": summary}  # fmt: skip
    path.write_text(json.dumps(record))
    return str(path)


def test_each_stage_against_the_reference_and_the_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    ref = _record(tmp_path / "ref.json", "hand", 1.2)
    a = _record(tmp_path / "a.json", "a.pt", 1.32, lowest=0.95)
    b = _record(tmp_path / "b.json", "b.pt", 1.2)
    assert ms.main(["--reference", ref, "--stages", a, b, "--out", "stages"]) == 0
    out = json.loads((tmp_path / "stages.json").read_text())
    assert [r["times_reference"] for r in out["rows"]] == [1.0, 1.1, 1.0]
    assert out["best_stage"] == a and out["best_times_reference"] == 1.1
    assert out["target_met"] is False  # 1.1 < 1.15
    assert out["rows"][1]["below_0.9"] == [] and out["rows"][2]["below_0.9"] == ["x@2000"]
    assert "1.10 times the hand-set rule" in capsys.readouterr().out
    c = _record(tmp_path / "c.json", "c.pt", 1.4)
    ms.main(["--reference", ref, "--stages", c, "--out", "stages"])
    assert json.loads((tmp_path / "stages.json").read_text())["target_met"] is True


def test_a_bad_record_is_a_one_line_error_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    ref = _record(tmp_path / "ref.json", "hand", 1.2)
    gossip_only = _record(tmp_path / "g.json", "g.pt", None)
    for bad, says in ((gossip_only, "g.json: no single-worker rows"),
                      (str(tmp_path / "none.json"), "no such validation record")):  # fmt: skip
        assert ms.main(["--reference", ref, "--stages", bad, "--out", "stages"]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
    assert not (tmp_path / "stages.json").exists()


def test_the_shipped_table_is_generated_from_the_committed_records():
    shipped = json.loads((common.RESULTS / "meta_training_stages.json").read_text())
    assert shipped["reference"] == ms.REFERENCE
    assert [r["record"] for r in shipped["rows"][1:]] == list(ms.STAGES)
