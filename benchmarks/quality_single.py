"""Learned optimizer vs learning-rate-tuned Adam, AdamW and SGD+momentum, single worker.

Every fixed task, 3 seeds, two horizons: the meta-training validation horizon ``H`` and
``10 H``. Each baseline is tuned over its fixed 7-point grid (extended at an edge) on seed
0 per task and horizon, by final loss; the target is the best baseline's final loss.
Writes ``benchmarks/results/quality_single.json`` and ``quality_single.png``.

    python benchmarks/quality_single.py [--checkpoint default] [--horizon 200] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from benchmarks.common import (
    SEEDS,
    compare_at,
    curves_png,
    machine,
    seed_curves,
    tuned_at_horizons,
    write_json,
)
from learned_opt.checkpoint import load_checkpoint
from learned_opt.meta_train.evaluation import run_curve
from learned_opt.meta_train.inner import make_inner_optimizer
from learned_opt.tasks import get_task, list_tasks

BASELINES = ("adam", "adamw", "sgd")


def bench_task(name: str, checkpoint: str, horizon: int) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    task = get_task(name)
    long = 10 * horizon
    horizons = [horizon, long]

    def run_seed(opt, seed):
        return run_curve(task, opt, long, seed=seed)

    baselines = {}
    for kind in BASELINES:
        tuned = tuned_at_horizons(kind, "none", lambda opt: run_seed(opt, 0), horizons)
        baselines[kind] = {
            h: seed_curves(
                kind, "none", tuned["best_lr"][h], run_seed, tuned["curves"][tuned["best_lr"][h]]
            )
            for h in horizons
        }
        baselines[kind]["best_lr"] = tuned["best_lr"]
    net, _ = load_checkpoint(checkpoint)
    learned = [
        run_seed(make_inner_optimizer("learned", net=net, mixing="none", parts=None), s)["curve"]
        for s in SEEDS
    ]
    result = {"task": name, "num_params": task.num_params, "kind": task.kind}
    for h in horizons:
        result[f"h{h}"] = compare_at(learned, {k: baselines[k][h] for k in BASELINES}, h)
        result[f"h{h}"]["best_lr"] = {k: baselines[k]["best_lr"][h] for k in BASELINES}
    result["curves_seed0"] = {
        "learned": learned[0],
        **{k: baselines[k][long][0] for k in BASELINES},
    }
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"{name}: speedup {result[f'h{horizon}']['speedup_median']:.2f} at {horizon}, "
          f"{result[f'h{long}']['speedup_median']:.2f} at {long} ({result['seconds']} s)", flush=True)  # fmt: skip
    return result


def _payload(args, card: dict, results: list, total: int, seconds: float) -> dict:
    results = sorted(results, key=lambda r: list_tasks().index(r["task"]))
    summary = {}
    for h in (args.horizon, 10 * args.horizon):
        speeds = [r[f"h{h}"]["speedup_median"] for r in results]
        summary[f"h{h}"] = {
            "median_speedup": statistics.median(speeds),
            "tasks_faster": sum(s > 1 for s in speeds),
            "tasks": len(speeds),
            "learned_diverged_runs": sum(r[f"h{h}"]["learned_diverged"] for r in results),
        }
    return {
        "benchmark": "quality_single",
        "complete": len(results) == total,
        "total": total,
        "checkpoint": args.checkpoint,
        "checkpoint_card_name": card.get("name"),
        "horizons": [args.horizon, 10 * args.horizon],
        "seeds": list(SEEDS),
        "baselines": list(BASELINES),
        "summary": summary,
        "tasks": [{k: v for k, v in r.items() if k != "curves_seed0"} for r in results],
        "wall_seconds": round(seconds, 1),
        **machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="default")
    parser.add_argument("--horizon", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tasks", nargs="*", default=None, help="default: every fixed task")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = args.tasks or list_tasks()
    names.sort(key=lambda n: get_task(n).kind != "lm")  # the slowest tasks start first
    start = time.perf_counter()
    _, card = load_checkpoint(args.checkpoint)
    results = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(bench_task, n, args.checkpoint, args.horizon) for n in names]
        for future in as_completed(futures):
            results.append(future.result())
            payload = _payload(args, card, results, len(names), time.perf_counter() - start)
            write_json("quality_single", payload)  # partial results survive an interruption
    curves_png("quality_single", {f"{r['task']} (seed 0)": r["curves_seed0"] for r in results})


if __name__ == "__main__":
    main()
