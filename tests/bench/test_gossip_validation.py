"""The decentralized family validation's benchmark: its sides, its settings and its report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gossip_validation as gv  # noqa: E402
from benchmarks.report_sections import render_gossip_validation  # noqa: E402
from learned_opt.tasks import is_held_out  # noqa: E402


def test_sides_parse_with_and_without_overrides():
    assert gv.parse_side("default") == ("default", "default", {})
    assert gv.parse_side("e4=adapt_init:lr_adapt_max_gossip=4") == (
        "e4", "adapt_init", {"lr_adapt_max_gossip": 4.0},
    )  # fmt: skip
    assert gv.parse_side("s=runs/x.pt:a=1,b=2.5")[2] == {"a": 1.0, "b": 2.5}
    assert gv.parse_side("f=adapt_init_2x:ns_steps=3,ns_schedule=fit3")[2] == {
        "ns_steps": 3.0, "ns_schedule": "fit3",
    }  # fmt: skip
    for bad in ("=default", "x=:a=1", "x=default:a", "x=default:a=", "x=default:a=b c"):
        with pytest.raises(argparse.ArgumentTypeError):
            gv.parse_side(bad)


def test_a_side_overrides_its_config():
    opt = gv.side_optimizer("adapt_init", {"lr_adapt_max_gossip": 4.0})
    assert opt.kind == "learned" and opt.mixing == "learned"
    assert opt.gossip_cfg.lr_adapt_max == 4.0 < opt.cfg.lr_adapt_max
    with pytest.raises(ValueError, match="no_such_field"):
        gv.side_optimizer("adapt_init", {"no_such_field": 1.0})
    worker = gv.side_optimizer("adapt_init", {"share_state_every": 4, "lr_adapt_max_gossip": 3.0})
    assert worker.share_state_every == 4 and worker.gossip_cfg.lr_adapt_max == 3.0
    with pytest.raises(ValueError, match="whole number"):
        gv.side_optimizer("adapt_init", {"share_state_every": 2.5})


def test_bad_sides_fail_before_any_work(capsys):
    for argv in (["--side", "x=no_such_checkpoint"], ["--side", "a=default", "--side", "a=adapt_init"],
                 ["--side", "default", "--tasks", "nope"]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            gv.main(argv)
        assert exc.value.code == 2
    assert "no_such_checkpoint" in capsys.readouterr().err


def test_settings_are_registry_tasks_never_held_out():
    tasks = {s["task"] for s in gv.SETTINGS}
    assert not any(is_held_out(t) for t in tasks)
    # held-out look-alikes are covered: an autoencoder, an L2 classifier, batch norm
    assert {"wine_autoencoder", "logreg_wine_l2", "digits_cnn_bn"} <= tasks


def test_summary_and_report():
    assert gv.summarise([0.5, 2.0, 1.0]) == {"median": 1.0, "min": 0.5,
                                             "geomean": pytest.approx(1.0)}  # fmt: skip
    rows = [
        {"side": side, "task": task, "workers": 8, "topology": "ring", "alpha": 0.3,
         "speedup": s, "best_baseline": "D-SGD", "baseline_lr": 0.3}
        for side, task, s in (("a", "t1", 0.5), ("a", "t2", 2.0), ("b", "t1", 1.5),
                              ("b", "t2", 0.25))
    ]  # fmt: skip
    result = {
        "sides": [{"label": "a", "checkpoint": "default", "fields": {}},
                  {"label": "b", "checkpoint": "adapt_init", "fields": {"x": 4.0}}],
        "rows": rows, "horizon": 200, "wall_seconds": 60, "command": "cmd",
        "summary": {"a": gv.summarise([0.5, 2.0]), "b": gv.summarise([1.5, 0.25])},
    }  # fmt: skip
    text = render_gossip_validation(result)
    assert "| t1 | 8 | ring | 0.3 | D-SGD (0.3) | 0.50x | 1.50x |" in text
    assert "| **min** |" in text and "**0.25x**" in text
    assert "`b` = `adapt_init` with x=4" in text


def test_a_row_over_seeds_is_the_median_speedup():
    setting = gv.SETTINGS[0]

    def scored(speedup, lr):
        return {"best_baseline": "D-SGD", "speedup": speedup, "learned_final": 0.1,
                "learned_consensus": 0.0,
                "baselines": {"D-SGD": {"lr": lr, "final": 0.2}}}  # fmt: skip

    row = gv.score_row("a", setting, [(scored(0.5, 1.0), 0), (scored(3.0, 0.3), 1),
                                      (scored(1.25, 0.3), 2)])  # fmt: skip
    assert row["speedup"] == 1.25 and row["speedup_by_seed"] == [0.5, 3.0, 1.25]
    assert row["seeds"] == [0, 1, 2] and row["baseline_lr"] == 1.0  # the first seed's
    alone = gv.score_row("a", setting, [(scored(0.5, 1.0), 0)])
    assert alone["speedup"] == 0.5 and "speedup_by_seed" not in alone


def test_repeated_seeds_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        gv.main(["--side", "default", "--seeds", "0", "0"])
    assert exc.value.code == 2 and "repeats a seed" in capsys.readouterr().err
