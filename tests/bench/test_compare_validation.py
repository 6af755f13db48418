"""benchmarks.compare_validation: records side by side, and the errors it gives."""

from __future__ import annotations

import json

import pytest

from benchmarks import compare_validation as cv


def _record(path, median, rows, dec=()):
    record = {
        "benchmark": "validation", "schedule": "constant",
        "single": [{"task": t, "horizon": h, "learned": {"speedup": s, "diverged": s < 0.1}}
                   for t, h, s in rows],
        "decentralized": [{"task": t, "workers": 4, "topology": "ring", "partition": "iid",
                           "speedup": s, "worse_than_dadam": worse} for t, s, worse in dec],
        "summary": {"median_speedup": median, "median_speedup_short": median,
                    "median_speedup_long": None, "min_speedup": min(s for *_, s in rows),
                    "rows_below_0.9": [t for t, _, s in rows if s < 0.9],
                    "decentralized_rows": len(dec),
                    "median_speedup_decentralized": dec[0][1] if dec else None,
                    "decentralized_worse_than_dadam": sum(w for *_, w in dec)},
    }  # fmt: skip
    path.write_text(json.dumps(record))
    return str(path)


def test_rows_side_by_side_with_the_median_against_the_first(tmp_path, capsys):
    base = _record(tmp_path / "base.json", 1.2, [("a", 200, 1.2), ("b", 1000, 0.8)])
    other = _record(tmp_path / "other.json", 1.5, [("a", 200, 1.5), ("c", 500, 0.05)],
                    dec=[("d", 0.7, True)])  # fmt: skip
    assert cv.main([base, other]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["a@200"] == ["1.20x", "1.50x"]
    assert lines["b@1000"] == ["0.80x", "-"] and lines["c@500"] == ["-", "0.05xd"]
    assert "0.70x+" in out and "1.25 times the first" in out
    assert "decentralized median 0.70x, 1 of 1 above D-Adam" in out


def test_a_missing_or_foreign_record_is_a_one_line_error(tmp_path, capsys):
    base = _record(tmp_path / "base.json", 1.2, [("a", 200, 1.2)])
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"benchmark": "step_overhead"}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for bad, says in ((str(tmp_path / "none.json"), "no such"), (str(foreign), "not a record"),
                      (str(broken), "not JSON")):  # fmt: skip
        assert cv.main([base, bad]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        cv.main([base])  # one record compares with nothing
