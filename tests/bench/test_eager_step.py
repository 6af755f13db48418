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


def test_sides_take_the_same_step_and_the_table_shows_them(monkeypatch):
    step, key, bound = kernel._step_stacked, kernel._stack_key, kernel.PACK_NUMEL
    after, is_built = kernel.COMPILE_AFTER_SECONDS, kernel._is_built
    queued = []
    monkeypatch.setattr(kernel._Worker, "submit", lambda self, *a: queued.append(a))
    sides = (*eager_step.SIDES, "packed_4")
    row = eager_step.measure(_tiny, steps=2, repeats=1, sides=sides)
    assert kernel._step_stacked is step and kernel._stack_key is key  # patches undone
    assert kernel.PACK_NUMEL == bound
    assert kernel.COMPILE_AFTER_SECONDS == after and kernel._is_built is is_built
    assert not queued  # the default side's optimizer stepped the reference throughout
    assert set(row["ms"]) == {"masked", "mask_read", "packed", "default", "packed_4", "adamw"}
    assert all(v > 0 for v in row["ms"].values())
    diff = row["max_rel_diff_vs_masked"]
    assert diff["masked"] == 0.0
    assert diff["mask_read"] < 1e-6  # its bias corrections are computed on the host
    assert diff["packed"] < 1e-5 and diff["packed_4"] < 1e-5  # the rounding of the sums
    assert diff["default"] == diff["packed"]  # the same packs
    assert row["parameters"] == sum(p.numel() for p in _tiny().parameters())
    r = {"rows": {"tiny": row}, "date": "2026-12-03", "machine": "m", "torch": "t",
         "load_average_end": 0.1, "command": "c", "sides": list(sides), "pack_numel": 16}  # fmt: skip
    table = render_eager_step(r)
    assert table.startswith("| model |") and "| tiny | 83 |" in table
    assert "packed up to 4 / AdamW" in table and "at most 16 elements" in table
    assert "compile=True, before its kernels / AdamW" in table


def test_a_masked_side_really_masks(monkeypatch):
    seen = []

    def spy(*args, **kw):
        seen.append(kw["read_mask"])
        return step(*args, **kw)

    step = kernel._step_stacked
    monkeypatch.setattr(kernel, "_step_stacked", spy)
    undo = eager_step._side("masked")
    try:
        model = eager_step._model(_tiny)
        from learned_opt import LearnedOptimizer

        LearnedOptimizer(model.parameters(), compile=False).step()
    finally:
        undo()
    assert seen and not any(seen)


def test_a_registered_task_s_model_can_be_timed():
    model = eager_step._model(eager_step._task_model("val_friedman_mlp"))
    assert sum(p.numel() for p in model.parameters()) == 4929
    assert all(p.grad is not None for p in model.parameters())
