"""Shared pieces of the benchmarks: where and how a result was measured, JSON, plots."""

from __future__ import annotations

import gzip
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from learned_opt.allocator import tune_malloc
from learned_opt.meta_train.evaluation import BaselineCache, smooth

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """Where and when a result was measured."""
    return {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "malloc_tuned": tune_malloc(),  # set already for every side (benchmarks/__init__)
    }


class Cache(BaselineCache):
    """A :class:`~learned_opt.meta_train.evaluation.BaselineCache` whose file is gzipped when
    its name ends in ``.gz``: the tuned baselines' curves are most of the bytes of
    ``benchmarks/results``."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(None)
        self.path = Path(path)
        if self.path.exists():
            raw = self.path.read_bytes()
            try:
                self.data = json.loads(gzip.decompress(raw) if self.path.suffix == ".gz" else raw)
            except (OSError, ValueError):
                self.data = {}  # a corrupt cache is recomputed, never trusted

    def get(self, key: str, compute):
        if key not in self.data:
            self.data[key] = compute()
            raw = json.dumps(self.data).encode()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(gzip.compress(raw) if self.path.suffix == ".gz" else raw)
            os.replace(tmp, self.path)
        return self.data[key]


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


def commit() -> str:
    """The checkout's commit, with "+dirty" when the rule's code has uncommitted changes."""
    git = lambda *a: subprocess.run(["git", *a], cwd=RESULTS.parents[1], capture_output=True,  # noqa: E731
                                    text=True)  # fmt: skip
    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "learned_opt", "distributed", "meta_train/inner.py")
    return head + ("+dirty" if dirty.stdout.strip() else "")


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
