"""The eager-step benchmark: its sides take the same step, and its docs table."""

from __future__ import annotations

import sys
from pathlib import Path

from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import eager_step  # noqa: E402
from benchmarks.report_sections import render_eager_step  # noqa: E402
from learned_opt import kernel  # noqa: E402


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_sides_take_the_same_step_and_the_table_shows_them():
    step = kernel.tensor_step
    row = eager_step.measure(_tiny, steps=2, repeats=1)
    assert kernel.tensor_step is step  # every side's patch undone
    assert set(row["ms"]) == {"masked", "mask_read", "adamw"}
    assert all(v > 0 for v in row["ms"].values())
    assert row["max_rel_diff_vs_masked"] == {"masked": 0.0, "mask_read": 0.0}
    assert row["parameters"] == sum(p.numel() for p in _tiny().parameters())
    r = {"rows": {"tiny": row}, "date": "2026-12-03", "machine": "m", "torch": "t",
         "load_average_end": 0.1, "command": "c"}  # fmt: skip
    table = render_eager_step(r)
    assert table.startswith("| model |") and "| tiny | 83 |" in table


def test_a_masked_side_really_masks(monkeypatch):
    seen = []

    def spy(*args, **kw):
        seen.append(kw["read_mask"])
        return step(*args, **kw)

    step = kernel.tensor_step
    monkeypatch.setattr(kernel, "tensor_step", spy)
    undo = eager_step._side("masked")
    try:
        model = eager_step._model(_tiny)
        from learned_opt import LearnedOptimizer

        LearnedOptimizer(model.parameters(), compile=False).step()
    finally:
        undo()
    assert seen and not any(seen)
