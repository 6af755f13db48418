"""Learned optimizer + learned mixing vs D-SGD, D-Adam (Metropolis) and gradient tracking.

Simulated workers (8 and 32; 64 to show it scales past the meta-training range of at most
8) on ring, torus and one-peer-exponential, with IID and Dirichlet(0.1) data, on one task.
Every baseline is tuned over its fixed grid per setting (seed 0) by final loss. Reports the
speedup over the best baseline, the final loss of the averaged model on the training set
and the consensus distance. Writes ``benchmarks/results/quality_decentralized.json``/``.png``.

    python -m benchmarks.quality_decentralized [--task digits_mlp] [--horizon 200] [--jobs 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from benchmarks.common import curves_png, machine, write_json
from learned_opt.checkpoint import load_checkpoint
from learned_opt.meta_train.evaluation import final_loss, run_curve, speedup, tune_baseline
from learned_opt.meta_train.inner import make_inner_optimizer
from learned_opt.tasks import get_task

WORKERS = (8, 32, 64)
TOPOLOGIES = ("ring", "torus", "one_peer_exponential")
PARTITIONS = ("iid", "dirichlet")
BASELINES = {"D-SGD": "sgd", "D-Adam": "adam", "DSGT": "dsgt"}


def _averaged_loss(task, out: dict) -> float:
    avg = {k: v.mean(0) for k, v in out["params"].items()}
    return task.evaluate(avg, split="train")["loss"]


def bench_setting(task_name, checkpoint, horizon, workers, topology, partition) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    task = get_task(task_name)
    setting = dict(num_workers=workers, topology=topology, partition=partition, alpha=0.1, seed=0)
    runs = {}

    def run(opt):
        out = run_curve(task, opt, horizon, **setting)
        runs[(opt.kind, opt.lr)] = out
        return out

    rows = {}
    for label, kind in BASELINES.items():
        tuned = tune_baseline(kind, "metropolis", run)
        out = runs[(kind, tuned["lr"])]
        rows[label] = {"lr": tuned["lr"], "curve": out["curve"], "final": tuned["final"],
                       "averaged_model_loss": _averaged_loss(task, out), "consensus": out["consensus"]}  # fmt: skip
    net, _ = load_checkpoint(checkpoint)
    out = run(make_inner_optimizer("learned", net=net, mixing="learned", parts=None))
    learned = {"curve": out["curve"], "final": final_loss(out["curve"]),
               "averaged_model_loss": _averaged_loss(task, out), "consensus": out["consensus"]}  # fmt: skip
    best = min(rows, key=lambda k: rows[k]["final"])
    result = {
        "workers": workers, "topology": topology, "partition": partition,
        "best_baseline": best,
        "speedup": speedup(learned["curve"], rows[best]["curve"]),
        "speedup_vs": {k: speedup(learned["curve"], r["curve"]) for k, r in rows.items()},
        "learned": {k: v for k, v in learned.items() if k != "curve"},
        "baselines": {k: {kk: vv for kk, vv in r.items() if kk != "curve"} for k, r in rows.items()},
        "curves": {"learned": learned["curve"], **{k: r["curve"] for k, r in rows.items()}},
        "seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    print(f"{workers:>2} workers {topology:<22} {partition:<9} speedup {result['speedup']:.2f} "
          f"vs {best} ({result['seconds']} s)", flush=True)  # fmt: skip
    return result


def _payload(args, results: list, total: int, seconds: float) -> dict:
    results = sorted(results, key=lambda r: (r["workers"], r["topology"], r["partition"]))
    summary = {}
    for workers in sorted({r["workers"] for r in results}):
        sub = [r for r in results if r["workers"] == workers]
        summary[str(workers)] = {
            "median_speedup": statistics.median(r["speedup"] for r in sub),
            "settings_faster": sum(r["speedup"] > 1 for r in sub),
            "settings": len(sub),
        }
    return {
        "benchmark": "quality_decentralized",
        "complete": len(results) == total,
        "total": total,
        "task": args.task,
        "checkpoint": args.checkpoint,
        "horizon": args.horizon,
        "dirichlet_alpha": 0.1,
        "summary": summary,
        "median_speedup_all": statistics.median(r["speedup"] for r in results),
        "settings": [{k: v for k, v in r.items() if k != "curves"} for r in results],
        "wall_seconds": round(seconds, 1),
        **machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="default")
    parser.add_argument("--task", default="digits_mlp")
    parser.add_argument("--horizon", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="*", default=list(WORKERS))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    grid = list(itertools.product(args.workers, TOPOLOGIES, PARTITIONS))
    grid.sort(key=lambda g: -g[0])  # the largest settings start first
    start = time.perf_counter()
    results = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(bench_setting, args.task, args.checkpoint, args.horizon, *g) for g in grid
        ]
        for future in as_completed(futures):
            results.append(future.result())
            payload = _payload(args, results, len(grid), time.perf_counter() - start)
            write_json("quality_decentralized", payload)  # partial results survive
    panels = {
        f"{r['workers']}w {r['topology']} {r['partition']}": r["curves"]
        for r in results if r["workers"] == max(args.workers)
    }  # fmt: skip
    curves_png("quality_decentralized", panels, ncols=3)


if __name__ == "__main__":
    main()
