"""benchmarks.validation_headroom: what choosing per problem among the records could reach."""

from __future__ import annotations

import json

import pytest

from benchmarks import common
from benchmarks import validation_headroom as vh


def _write(path, by_row, seeds=(0, 1), **extra):
    """A validation record of single-worker rows ``{(task, horizon): speedups by seed}``."""
    single = [{"task": t, "horizon": h, "learned": {"speedup_by_seed": list(v)}}
              for (t, h), v in by_row.items()]  # fmt: skip
    record = {"benchmark": "validation", "complete": True, "quick": False,
              "schedule": "constant", "seeds": list(seeds), "single": single, **extra}  # fmt: skip
    path.write_text(json.dumps(record))
    return str(path)


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


def test_per_row_choice_in_sample_across_seeds_and_by_pairs(results, capsys):
    ref = {("a", 200): (1.0, 1.0), ("b", 2000): (1.0, 1.0)}
    # x wins row a at both seeds; y wins row b at seed 0 only, z at seed 1 only
    _write(results / "validation_ref.json", ref)
    _write(results / "validation_x.json", {("a", 200): (2.0, 2.0), ("b", 2000): (0.5, 0.5)})
    _write(results / "validation_y.json", {("a", 200): (1.0, 1.0), ("b", 2000): (4.0, 0.5)})
    _write(results / "validation_z.json", {("a", 200): (1.0, 1.0), ("b", 2000): (0.5, 3.0)},
           schedule="wsd_half")  # fmt: skip
    # not comparable: other seeds, a quick run, another benchmark's file
    _write(results / "validation_seeds.json", ref, seeds=(3, 4))
    _write(results / "validation_quick.json", ref, quick=True)
    (results / "validation_baselines.json").write_text(json.dumps({"benchmark": "other"}))
    assert vh.main(["--reference", str(results / "validation_ref.json")]) == 0
    out = json.loads((results / "validation_headroom.json").read_text())
    assert out["variants"] == ["validation_ref", "validation_x", "validation_y",
                               "validation_z (wsd_half)"]  # fmt: skip
    s = out["summaries"]
    # in sample: row a 2 at both seeds, row b 4 and 3
    assert s["per_row_in_sample"]["median_short"] == 2.0
    assert s["per_row_in_sample"]["median_long"] == 3.5
    assert s["per_row_in_sample"]["geomean_over_reference"] == pytest.approx(
        (2 * 2 * 4 * 3) ** 0.25, abs=1e-4
    )
    # across seeds: row a takes x either way; row b's choice made on the other seed misses
    assert out["chosen_across_seeds"]["a@200"] == ["validation_x", "validation_x"]
    assert out["chosen_across_seeds"]["b@2000"] == ["validation_z (wsd_half)", "validation_y"]
    assert s["per_row_across_seeds"]["median_long"] == 0.5
    assert s["per_row_across_seeds"]["rows_below_0.9"] == ["b@2000"]
    assert s["best_variant"]["names"] == ["validation_y"]  # geomean (1 1 4 0.5)^(1/4)
    # y and z together take row b at 4 and 3: (1 1 4 3)^(1/4), above x and y's (2 2 4 0.5)
    assert s["best_pair"]["names"] == ["validation_y", "validation_z (wsd_half)"]
    assert s["reference"]["geomean_over_reference"] == 1.0 and s["reference"]["lowest"] == 1.0
    assert "per_row_across_seeds" in capsys.readouterr().out


def _setting(speedup, worse, task="val_logreg_l2"):
    return {"task": task, "workers": 16, "topology": "exponential", "partition": "dirichlet",
            "alpha": 0.3, "speedup": speedup, "worse_than_dadam": worse}  # fmt: skip


def test_decentralized_settings_count_the_records_no_worse_than_dadam(results):
    rows = {("a", 200): (1.0, 1.0)}
    _write(results / "validation_ref.json", rows)
    _write(results / "validation_x.json", rows, decentralized=[_setting(1.4, False)])
    _write(results / "validation_y.json", rows, seeds=(0,),  # any seeds count here
           decentralized=[_setting(2.0, True), _setting(0.7, False, task="val_blobs")])  # fmt: skip
    _write(results / "validation_z_decentralized.json", {}, decentralized=[_setting(1.9, False)])
    assert vh.main(["--reference", str(results / "validation_x.json")]) == 0
    dec = {
        d["task"]: d
        for d in json.loads((results / "validation_headroom.json").read_text())["decentralized"]
    }
    assert dec["val_logreg_l2"]["records"] == 3
    assert dec["val_logreg_l2"]["not_worse_than_dadam"] == [
        "validation_x",
        "validation_z_decentralized",
    ]
    assert (
        dec["val_logreg_l2"]["best"] == "validation_z_decentralized"
    )  # 1.9x; y's 2.0x ended worse
    assert dec["val_blobs"]["records"] == 1 and dec["val_blobs"]["best_speedup"] == 0.7


def test_a_bad_reference_or_too_few_records_is_a_one_line_error(results, capsys):
    assert vh.main(["--reference", str(results / "none.json")]) == 2
    assert "no such validation record" in capsys.readouterr().err
    _write(results / "validation_ref.json", {("a", 200): (1.0, 1.0)})
    assert vh.main(["--reference", str(results / "validation_ref.json")]) == 2
    err = capsys.readouterr().err
    assert "fewer than two comparable records" in err and err.count("\n") == 1
    assert not (results / "validation_headroom.json").exists()


def test_the_shipped_table_is_generated_from_the_committed_records():
    shipped = json.loads((common.RESULTS / "validation_headroom.json").read_text())
    assert shipped["reference"] == vh.REFERENCE
    assert vh.REFERENCE in shipped["variants"] and len(shipped["variants"]) >= 50
