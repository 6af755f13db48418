"""The validation benchmark: its scoring on tiny curves, its rule with replaced config
fields, the anchors' Muon split, and a whole run of one tiny problem with its cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks import heldout_decentralized as dec  # noqa: E402
from benchmarks import validation as val  # noqa: E402
from benchmarks import validation_anchors as anchors  # noqa: E402

ADAMW = [1.0 - 0.009 * i for i in range(100)]  # reaches 0.109 at its last step
TWICE = [max(0.1, 1.0 - 0.018 * i) for i in range(100)]  # the same levels in half the steps


def test_a_rule_twice_as_fast_scores_about_2x_and_a_rising_one_diverges():
    best = {"curve": ADAMW}
    rising = [1.0 + 0.01 * i for i in range(100)]
    ms = {"adamw": 1.0, "learned": 4.0, "muon_adamw": 1.0}
    got = val.score_seed(best, TWICE, {"muon_adamw": rising}, ms)
    assert got["learned"]["speedup"] == pytest.approx(2.0, rel=0.1)  # the smoothing lags a little
    assert got["learned"]["wall_speedup"] == pytest.approx(got["learned"]["speedup"] / 4)
    assert not got["learned"]["diverged"]
    assert got["anchors"]["muon_adamw"]["diverged"]
    merged = val.merge([got["learned"], {**got["learned"], "speedup": 1.0, "diverged": True}])
    assert merged["speedup"] == pytest.approx((got["learned"]["speedup"] + 1.0) / 2, abs=1e-3)
    assert merged["diverged"] and len(merged["speedup_by_seed"]) == 2


def test_summary_splits_short_and_long_runs():
    def row(task, h, sp, anchor_sp):
        one = {"speedup": sp, "diverged": False, "wall_speedup": sp / 2}
        return {"task": task, "horizon": h, "learned": one,
                "anchors": {"prodigy_cosine": {"speedup": anchor_sp, "diverged": h > 500}}}  # fmt: skip

    rows = [row("a", 200, 1.0, 1.0), row("b", 200, 2.0, 0.5), row("c", 2000, 0.8, 1.2)]
    s = val.summarise(rows)
    assert s["median_speedup"] == 1.0 and s["median_speedup_short"] == 1.5
    assert s["median_speedup_long"] == 0.8 and s["rows_below_0.9"] == ["c@2000"]
    assert s["anchors_median_speedup"] == {"prodigy_cosine": 1.0}
    assert s["anchors_divergences"] == {"prodigy_cosine": 1} and s["divergences"] == 0


def test_a_side_replaces_config_fields_with_their_types():
    assert val.parse_side("mine=adapt_init_2x:ns_steps=3,output=adam") == (
        "mine", "adapt_init_2x", {"ns_steps": 3, "output": "adam"})  # fmt: skip
    assert val.parse_side("adapt_init_2x") == ("adapt_init_2x", "adapt_init_2x", {})
    fields = val.typed_fields("adapt_init_2x", {"lr_adapt_max_ortho": 3.0, "ns_steps": 3.0})
    assert fields == {"lr_adapt_max_ortho": 3.0, "ns_steps": 3} and type(fields["ns_steps"]) is int
    opt = val.side_factory("adapt_init_2x", fields)([nn.Parameter(torch.zeros(8, 8))], 0.5)
    assert opt.net.config.ns_steps == 3 and opt.net.config.lr_adapt_max_ortho == 3.0
    assert opt.param_groups[0]["lr"] == 0.5


def test_a_side_may_name_a_value_where_the_config_takes_a_name():
    fields = val.typed_fields("adapt_init_2x", {"output": "adam"})
    opt = val.side_factory("adapt_init_2x", fields)([nn.Parameter(torch.zeros(8, 8))], 1.0)
    assert opt.net.config.output == "adam"
    with pytest.raises(ValueError, match="ns_steps='four'.* takes a number"):
        val.typed_fields("adapt_init_2x", {"ns_steps": "four"})
    with pytest.raises(ValueError, match="output=1.0.* takes a name"):
        val.typed_fields("adapt_init_2x", {"output": 1.0})
    unknown = val.typed_fields("adapt_init_2x", {"no_such": "x"})  # the config names it
    with pytest.raises(ValueError, match=r"unknown config fields \['no_such'\]"):
        val.side_factory("adapt_init_2x", unknown)


def test_muon_takes_hidden_matrices_only():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    names = [n for (n, _), h in zip(model.named_parameters(), anchors.hidden_matrices(model)) if h]
    assert names == ["1.weight", "2.weight"]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    assert anchors.hidden_matrices(mlp) == [False, False, True, False, False, False]


def test_a_whole_tiny_run_then_a_rerun_from_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(val, "SINGLE_PROBLEMS", [("val_blobs_softmax", 30, "tabular")])
    monkeypatch.setattr(val, "CACHE", tmp_path / "cache.json")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    argv = ["--checkpoint", "adapt_init_2x", "--seeds", "0", "--jobs", "1", "--out", "tiny"]
    assert val.main(argv) == 0
    first = capsys.readouterr().out
    out = json.loads((tmp_path / "tiny.json").read_text())
    assert out["complete"] and not out["failed_jobs"]
    (row,) = out["single"]
    assert set(row["anchors"]) == set(anchors.ANCHORS) and row["learned"]["speedup"] > 0
    assert row["ms_per_step"]["learned"] > 0 and out["summary"]["single_rows"] == 1
    assert val.main(argv) == 0  # only the rule runs again
    assert "2 jobs on 1 processes" in capsys.readouterr().out and "2 jobs" not in first


def test_the_rule_under_an_annealing_schedule_takes_smaller_late_steps():
    side = ("adapt_init_2x", "adapt_init_2x", {})
    const = val.learned_job("val_blobs_softmax", side, 40, 0)["curve"]
    cosine = val.learned_job("val_blobs_softmax", side, 40, 0, "cosine")["curve"]
    wsd = val.learned_job("val_blobs_softmax", side, 40, 0, "wsd")["curve"]
    half = val.learned_job("val_blobs_softmax", side, 40, 0, "wsd_half")["curve"]
    assert const[:2] == cosine[:2]  # the same start: the schedule is at its peak
    assert const[:33] == wsd[:33] and wsd[33:] != const[33:]  # held for 32 steps, then decayed
    assert const[:21] == half[:21] and half[21:] != const[21:]  # held for 20 steps
    late = lambda c: sum(abs(a - b) for a, b in zip(c[-10:], c[-9:]))  # noqa: E731
    assert cosine != const and late(cosine) < late(const) and late(wsd) < late(const)


def test_sampled_ranks_are_scored_on_their_own_samples_and_partitions_on_the_whole_set():
    """The decentralized objective at the averaged model: on the ranks' samples together
    (repeats counted) where each drew its own, on the whole training set where the shards
    partition it; a sampled run also records the whole set's loss (a population)."""
    from learned_opt.meta_train.inner import InnerOptimizer, new_trajectory
    from learned_opt.tasks import get_task

    task = get_task("val_blobs_softmax")
    for partition in ("sampled", "dirichlet"):
        traj = new_trajectory(task, 4, "ring", partition, 0.3, 0, 4)
        avg = {k: v.mean(0) for k, v in traj.layout.unflatten(traj.params).items()}
        whole = task.evaluate(avg, split="train", max_examples=task.data.num_train)["loss"]
        shards = torch.cat(list(traj.batches.shards))
        on_shards = task.evaluate(avg, split="train", indices=shards)["loss"]
        got = dec.averaged_train_loss(task, traj)
        assert got == pytest.approx(on_shards if partition == "sampled" else whole, rel=1e-6)
        assert dec.averaged_train_loss(task, traj, population=True) == whole
    assert on_shards == pytest.approx(whole, rel=1e-5)  # a partition: the same examples
    setting = dict(task="val_blobs_softmax", workers=4, topology="ring", partition="sampled",
                   alpha=0.3, horizon=3, every=1, seed=0)  # fmt: skip
    run = dec.run_averaged("val_blobs_softmax", InnerOptimizer("adam", 1e-2, "metropolis"),
                           setting)  # fmt: skip
    assert len(run["curve"]) == 3 and run["population_final"] > 0
    assert dec.setting_key(setting).endswith("|objective=ranks|gridNone")
    assert "objective" not in dec.setting_key(dict(setting, partition="dirichlet"))
