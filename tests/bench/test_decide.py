"""The decision procedure: scores, the interval, the verdict, the seed ledger and one whole
decision on short draws."""

import dataclasses
import json
import math

import pytest
import torch

from benchmarks import decide, rules
from learned_opt.tasks.distribution import draw


def curve(levels):
    return [float(x) for x in levels]


def test_score_is_steps_to_the_worse_best_level():
    a = curve([10] * 10 + [1] * 30)  # smoothed over 10 steps, reaches 1 at step 20
    b = curve([10] * 20 + [1] * 20)  # at step 30
    s = decide.score_draw({"curve": a, "seconds": 4.0}, {"curve": b, "seconds": 4.0})
    assert s["step"] == pytest.approx(30 / 20)
    assert s["time"] == pytest.approx(30 / 20)
    slow = decide.score_draw({"curve": a, "seconds": 8.0}, {"curve": b, "seconds": 4.0})
    assert slow["time"] == pytest.approx(30 / 20 / 2)  # twice the cost per step
    assert not s["a_diverged"] and not s["b_diverged"]


def test_a_diverged_run_is_a_clipped_loss():
    blown = curve([10, 10] + [math.inf] * 38)
    fine = curve([10] * 10 + [1] * 30)
    s = decide.score_draw({"curve": blown, "seconds": 1.0}, {"curve": fine, "seconds": 1.0})
    assert s["step"] == 1 / decide.CLIP and s["a_diverged"] and not s["b_diverged"]
    assert rules.diverged(curve([1] * 10 + [2] * 10))  # ended above its first loss


def rows(scores, kind="mlp"):
    return [{"kind": kind, "step": x} for x in scores]


def test_the_verdict_needs_the_interval_above_one_and_no_kind_below_the_floor():
    wins = rows([1.3, 1.2, 1.25, 1.4, 1.1] * 8) + rows([1.5, 1.3, 1.2, 1.4] * 5, "rnn")
    s = decide.summarise(wins)
    assert s["interval"][0] > 1.0 and s["ships"] and s["won"] == 1.0
    low, high = s["interval"]
    assert low <= s["geomean"] <= high
    assert s["kinds"]["rnn"]["n"] == 20
    # a median that rises while a kind falls is a loss
    mixed = rows([1.5] * 40) + rows([0.9] * 10, "rnn")
    m = decide.summarise(mixed)
    assert m["interval"][0] > 1.0 and m["kinds_below_floor"] == ["rnn"] and not m["ships"]
    # an interval that reaches below 1 does not ship either
    assert not decide.summarise(rows([2.0, 0.5, 1.8, 0.6] * 5))["ships"]


def test_the_ledger_never_gives_a_seed_twice(tmp_path):
    ledger = tmp_path / "ledger.json"
    first = decide.reserve(5, {"a": "x", "b": "y"}, ledger)
    second = decide.reserve(3, {"a": "x", "b": "z"}, ledger)
    assert first == list(range(decide.DECISION_SEEDS, decide.DECISION_SEEDS + 5))
    assert second[0] == first[-1] + 1 and len(second) == 3
    entries = json.loads(ledger.read_text())
    assert [e["status"] for e in entries] == ["running", "running"]  # written before any run
    decide.settle(first[0], {"steps": {"geomean": 1.1}}, ledger)
    assert json.loads(ledger.read_text())[0]["status"] == "done"
    ledger.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        decide.read_ledger(ledger)


def test_the_committed_ledger_is_disjoint_and_above_the_reporting_seeds():
    entries = decide.read_ledger()
    spans = sorted((e["first_seed"], e["first_seed"] + e["draws"]) for e in entries)
    assert all(lo >= decide.DECISION_SEEDS for lo, _ in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_sides_parse_and_bad_ones_fail_once():
    assert rules.parse_side("bbd8f5d:lr_adapt_rate=0,ns_steps=5") == (
        "bbd8f5d", {"lr_adapt_rate": 0, "ns_steps": 5})  # fmt: skip
    assert rules.parse_side(".") == (".", {})
    assert rules.parse_side(".:normalize=true") == (".", {"normalize": True})
    with pytest.raises(ValueError, match="field=value"):
        rules.parse_side(".:lr_adapt_rate")
    with pytest.raises(ValueError, match="not a git revision"):
        rules.factory("no-such-revision", 10)
    with pytest.raises(ValueError, match="no fields"):
        rules.factory(".:no_such_field=1", 10)


def test_a_learned_side_takes_wsd_schedule():
    p = torch.nn.Parameter(torch.ones(3))
    make, sched = rules.factory(".:schedule=wsd0.2", 10)
    opt = make([p])
    scheduler = sched(opt)
    factors = []
    for _ in range(10):
        factors.append(opt.param_groups[0]["lr"])
        scheduler.step()
    assert factors[:9] == [1.0] * 9 and factors[9] == pytest.approx(0.5)  # the last fifth
    assert rules.factory(".", 10)[1] is None
    full = rules.factory(".:schedule=wsd", 10)[1](rules.factory(".", 10)[0]([p]))
    decay = full.lr_lambdas[0]  # over the last half
    assert decay(5) == pytest.approx(1.0) and decay(7) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="schedule must be wsd"):
        rules.factory(".:schedule=cosine", 10)


def test_one_whole_decision_on_short_draws(tmp_path, monkeypatch, capsys):
    short = lambda seed: dataclasses.replace(draw(seed), horizon=30)  # noqa: E731
    monkeypatch.setattr(decide, "draw", short)
    monkeypatch.setattr(decide, "write_json", lambda name, payload, quiet=False: payload)
    ledger = tmp_path / "ledger.json"
    argv = ["--a", "adamw:3e-3", "--b", ".", "--draws", "4", "--jobs", "1", "--ledger", str(ledger)]
    out = decide.main(argv)
    assert [r["seed"] for r in out["rows"]] == list(
        range(decide.DECISION_SEEDS, decide.DECISION_SEEDS + 4)
    )
    assert all(1 / decide.CLIP <= r["step"] <= decide.CLIP for r in out["rows"])
    entry = json.loads(ledger.read_text())[0]
    assert entry["status"] == "done" and entry["steps"]["n"] == 4 and entry["b_commit"]
    assert "geometric mean" in capsys.readouterr().out


def test_a_stopped_decision_keeps_the_prefix_of_its_seeds(tmp_path, monkeypatch):
    import benchmarks.common

    ledger = tmp_path / "ledger.json"
    first = decide.reserve(6, {"a": "x", "b": "y", "date": "today"}, ledger)[0]
    row = lambda seed, score: {"seed": seed, "kind": "mlp", "step": score, "time": score,  # noqa: E731
                               "a_diverged": False, "b_diverged": False}  # fmt: skip
    rows = [row(first + 1, 2.0), row(first, 1.5), row(first + 3, 0.1)]  # first + 2 unfinished
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.setattr(decide, "write_json", lambda name, payload, quiet=False: payload)
    (tmp_path / "mine.partial.json").write_text(json.dumps({"a": "x", "b": "y", "rows": rows}))
    out = decide.main(["--settle-partial", "mine", "--ledger", str(ledger)])
    assert [r["seed"] for r in out["rows"]] == [first, first + 1]  # not the later, cheap one
    entry = json.loads(ledger.read_text())[0]
    assert entry["status"] == "stopped after 2 of 6 draws" and entry["steps"]["n"] == 2
    with pytest.raises(SystemExit, match="no rows"):
        decide.main(["--settle-partial", "absent", "--ledger", str(ledger)])


def test_both_sides_of_a_draw_share_its_random_stream():
    """A variational autoencoder samples on every step: a side that replaces config fields
    (its network built twice) trains on the very stream of the side it is compared with,
    so an unchanged field scores exactly 1.0."""
    spec = dataclasses.replace(draw(12424), horizon=12)
    assert spec.kind == "autoencoder" and dict(spec.options)["variational"]
    base = rules.run(spec, ".")
    same = rules.run(spec, ".:table_step_mult=1")
    assert same["curve"] == base["curve"]
    assert decide.score_draw(same, base)["step"] == 1.0
