"""Learned sides side by side on the registry tasks (the meta-training family's fixed
tasks), single worker, against the best of Adam, AdamW and SGD+momentum.

The baselines run at the rates :mod:`benchmarks.quality_single` tuned per task and horizon
(stored in ``benchmarks/results/quality_single.json``), at every seed; each side runs
untuned. The registry tasks are not held out, so this is where a change of the rule is
chosen before the held-out suite (:mod:`benchmarks.quality_heldout`) confirms it.
Baseline curves are cached in ``benchmarks/results/registry_sides_baselines.json`` (not
committed). Writes ``benchmarks/results/<out>.json``.

    python -m benchmarks.registry_sides --side adapt_init \\
        --side no_ceiling=adapt_init:lr_adapt_max_ortho=7 --seeds 0 1 2 --jobs 2

A side is ``label=checkpoint[:field=value,...]`` (config fields replaced), as in
:mod:`benchmarks.gossip_validation`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from benchmarks.common import RESULTS, machine, write_json
from benchmarks.gossip_validation import parse_side, side_optimizer
from benchmarks.heldout_single import diverged
from learned_opt.meta_train.evaluation import final_loss, run_curve, speedup
from learned_opt.meta_train.inner import InnerOptimizer
from learned_opt.tasks import get_task

TUNED = RESULTS / "quality_single.json"
CACHE = RESULTS / "registry_sides_baselines.json"
STEPS = 2000
HORIZONS = (200, 2000)
#: Left out by default: 1200 s of its own in quality_single, and char_transformer is the
#: family's language model already.
SKIP = ("char_gru",)


def tuned_rates(tasks: list[str] | None) -> dict[str, dict[int, dict[str, float]]]:
    """``{task: {horizon: {baseline: lr}}}`` from quality_single's record."""
    if not TUNED.exists():
        raise SystemExit(f"{TUNED} is missing: run benchmarks/quality_single.py first")
    rows = json.loads(TUNED.read_text())["tasks"]
    out = {}
    for row in rows:
        if (tasks is None and row["task"] in SKIP) or (tasks and row["task"] not in tasks):
            continue
        out[row["task"]] = {h: row[f"h{h}"]["best_lr"] for h in HORIZONS}
    if tasks and set(tasks) - set(out):
        raise SystemExit(f"no tuned rates for {sorted(set(tasks) - set(out))} in {TUNED}")
    return out


def _optimizer(side: tuple[str, str, dict] | None, kind: str, lr: float) -> InnerOptimizer:
    if side is None:
        return InnerOptimizer(kind, lr, "none")
    _, checkpoint, fields = side
    return side_optimizer(checkpoint, fields, mixing="none")


def run_job(task: str, side, kind: str, lr: float, seed: int) -> list[float]:
    torch.set_num_threads(1)
    return run_curve(get_task(task), _optimizer(side, kind, lr), STEPS, seed=seed)["curve"]


def baseline_key(task: str, kind: str, lr: float, seed: int) -> str:
    return f"{task}|{kind}|{lr}|{seed}"


def score(curves: dict, rates: dict, sides: list, seeds: list[int]) -> list[dict]:
    """Per side, task and horizon: the median over the seeds of the step speedup over the
    best baseline at that seed (by final smoothed loss)."""
    rows = []
    for label, _, _ in sides:
        for task, by_h in rates.items():
            for h in HORIZONS:
                per_seed = []
                for s in seeds:
                    ours = curves[("side", label, task, s)][:h]
                    bases = [curves[baseline_key(task, k, lr, s)][:h] for k, lr in by_h[h].items()]
                    per_seed.append(speedup(ours, min(bases, key=final_loss)))
                rows.append({
                    "side": label, "task": task, "horizon": h,
                    "speedup": round(statistics.median(per_seed), 4),
                    "speedup_by_seed": [round(x, 4) for x in per_seed],
                    "diverged": sum(diverged(curves[("side", label, task, s)][:h]) for s in seeds),
                })  # fmt: skip
    return rows


def summarise(rows: list[dict], sides: list) -> dict:
    out = {}
    for label, _, _ in sides:
        mine = [r for r in rows if r["side"] == label]
        out[label] = {
            "median_speedup": round(statistics.median(r["speedup"] for r in mine), 4),
            **{
                f"median_speedup_h{h}": round(
                    statistics.median(r["speedup"] for r in mine if r["horizon"] == h), 4
                )
                for h in HORIZONS
            },
            "rows_below_0.8": sum(r["speedup"] < 0.8 for r in mine),
            "diverged_runs": sum(r["diverged"] for r in mine),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", type=parse_side, required=True,
                        help="label=checkpoint[:field=value,...]; repeat for each side")  # fmt: skip
    parser.add_argument("--tasks", nargs="*", help=f"default: every tuned task but {SKIP}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="registry_sides")
    args = parser.parse_args(argv)
    labels = [s[0] for s in args.side]
    if len(set(labels)) != len(labels):
        parser.error(f"side labels must differ: {labels}")
    for label, checkpoint, fields in args.side:  # fail early on a bad side
        try:
            side_optimizer(checkpoint, fields, mixing="none")
        except (TypeError, ValueError, OSError) as exc:
            parser.error(f"side {label!r}: {exc}")
    rates = tuned_rates(args.tasks)
    start = time.perf_counter()
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    curves: dict = dict(cache)
    jobs = {}
    for task, by_h in rates.items():
        for s in args.seeds:
            for kind, lr in {(k, lr) for h in HORIZONS for k, lr in by_h[h].items()}:
                key = baseline_key(task, kind, lr, s)
                if key not in curves:
                    jobs[key] = (task, None, kind, lr, s)
            for side in args.side:
                jobs[("side", side[0], task, s)] = (task, side, "learned", 1.0, s)
    print(f"{len(jobs)} runs of {STEPS} steps on {len(rates)} tasks", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_job, *job): key for key, job in jobs.items()}
        for i, fut in enumerate(as_completed(futures), 1):
            key = futures[fut]
            curves[key] = fut.result()
            if isinstance(key, str):
                cache[key] = curves[key]
            if i % 10 == 0 or i == len(futures):
                print(f"{i}/{len(futures)} runs ({time.perf_counter() - start:.0f} s)", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = CACHE.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache))
    os.replace(tmp, CACHE)
    rows = score(curves, rates, args.side, args.seeds)
    summary = summarise(rows, args.side)
    for label, s in summary.items():
        print(f"{label}: median {s['median_speedup']:.2f} (200: {s['median_speedup_h200']:.2f}, "
              f"2000: {s['median_speedup_h2000']:.2f}), rows below 0.8: {s['rows_below_0.8']}")  # fmt: skip
    write_json(args.out, {
        "benchmark": "registry_sides",
        "sides": [{"label": lb, "checkpoint": ck, "fields": f} for lb, ck, f in args.side],
        "seeds": args.seeds, "horizons": list(HORIZONS), "tuned_from": TUNED.name,
        "summary": summary, "rows": rows,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": "python -m benchmarks.registry_sides " + " ".join(
            f"--side {lb}={ck}" + (":" + ",".join(f"{k}={v:g}" for k, v in f.items()) if f else "")
            for lb, ck, f in args.side) + f" --seeds {' '.join(map(str, args.seeds))}",
        **machine(),
    })  # fmt: skip


if __name__ == "__main__":
    main()
