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


def test_the_paired_comparison_reads_every_row_and_seed_both_ran(tmp_path, monkeypatch):
    """Row by row: a stage whose median is higher only because another row lands in the
    middle is level in the geometric mean; a divergence (speedup 0) counts as behind."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)

    def record(name, median, by_row, seeds=(0, 1)):
        path = _record(tmp_path / f"{name}.json", f"{name}.pt", median)
        data = json.loads((tmp_path / f"{name}.json").read_text())
        data["seeds"] = list(seeds)
        data["single"] = [
            {"task": task, "horizon": 200, "learned": {"speedup_by_seed": list(speeds)}}
            for task, speeds in by_row.items()
        ]  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        return path

    ref = record("ref", 1.0, {"a": (1.0, 2.0), "b": (4.0, 1.0), "c": (1.0, 1.0)})
    stage = record("s", 1.5, {"a": (2.0, 1.0), "b": (1.0, 4.0), "c": (0.0, 1.0), "d": (9, 9)})
    wide = record("w", 1.5, {"a": (3.0, 3.0, 3.0)}, seeds=(5, 0, 1))
    assert ms.main(["--reference", ref, "--stages", stage, wide, "--out", "stages"]) == 0
    rows = json.loads((tmp_path / "stages.json").read_text())["rows"]
    assert rows[1]["times_reference"] == 1.5
    # a and b swap their values: level; c's first seed diverged: behind; d: not in ref
    assert rows[1]["paired"] == {"pairs": 6, "geomean": 1.0, "ahead": 2, "behind": 3}
    # seed 5 has no reference; seeds 0 and 1 of row a: 3x and 1.5x
    assert rows[2]["paired"]["pairs"] == 2 and rows[2]["paired"]["ahead"] == 2
    assert abs(rows[2]["paired"]["geomean"] - (3.0 * 1.5) ** 0.5) < 1e-4
