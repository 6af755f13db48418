"""Meta-training throughput: inner steps x workers per second for a meta-training config.

Builds the ``MetaTrainModule`` of the config, runs a few warm-up meta-steps, then times
``--steps`` meta-steps of the configured estimator (no validation, no logging). Writes
``experiments/results/meta_train_throughput.json``.

    python -m experiments.meta_train_throughput [--config meta_train/configs/default.yaml]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

from benchmarks.common import machine
from benchmarks.meta_throughput import meta_step
from learned_opt.meta_train.module import MetaTrainModule

ROOT = Path(__file__).resolve().parents[1]


def measure(module: MetaTrainModule, steps: int, first_step: int = 0) -> tuple[int, float]:
    """Worker-steps done and seconds taken by ``steps`` estimator calls (theta unchanged;
    :func:`benchmarks.meta_throughput.meta_step` each)."""
    done, seconds = 0, 0.0
    for k in range(first_step, first_step + steps):
        n, t = meta_step(module, k)
        done, seconds = done + n, seconds + t
    return done, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "meta_train/configs/default.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = yaml.safe_load(Path(args.config).read_text())
    results = {}
    for estimator in ("tbptt", "pes"):
        model_args = {**config["model"], "estimator": estimator, "baseline_cache": None}
        module = MetaTrainModule(**model_args)
        measure(module, 2)  # warm-up: first trajectories, allocator
        worker_steps, seconds = measure(module, args.steps, first_step=2)
        results[estimator] = {
            "inner_steps_x_workers_per_s": worker_steps / seconds,
            "seconds_per_meta_step": seconds / args.steps,
            "meta_steps": args.steps,
        }
        print(f"{estimator}: {results[estimator]['inner_steps_x_workers_per_s']:.0f} inner steps x "
              f"workers / s, {results[estimator]['seconds_per_meta_step']:.2f} s per meta-step", flush=True)  # fmt: skip
    out = Path(__file__).parent / "results" / "meta_train_throughput.json"
    out.write_text(json.dumps({"config": args.config, "results": results, **machine()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
