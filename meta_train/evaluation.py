"""Evaluation of inner optimizers: loss curves, learning-rate-tuned baselines, speedups.

Used by validation during meta-training and by the benchmarks, so every comparison in the
project measures the same way:

* a curve is the per-step training loss, averaged over workers, smoothed by a trailing
  mean (``SMOOTH`` steps);
* a baseline is tuned over a fixed learning-rate grid by its final smoothed loss; if the
  best rate is at an edge of the grid the grid is extended in that direction;
* speedup = steps the baseline needs to reach level X / steps the learned optimizer needs,
  with X the worse of the two best levels (so it is defined either way; < 1 means slower).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .inner import InnerOptimizer, consensus_distance, inner_step, new_trajectory

SMOOTH = 10
#: Bumped whenever what a curve measures changes, so stale cached baselines are not reused.
CACHE_VERSION = 2
_ADAM_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
_SGD_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
#: The fixed 7-point learning-rate grids (extended at an edge when the best rate is there).
LR_GRIDS = {"adam": _ADAM_GRID, "adamw": _ADAM_GRID, "sgd": _SGD_GRID, "dsgt": _SGD_GRID}


def smooth(curve: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing mean; non-finite values count as +inf."""
    out, acc = [], []
    for x in curve:
        acc.append(x if math.isfinite(x) else math.inf)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc))
    return out


def final_loss(curve: list[float]) -> float:
    """The last smoothed value (inf when the run diverged)."""
    s = smooth(curve)
    return s[-1] if s else math.inf


def steps_to(curve_s: list[float], level: float) -> int | None:
    """1-based first step at which the smoothed curve is at or below ``level``."""
    for i, x in enumerate(curve_s):
        if x <= level:
            return i + 1
    return None


def steps_to_common_level(learned: list[float], baseline: list[float]) -> tuple[int, int] | None:
    """The steps the smoothed ``learned`` and ``baseline`` curves take to reach the worse of
    their two best levels, ``(learned, baseline)``; ``None`` where that level is not finite
    (a run diverged)."""
    ls, bs = smooth(learned), smooth(baseline)
    level = max(min(ls), min(bs))
    if not math.isfinite(level):
        return None
    return steps_to(ls, level), steps_to(bs, level)


def speedup(learned: list[float], baseline: list[float]) -> float:
    """Steps-to-level ratio (baseline / learned) at the worse of the two best levels."""
    steps = steps_to_common_level(learned, baseline)
    return 0.0 if steps is None else steps[1] / steps[0]


@torch.no_grad()
def run_curve(
    task,
    opt: InnerOptimizer,
    steps: int,
    num_workers: int = 1,
    topology: str = "ring",
    partition: str = "iid",
    alpha: float = 0.1,
    seed: int = 0,
    device=None,
) -> dict:
    """Train ``task`` for ``steps`` inner steps; the loss curve and final consensus distance."""
    traj = new_trajectory(task, num_workers, topology, partition, alpha, seed, steps, device)
    for _ in range(steps):
        losses, _ = inner_step(traj, opt)
        if not bool(torch.isfinite(losses).all()):
            traj.history[-1] = math.inf
            traj.history.extend([math.inf] * (steps - traj.step))
            break
    return {
        "curve": list(traj.history),
        "final": final_loss(traj.history),
        "consensus": consensus_distance(traj),
        "diverged": not math.isfinite(final_loss(traj.history)),
        "params": traj.layout.unflatten(traj.params),
    }


def tune_baseline(kind: str, mixing: str, run, grid=None) -> dict:
    """Best learning rate of ``kind`` ("adam"/"sgd") over the grid; ``run(opt)`` -> curve dict.

    The grid is extended by factors of ~3 while the best rate sits at its edge (at most 3
    times each way).
    """
    grid = list(grid or LR_GRIDS[kind])
    results = {}

    def evaluate(lr):
        if lr not in results:
            out = run(InnerOptimizer(kind, lr, mixing))
            results[lr] = {"curve": out["curve"], "consensus": out["consensus"]}
        return final_loss(results[lr]["curve"])

    for lr in grid:
        evaluate(lr)
    for _ in range(3):
        best = min(results, key=lambda lr: evaluate(lr))
        lrs = sorted(results)
        if best == lrs[0]:
            evaluate(best / math.sqrt(10))
        elif best == lrs[-1]:
            evaluate(best * math.sqrt(10))
        else:
            break
    best = min(results, key=lambda lr: evaluate(lr))
    return {
        "lr": best,
        "curve": results[best]["curve"],
        "consensus": results[best]["consensus"],
        "final": final_loss(results[best]["curve"]),
        "grid": sorted(results),
        "curves": {lr: r["curve"] for lr, r in results.items()},
    }


class BaselineCache:
    """Tuned baseline curves, keyed by setting, kept in memory and optionally in a JSON file."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else None
        self.data: dict = {}
        if self.path and self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self.data = {}  # a corrupt cache is recomputed, never trusted

    def get(self, key: str, compute):
        if key not in self.data:
            self.data[key] = compute()
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.data))
                os.replace(tmp, self.path)
        return self.data[key]


def compare(
    task,
    learned: InnerOptimizer,
    cache: BaselineCache,
    steps: int,
    num_workers: int = 1,
    topology: str = "ring",
    partition: str = "iid",
    alpha: float = 0.1,
    seed: int = 0,
    baseline: str = "adam",
    device=None,
) -> dict:
    """Learned optimizer vs the tuned baseline (D-baseline with Metropolis when N > 1)."""
    setting = dict(
        num_workers=num_workers, topology=topology, partition=partition, alpha=alpha,
        seed=seed, device=device,
    )  # fmt: skip

    def run(opt):
        return run_curve(task, opt, steps, **setting)

    key = (
        f"{task.describe()}|{baseline}|{steps}|{num_workers}|{topology}|{partition}|{alpha}|{seed}"
    )
    base = cache.get(key, lambda: tune_baseline(baseline, "metropolis", run))
    ours = run(learned)
    return {
        "task": task.name,
        "speedup": speedup(ours["curve"], base["curve"]),
        "learned_final": ours["final"],
        "baseline_final": base["final"],
        "baseline_lr": base["lr"],
        "learned_curve": ours["curve"],
        "baseline_curve": base["curve"],
        "consensus": ours["consensus"],
        "baseline_consensus": base["consensus"],
        "diverged": ours["diverged"],
    }
