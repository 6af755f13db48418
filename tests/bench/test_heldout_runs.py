"""Pieces of the held-out suite's runs on validation problems (cheap and never held out): the
anchors' Muon split, the rule under an annealing schedule, and the decentralized objective."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import heldout_decentralized as dec  # noqa: E402
from benchmarks import heldout_single as single  # noqa: E402
from benchmarks import validation_anchors as anchors  # noqa: E402


def test_muon_takes_hidden_matrices_only():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    names = [n for (n, _), h in zip(model.named_parameters(), anchors.hidden_matrices(model)) if h]
    assert names == ["1.weight", "2.weight"]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    assert anchors.hidden_matrices(mlp) == [False, False, True, False, False, False]


def test_the_rule_under_an_annealing_schedule_takes_smaller_late_steps():
    rule = single.resolve_side("adapt_init_2x")

    def curve(schedule: str) -> list[float]:
        torch.set_num_threads(1)
        return single.run("val_blobs_softmax", rule, 40, schedule=schedule)

    const, cosine, wsd, half = map(curve, ("constant", "cosine", "wsd", "wsd_half"))
    assert const[:2] == cosine[:2]  # the same start: the schedule is at its peak
    assert const[:33] == wsd[:33] and wsd[33:] != const[33:]  # held for 32 steps, then decayed
    assert const[:21] == half[:21] and half[21:] != const[21:]  # held for 20 steps
    late = lambda c: sum(abs(a - b) for a, b in zip(c[-10:], c[-9:]))  # noqa: E731
    assert cosine != const and late(cosine) < late(const) and late(wsd) < late(const)


def test_the_averaged_model_is_scored_on_the_whole_training_set():
    """The decentralized objective at the averaged model: the whole training set, which the
    ranks' label-skewed shards partition."""
    from learned_opt.meta_train.inner import InnerOptimizer, new_trajectory
    from learned_opt.tasks import get_task

    task = get_task("val_blobs_softmax")
    traj = new_trajectory(task, 4, "ring", "dirichlet", 0.3, 0, 4)
    avg = {k: v.mean(0) for k, v in traj.layout.unflatten(traj.params).items()}
    whole = task.evaluate(avg, split="train", max_examples=task.data.num_train)["loss"]
    on_shards = task.evaluate(avg, split="train", indices=torch.cat(list(traj.batches.shards)))
    assert dec.averaged_train_loss(task, traj) == whole
    assert on_shards["loss"] == pytest.approx(whole, rel=1e-5)  # a partition
    setting = dict(task="val_blobs_softmax", workers=4, topology="ring", alpha=0.3, horizon=3,
                   every=1, seed=0)  # fmt: skip
    run = dec.run_averaged("val_blobs_softmax", InnerOptimizer("adam", 1e-2, "metropolis"),
                           setting)  # fmt: skip
    assert len(run["curve"]) == 3 and run["consensus"] >= 0
    assert dec.setting_key(setting) == (
        "dec|alpha=0.3|every=1|horizon=3|seed=0|task=val_blobs_"
        "softmax|topology=ring|workers=4|gridNone"
    )


def test_the_muon_anchor_takes_models_without_matrices_or_without_the_rest():
    from benchmarks import rules

    for model in (nn.Linear(5, 1), nn.Linear(5, 4, bias=False)):
        opt = rules._muon(model.parameters())
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(8, 5)).square().mean().backward()
        opt.step()
        assert len(opt.opts) == 1 and all(
            not torch.equal(a, b) for a, b in zip(before, model.parameters())
        )
