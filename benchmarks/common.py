"""Shared pieces of the quality benchmarks: tuning at two horizons, seeds, plots, JSON."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from learned_opt.allocator import tune_malloc
from learned_opt.meta_train.evaluation import final_loss, smooth, speedup, tune_baseline
from learned_opt.meta_train.inner import InnerOptimizer

RESULTS = Path(__file__).resolve().parent / "results"
SEEDS = (0, 1, 2)


def machine() -> dict:
    """Where and when a result was measured."""
    return {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "malloc_tuned": tune_malloc(),  # set already for every side (benchmarks/__init__)
    }


def tuned_at_horizons(kind: str, mixing: str, run, horizons: list[int]) -> dict:
    """Tune ``kind`` once over its grid on seed 0 at the longest horizon, then pick the best
    rate per horizon from the same curves (a curve's first ``h`` steps are the ``h``-step run)."""
    tuned = tune_baseline(kind, mixing, run)
    best = {}
    for h in horizons:
        best[h] = min(tuned["curves"], key=lambda lr: final_loss(tuned["curves"][lr][:h]))
    return {"best_lr": best, "curves": tuned["curves"], "grid": tuned["grid"]}


def seed_curves(kind: str, mixing: str, lr: float, run_seed, seed0_curve: list[float]) -> list:
    """Curves of ``kind`` at ``lr`` for every seed (seed 0 reuses the tuning curve)."""
    return [
        seed0_curve if s == 0 else run_seed(InnerOptimizer(kind, lr, mixing), s)["curve"]
        for s in SEEDS
    ]


def compare_at(learned: list[list[float]], baselines: dict, h: int) -> dict:
    """Per-seed speedup of the learned curves over the best baseline (by final loss) at h."""
    speedups, finals, best_names = [], {}, []
    for s, lc in enumerate(learned):
        per = {name: curves[s][:h] for name, curves in baselines.items()}
        best = min(per, key=lambda n: final_loss(per[n]))
        best_names.append(best)
        speedups.append(speedup(lc[:h], per[best]))
        for name, c in per.items():
            finals.setdefault(name, []).append(final_loss(c))
        finals.setdefault("learned", []).append(final_loss(lc[:h]))
    return {
        "speedup_median": statistics.median(speedups),
        "speedups": speedups,
        "best_baseline": best_names,
        "final_loss_mean": {k: _mean(v) for k, v in finals.items()},
        "learned_diverged": sum(not math.isfinite(final_loss(lc[:h])) for lc in learned),
    }


def _mean(xs: list[float]) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return statistics.fmean(finite) if len(finite) == len(xs) else math.inf


def compile_env(cache: str, threads: int) -> dict[str, str]:
    """The environment of a child process that trains with compiling on, at ``threads``
    threads, with the inductor cache ``cache`` holding its kernel folder (any
    ``LEARNED_OPT_KERNEL_DIR`` dropped, so that an empty ``cache`` means no kernel built)."""
    env = {
        **os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads),
        "LEARNED_OPT_COMPILE": "1",
    }  # fmt: skip
    env.pop("LEARNED_OPT_KERNEL_DIR", None)
    return env


def command_line(prefix: str, argv=None) -> str:
    """The command a result records: ``prefix`` then the arguments (``argv``, by default
    this process's), quoted for a shell, with nothing after ``prefix`` when there are none."""
    args = sys.argv[1:] if argv is None else list(argv)
    return f"{prefix} {shlex.join(args)}" if args else prefix


def write_json(name: str, payload: dict, quiet: bool = False) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float))
    if not quiet:
        print(f"wrote {path}")
    return path


def curves_png(name: str, panels: dict[str, dict[str, list[float]]], ncols: int = 4) -> Path:
    """A grid of loss-curve panels ``{title: {label: curve}}`` (smoothed, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    rows = max(1, math.ceil(n / ncols))
    fig, axes = plt.subplots(rows, ncols, figsize=(4 * ncols, 3 * rows), squeeze=False)
    for ax, (title, curves) in zip(axes.flat, panels.items()):
        for label, c in curves.items():
            ax.plot(smooth(c), label=label, lw=1)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=70)
    plt.close(fig)
    print(f"wrote {path}")
    return path
