"""The side-by-side step benchmark: another revision imported apart, and its docs table."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import rules, step_ab  # noqa: E402


def test_a_revision_is_imported_apart_and_timed_beside_this_one():
    import learned_opt.optimizer

    base, commit = step_ab.import_revision("HEAD")
    assert base.__name__ == f"learned_opt_{commit}.optimizer"
    assert base.LearnedOptimizer is not learned_opt.optimizer.LearnedOptimizer
    assert Path(base.__file__).is_relative_to(rules.CACHE / commit)
    ckpt = step_ab.base_checkpoint(base)  # the revision's own, with its own config
    assert ckpt.is_file() and ckpt.is_relative_to(rules.CACHE / commit)
    row = step_ab.measure("val_friedman_mlp", base, steps=1, rounds=2)  # steps with ckpt
    assert set(row["ms"]) == {"adamw", "base", "this"} and min(row["ms"].values()) > 0
    assert row["parameters"] == 4929
    assert row["max_rel_diff"] < 1e-6  # HEAD's step and the checkout's agree
