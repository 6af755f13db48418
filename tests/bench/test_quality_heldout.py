"""The held-out suite's benchmark: tuning, scoring, caching, the learned side and the report."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common, quality_heldout, rules  # noqa: E402
from benchmarks import heldout_single as single  # noqa: E402
from benchmarks.report_heldout import render_quality_heldout  # noqa: E402
from learned_opt import CheckpointError, load_checkpoint  # noqa: E402
from learned_opt.checkpoint import DEFAULT_CHECKPOINT  # noqa: E402


def test_best_adamw_cuts_constant_runs_and_keeps_cosine_at_its_horizon():
    runs = {
        "constant|0.001|100": [1.0] * 50 + [0.5] * 50,  # at 20 steps: 1.0
        "cosine|0.01|20": [0.9] * 20,
        "cosine|0.1|100": [0.1] * 100,  # another horizon: not a candidate at 20
    }
    best = single.best_adamw(runs, 20)
    assert (best["lr"], best["schedule"]) == (0.01, "cosine")
    assert set(best["grid"]) == {"constant|0.001", "cosine|0.01"}
    best = single.best_adamw(runs, 100)
    assert (best["lr"], best["schedule"], len(best["curve"])) == (0.1, "cosine", 100)
    assert single.best_adamw(runs, 200) is None


def test_edge_extension():
    lrs = [1e-3, 1e-2, 1e-1]
    ladder = (1e-4, 1e-3, 3e-3, 1e-2, 1e-1)
    assert single.edge_extension({"lr": 1e-2}, lrs, ladder) is None
    assert single.edge_extension({"lr": 1e-1}, lrs, ladder) == pytest.approx(0.316)
    assert single.edge_extension({"lr": 1e-3}, lrs, ladder) == 1e-4  # onto the ladder
    assert single.edge_extension({"lr": 1e-4}, [1e-4, 1e-3], ladder) == pytest.approx(3.16e-5)
    quick = sorted(single.QUICK_GRID)  # --quick extends onto the full grid's rates
    assert single.edge_extension({"lr": quick[-1]}, quick) in single.ADAMW_GRID
    assert single.edge_extension({"lr": quick[0]}, quick) in single.ADAMW_GRID


def test_diverged():
    assert rules.diverged([1.0, 0.5, math.inf])
    assert rules.diverged([1.0] + [2.0] * 20)
    assert not rules.diverged([1.0] + [0.5] * 20)
    assert rules.diverged([])


def test_any_torch_optimizer_runs_on_a_task_through_a_factory():
    factory = single.resolve_side("torch.optim:SGD")  # SGD(params, lr) is a factory
    curve = single.run("heldout_logreg_l2", factory, 30, lr_mult=0.5)
    assert len(curve) == 30 and curve[-1] < curve[0]
    cos = single.run("heldout_logreg_l2", factory, 30, lr_mult=0.5, schedule="cosine")
    assert cos != curve
    with pytest.raises(ValueError, match="schedule"):
        single.run("heldout_logreg_l2", factory, 3, schedule="linear")


def test_the_shipped_default_as_a_factory():
    factory = single.resolve_side("benchmarks.heldout_single:shipped_default")
    opt = factory([torch.zeros(3, requires_grad=True)], 0.5)
    assert opt.param_groups[0]["lr"] == 0.5
    assert opt.card == load_checkpoint(DEFAULT_CHECKPOINT)[1]


@pytest.mark.parametrize(
    "side, error, match",
    [
        ("no_such_module_xyz:make", ValueError, "cannot be imported"),
        ("torch.optim:no_such_fn", ValueError, "cannot be imported"),
        ("math:pi", ValueError, "not callable"),
        ("no_such_checkpoint", CheckpointError, "no_such_checkpoint"),
    ],
)
def test_bad_learned_side(side, error, match):
    with pytest.raises(error, match=match):
        single.resolve_side(side)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--tasks", "digits_mlp"], "unknown held-out tasks"),
        (["--factory", "not_a_factory"], "module:function"),
        (["--checkpoint"], "at least one"),
        (["--seeds", "1", "1"], "repeats a seed"),
    ],
)
def test_bad_command_line(argv, match, capsys):
    with pytest.raises(SystemExit):
        quality_heldout.main(argv)
    assert match in capsys.readouterr().err


@pytest.fixture
def tiny_suite(monkeypatch, tmp_path):
    """The suite on one small task, 30 steps, with its caches and results under tmp_path."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(quality_heldout, "CACHE", tmp_path / "baselines.json")
    monkeypatch.setattr(quality_heldout, "SHORT", 30)
    setting = quality_heldout._setting("heldout_logreg_l2", 4, "ring", 0.3, 30)
    monkeypatch.setattr(quality_heldout, "DEC_QUICK", [setting])
    return tmp_path


def test_suite_end_to_end_and_cached_rerun(tiny_suite, capsys):
    argv = ["--quick", "--tasks", "heldout_logreg_l2", "--checkpoint", "adam_init",
            "--factory", "torch.optim:SGD", "--jobs", "1"]  # fmt: skip
    assert quality_heldout.main(argv) == 0
    result = json.loads((tiny_suite / "quality_heldout_quick.json").read_text())
    assert result["complete"] and result["sides"] == ["adam_init", "torch.optim:SGD"]
    summary = result["summary"]
    for key in ("median_speedup_single", "median_speedup_decentralized", "min_speedup"):
        assert summary[key] > 0
    assert summary["divergences"] >= 0
    assert {r["side"] for r in result["single"]} == {"adam_init", "torch.optim:SGD"}
    assert {r["side"] for r in result["decentralized"]} == {"adam_init"}  # checkpoints only
    row = result["single"][0]
    assert set(row["lr_mult"]) == {"0.3", "3"} and row["wall_speedup"] > 0
    assert (tiny_suite / "quality_heldout_quick.png").exists()
    text = render_quality_heldout(result)
    assert "logreg_l2" in text and "Partial" not in text and "`adam_init`" in text
    assert "Partial run" in render_quality_heldout({**result, "complete": False})

    capsys.readouterr()
    assert quality_heldout.main(argv) == 0  # the baselines cached: only the learned sides
    out = capsys.readouterr().out  # run again (each 3 multipliers and the timing, and the
    assert "\n9 jobs on 1 processes" in "\n" + out  # checkpoint's decentralized run)


def test_a_factory_alone_tunes_no_decentralized_baseline(tiny_suite):
    argv = ["--quick", "--tasks", "heldout_logreg_l2", "--checkpoint", "--factory",
            "torch.optim:SGD", "--jobs", "1"]  # fmt: skip
    assert quality_heldout.main(argv) == 0
    result = json.loads((tiny_suite / "quality_heldout_quick.json").read_text())
    assert result["complete"] and result["decentralized"] == [] and len(result["single"]) == 1
    assert result["expected_rows"]["decentralized"] == 0
    cache = json.loads((tiny_suite / "baselines.json").read_text())
    assert cache and not any(k.startswith("dec|") for k in cache)


def test_decentralized_row_is_the_median_over_seeds(tiny_suite):
    argv = ["--quick", "--tasks", "heldout_logreg_l2", "--checkpoint", "adam_init",
            "--seeds", "0", "1", "2", "--jobs", "1"]  # fmt: skip
    assert quality_heldout.main(argv) == 0
    result = json.loads((tiny_suite / "quality_heldout_quick.json").read_text())
    assert result["complete"] and result["seeds"] == [0, 1, 2]
    (row,) = result["decentralized"]  # one setting: one row, not one per seed
    assert row["seeds"] == [0, 1, 2] and len(row["speedup_by_seed"]) == 3
    assert row["speedup"] == pytest.approx(sorted(row["speedup_by_seed"])[1], abs=1e-4)
    cache = json.loads((tiny_suite / "baselines.json").read_text())
    assert sum(k.startswith("dec|") for k in cache) == 3  # baselines tuned per seed
    text = render_quality_heldout(result)
    per_seed = ", ".join(f"{x:.2f}" for x in row["speedup_by_seed"])
    assert f"({per_seed})" in text and "median over seeds 0, 1, 2" in text


def test_single_worker_row_is_the_median_over_seeds(tiny_suite, monkeypatch, capsys):
    from learned_opt.meta_train.evaluation import speedup

    monkeypatch.setattr(quality_heldout, "DEC_QUICK", [])  # single-worker rows only
    argv = ["--quick", "--tasks", "heldout_logreg_l2", "--checkpoint", "adam_init",
            "--seeds", "0", "1", "2", "--jobs", "1"]  # fmt: skip
    assert quality_heldout.main(argv) == 0
    result = json.loads((tiny_suite / "quality_heldout_quick.json").read_text())
    assert result["complete"] and result["seeds"] == [0, 1, 2]
    (row,) = result["single"]  # one task and horizon: one row, not one per seed
    assert row["seeds"] == [0, 1, 2] and len(row["speedup_by_seed"]) == 3
    assert row["speedup"] == pytest.approx(sorted(row["speedup_by_seed"])[1], abs=1e-4)
    cache = json.loads((tiny_suite / "baselines.json").read_text())
    for seed, each in enumerate(row["speedup_by_seed"]):  # AdamW tuned afresh per seed
        runs = {k.split("|", 2)[2].rsplit("|", 1)[0]: c for k, c in cache.items()
                if k.startswith("single|") and k.endswith(f"|{seed}")}  # fmt: skip
        best = single.best_adamw(runs, 30)
        assert row["adamw_by_seed"][seed] == {"lr": best["lr"], "schedule": best["schedule"]}
        curve = single.run_job("heldout_logreg_l2", "adam_init", 30, seed=seed)["curve"]
        assert each == pytest.approx(speedup(curve, best["curve"]), abs=1e-4)
    for m in row["lr_mult"].values():  # the multipliers: medians, against the median x1
        assert m["speedup"] == pytest.approx(sorted(m["speedup_by_seed"])[1], abs=1e-4)
        assert m["ratio_to_default"] == pytest.approx(m["speedup"] / row["speedup"], abs=1e-3)
    text = render_quality_heldout(result)
    per_seed = ", ".join(f"{x:.2f}" for x in row["speedup_by_seed"])
    assert f"({per_seed})" in text and "Every row, single-worker and decentralized" in text

    capsys.readouterr()
    assert quality_heldout.main(argv) == 0  # every seed's baselines cached: the learned
    assert "\n10 jobs on 1 processes" in "\n" + capsys.readouterr().out  # side's runs only


def test_job_queue_runs_urgent_jobs_first():
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.job_queue import JobQueue

    ran = []
    with ThreadPoolExecutor(1) as executor:
        queue = JobQueue(executor, width=1)
        tickets = {queue.submit(ran.append, name): name for name in ("a", "b", "c")}
        with queue.urgent():
            tickets[queue.submit(ran.append, "urgent")] = "urgent"
        while len(queue):
            for ticket, future in queue.wait_any():
                assert future.result() is None and ticket in tickets
    assert ran == ["urgent", "a", "b", "c"]


def test_headline_is_the_shipped_default_one_rule_for_both():
    from benchmarks.heldout_rows import headline

    def row(side, speedup, **extra):
        return {"side": side, "task": "t", "horizon": 200, "speedup": speedup,
                "wall_speedup": speedup, "diverged": False, "lr_mult": {}, **extra}  # fmt: skip

    other = "gossip_adapt"
    singles = [row(DEFAULT_CHECKPOINT, 1.5), row(other, 0.4)]
    decs = [row(DEFAULT_CHECKPOINT, 0.9, workers=8), row(other, 1.2, workers=8)]
    top = headline([other, "ortho_init", DEFAULT_CHECKPOINT], singles, decs)
    assert (top["side"], top["rule"]) == ("shipped default", DEFAULT_CHECKPOINT)
    # the default's own rows, alone and under gossip, whatever another side scored
    assert top["median_speedup_single"] == 1.5 and top["median_speedup_decentralized"] == 0.9
    assert top["min_speedup"] == 0.9 and top["rows_below_0.8"] == []
    first = headline([other], singles, decs)  # the default not measured: the first side
    assert first["side"] == other and first["median_speedup_decentralized"] == 1.2
