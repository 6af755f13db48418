"""Zero-tuning anchors on the held-out suite's single-worker rows.

The anchors of :mod:`benchmarks.validation_anchors` run untuned on every task and horizon
of the held-out suite, scored as the suite scores the rule: the median over seeds of the
step speedup against the suite's cached tuned AdamW (run the suite first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from benchmarks import heldout_single as single
from benchmarks import validation_anchors as anchors
from benchmarks.common import RESULTS, Cache, command_line, machine, write_json
from benchmarks.quality_heldout import CACHE, DEC_SEEDS, DEFAULT_LONG, LONG, SHORT
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.meta_train.evaluation import speedup
from learned_opt.tasks import list_heldout_tasks


def adamw_runs(cache: dict, task: str, seed: int) -> dict[str, list[float]]:
    """The suite's cached AdamW runs of ``task`` at ``seed``, keyed as
    :func:`benchmarks.heldout_single.best_adamw` reads them."""
    prefix, suffix = f"single|{task}|", f"|{seed}"
    return {
        key[len(prefix) : -len(suffix)]: curve
        for key, curve in cache.items()
        if key.startswith(prefix) and key.endswith(suffix)
    }


def score(cache: dict, task: str, h: int, seed: int, curve: list[float]) -> float:
    best = single.best_adamw(adamw_runs(cache, task, seed), h)
    if best is None:
        raise SystemExit(f"no tuned AdamW run of {task} at {h} steps, seed {seed} in {CACHE}")
    return round(speedup(curve, best["curve"]), 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEC_SEEDS))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    suite = RESULTS / "quality_heldout.json"
    if not suite.exists() or not CACHE.exists():
        parser.error(f"{suite.name} and {CACHE.name} are missing: run the suite first "
                     "(python -m benchmarks.quality_heldout)")  # fmt: skip
    cache = Cache(CACHE).data
    learned = {
        (r["task"], r["horizon"]): r["speedup"]
        for r in json.loads(suite.read_text())["single"]
        if r["side"] == DEFAULT_CHECKPOINT
    }
    jobs = [
        (task, h, seed, a)
        for task in list_heldout_tasks()
        for h in (SHORT, LONG.get(task, DEFAULT_LONG))
        for seed in args.seeds
        for a in anchors.ANCHORS
    ]
    start = time.perf_counter()
    scores: dict[tuple, list[float]] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(anchors.run_anchor, t, a, h, s): (t, h, s, a) for t, h, s, a in jobs}
        for done, future in enumerate(as_completed(futures), 1):
            task, h, seed, a = futures[future]
            x = score(cache, task, h, seed, future.result()["curve"])
            scores.setdefault((task, h, a), []).append(x)
            print(f"[{done}/{len(jobs)}] {task}@{h} seed {seed} {a}: {x:.3f}x", flush=True)
    rows = [
        {
            "task": task, "horizon": h, "learned": learned.get((task, h)),
            "anchors": {a: statistics.median(scores[task, h, a]) for a in anchors.ANCHORS},
        }
        for task in list_heldout_tasks()
        for h in (SHORT, LONG.get(task, DEFAULT_LONG))
    ]  # fmt: skip
    medians = {
        a: round(statistics.median(r["anchors"][a] for r in rows), 4) for a in anchors.ANCHORS
    }
    mine = [r["learned"] for r in rows if r["learned"] is not None]
    payload = {
        "benchmark": "heldout_anchors",
        "rows": rows,
        "summary": {
            "median_speedup": medians,
            "learned_median_speedup": round(statistics.median(mine), 4) if mine else None,
            "learned_side": DEFAULT_CHECKPOINT,
        },
        "seeds": args.seeds,
        "anchor_versions": anchors.versions(),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": command_line("python -m benchmarks.heldout_anchors", argv),
        **machine(),
    }
    write_json("heldout_anchors", payload)
    print(f"anchors' medians {medians}; the rule {payload['summary']['learned_median_speedup']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
