"""The decision procedure: rule A against rule B on freshly drawn jobs.

Both rules train the same N jobs drawn from :mod:`learned_opt.tasks.distribution`. A draw's
score is A's step speedup over B (:func:`learned_opt.meta_train.evaluation.speedup`: the
steps B needs to reach the worse of the two best smoothed losses over the steps A needs),
clipped to [1/20, 20] so that a diverged run counts as a large loss without an infinite log.
The verdict reads the geometric mean with a 95 % bootstrap interval, overall and per kind:

    A ships only if the interval's lower end is above 1.0 and no kind's geometric mean is
    below 0.97. A median that rises while a kind falls is a loss.

The same scores in time are reported beside: each run's steps to the level times its
measured seconds per step (the optimizer's construction and any compile included).

Seeds. The draws of a decision are the next N seeds after every seed the ledger
(``benchmarks/ledger.json``) has given out, from :data:`DECISION_SEEDS` on; the decision is
written to the ledger before its first run, so a seed is never drawn for two choices, even if
a run is stopped. Seeds below :data:`DECISION_SEEDS` belong to the reporting draw
(``benchmarks/report_draw.py``); meta-training draws from :data:`META_SEEDS` on.

    OMP_NUM_THREADS=1 python -m benchmarks.decide --a . --b bbd8f5d --draws 200 --jobs 2

Writes ``benchmarks/results/decide.json`` (every draw's curves' scores; ``--out``) and the
summary into the ledger.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks import rules  # noqa: E402
from benchmarks.common import command_line, write_json  # noqa: E402
from learned_opt.meta_train.evaluation import steps_to_common_level  # noqa: E402
from learned_opt.tasks.distribution import KINDS, draw  # noqa: E402

LEDGER = Path(__file__).resolve().parent / "ledger.json"
DECISION_SEEDS = 10_000  # decisions draw from here on; below it: the reporting draw
META_SEEDS = 10_000_000  # meta-training draws from here on
CLIP = 20.0
KIND_FLOOR = 0.97


# ----------------------------------------------------------------------------- the ledger
def read_ledger(path: Path = LEDGER) -> list[dict]:
    """The ledger's decisions (an empty list if there is none yet)."""
    if not path.is_file():
        return []
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of decisions")
    return entries


def reserve(n: int, entry: dict, path: Path = LEDGER) -> list[int]:
    """The next ``n`` unused decision seeds, recorded in the ledger with ``entry``."""
    entries = read_ledger(path)
    first = max([DECISION_SEEDS] + [e["first_seed"] + e["draws"] for e in entries])
    if first + n > META_SEEDS:
        raise ValueError("the decision seeds are used up")
    entries.append({**entry, "first_seed": first, "draws": n, "status": "running"})
    path.write_text(json.dumps(entries, indent=1) + "\n")
    return list(range(first, first + n))


def settle(first_seed: int, summary: dict, path: Path = LEDGER) -> None:
    """Record a decision's outcome beside its seeds (``status`` "done" unless it says)."""
    entries = read_ledger(path)
    for e in entries:
        if e["first_seed"] == first_seed:
            e.update({"status": "done", **summary})
    path.write_text(json.dumps(entries, indent=1) + "\n")


# ----------------------------------------------------------------------------- scoring
def clipped(x: float) -> float:
    return min(max(x, 1 / CLIP), CLIP)


def score_draw(a: dict, b: dict) -> dict:
    """A's step and time speedups over B on one draw. A run that diverged where the other
    did not scores the clip (the common level alone would credit its first steps)."""
    a_div, b_div = rules.diverged(a["curve"]), rules.diverged(b["curve"])
    if a_div != b_div:
        step = 1 / CLIP if a_div else CLIP
        return {"step": step, "time": step, "a_diverged": a_div, "b_diverged": b_div}
    steps = steps_to_common_level(a["curve"], b["curve"])  # what speedup() divides, once
    step = clipped(0.0 if steps is None else steps[1] / steps[0])
    time_score = step
    if steps is not None:
        per_a, per_b = a["seconds"] / len(a["curve"]), b["seconds"] / len(b["curve"])
        time_score = clipped(steps[1] * per_b / (steps[0] * per_a))
    return {"step": step, "time": time_score, "a_diverged": a_div, "b_diverged": b_div}


def geomean(xs) -> float:
    return float(math.exp(statistics.fmean(math.log(x) for x in xs)))


def bootstrap(xs: list[float], reps: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the geometric mean, resampling draws."""
    logs = np.log(np.asarray(xs))
    idx = np.random.default_rng(seed).integers(0, len(logs), (reps, len(logs)))
    means = np.exp(logs[idx].mean(1))
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarise(rows: list[dict], key: str = "step") -> dict:
    """Geometric mean, interval, median, share won and per-kind means of ``rows``' scores,
    and the verdict."""
    xs = [r[key] for r in rows]
    low, high = bootstrap(xs)
    kinds = {}
    for k in sorted({r["kind"] for r in rows}):
        ks = [r[key] for r in rows if r["kind"] == k]
        kinds[k] = {"n": len(ks), "geomean": round(geomean(ks), 4)}
    fallen = [k for k, v in kinds.items() if v["geomean"] < KIND_FLOOR]
    return {
        "n": len(xs), "geomean": round(geomean(xs), 4), "interval": [round(low, 4), round(high, 4)],
        "median": round(statistics.median(xs), 4), "won": round(sum(x > 1 for x in xs) / len(xs), 3),
        "lost": round(sum(x < 1 for x in xs) / len(xs), 3), "kinds": kinds, "kinds_below_floor": fallen,
        "ships": low > 1.0 and not fallen,
    }  # fmt: skip


# ----------------------------------------------------------------------------- running
def _job(seed: int, side: str) -> dict:
    return rules.run(draw(seed), side)


def decide(a: str, b: str, seeds: list[int], jobs: int, log=print, partial=None) -> list[dict]:
    """Both sides' runs of every seed, scored; progress on ``log``, and the rows so far to
    ``partial(rows)`` after every tenth draw (a stopped decision keeps what it measured)."""
    for side in (a, b):  # a bad side fails here, once, not in every worker
        rules.factory(side, 1)
    rows, pending = {}, {}
    with ProcessPoolExecutor(jobs) as pool:
        futures = {pool.submit(_job, s, side): (s, side) for s in seeds for side in (a, b)}
        for fut in as_completed(futures):
            seed, side = futures[fut]
            pending.setdefault(seed, {})[side] = fut.result()
            if len(pending[seed]) < 2:
                continue
            spec = draw(seed)
            runs = pending.pop(seed)
            rows[seed] = {"seed": seed, "kind": spec.kind, "horizon": spec.horizon,
                          **score_draw(runs[a], runs[b]),
                          "seconds": [runs[a]["seconds"], runs[b]["seconds"]]}  # fmt: skip
            done = list(rows.values())
            log(f"[{len(done)}/{len(seeds)}] seed {seed} {spec.kind} ({spec.horizon} steps): "
                f"{rows[seed]['step']:.2f}x; geometric mean so far {geomean(r['step'] for r in done):.3f}")  # fmt: skip
            if partial and len(done) % 10 == 0:
                partial(done)
    return [rows[s] for s in seeds]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="the candidate side (see benchmarks/rules.py)")
    p.add_argument("--b", help="the side it must beat")
    p.add_argument(
        "--settle-partial",
        metavar="OUT",
        help="conclude a stopped decision from results/OUT.partial.json",
    )
    p.add_argument("--draws", type=int, default=200, help="fresh draws (default 200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel runs")
    p.add_argument("--note", default="", help="what the decision is about, for the ledger")
    p.add_argument("--out", default="decide", help="result file name under benchmarks/results")
    p.add_argument("--ledger", type=Path, default=LEDGER, help=argparse.SUPPRESS)  # tests
    return p.parse_args(argv)


def conclude(
    entry: dict,
    first_seed: int,
    rows: list[dict],
    minutes,
    out: str,
    ledger: Path,
    command: str,
    status: str = "done",
) -> dict:
    """Summarise the rows, settle the ledger entry, write the result file, print the verdict."""
    summary = {"steps": summarise(rows, "step"), "time": summarise(rows, "time"),
               "divergences": {"a": sum(r["a_diverged"] for r in rows),
                               "b": sum(r["b_diverged"] for r in rows)},
               "minutes": minutes}  # fmt: skip
    settle(first_seed, {**summary, "status": status}, ledger)
    payload = {**entry, "command": command, "first_seed": first_seed, "summary": summary,
               "kinds": sorted(KINDS), "rows": rows}  # fmt: skip
    write_json(out, payload)
    s = summary["steps"]
    print(f"steps: geometric mean {s['geomean']}x, 95% interval {s['interval']}, median {s['median']}x, "
          f"kinds below {KIND_FLOOR}: {s['kinds_below_floor'] or 'none'} -> "
          f"{'SHIPS' if s['ships'] else 'does not ship'}; time: {summary['time']['geomean']}x")  # fmt: skip
    return payload


def settle_partial(out: str, ledger: Path = LEDGER) -> dict:
    """Conclude a stopped decision from its rows so far (``results/OUT.partial.json``): the
    longest run of consecutive seeds from its first one that all finished, so that the draws
    kept are a prefix of the seeds fixed in advance, not the ones that happened to be cheap."""
    from benchmarks.common import RESULTS

    path = RESULTS / f"{out}.partial.json"
    if not path.is_file():
        raise SystemExit(f"decide: no rows of a stopped decision at {path}")
    partial = json.loads(path.read_text())
    done = {r["seed"]: r for r in partial["rows"]}
    entry = next((e for e in read_ledger(ledger)
                  if e["first_seed"] <= min(done) < e["first_seed"] + e["draws"]), None)  # fmt: skip
    if entry is None:
        raise SystemExit(f"decide: the ledger holds no decision with seed {min(done)}")
    rows, seed = [], entry["first_seed"]
    while seed in done:
        rows.append(done[seed])
        seed += 1
    if len(rows) < 2:
        raise SystemExit(
            f"decide: fewer than 2 consecutive finished draws from seed {entry['first_seed']}"
        )
    keep = {k: v for k, v in partial.items() if k != "rows"}
    status = f"stopped after {len(rows)} of {entry['draws']} draws"
    return conclude(keep, entry["first_seed"], rows, None, out, ledger,
                    f"python -m benchmarks.decide --settle-partial {out}", status)  # fmt: skip


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.settle_partial:
        return settle_partial(args.settle_partial, args.ledger)
    if not (args.a and args.b):
        raise SystemExit("decide: --a and --b are required")
    if args.draws < 2:
        raise SystemExit("decide: --draws must be at least 2")
    entry = {"a": args.a, "b": args.b, "note": args.note,
             "commit": rules.resolve_commit("HEAD"), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    for name, side in (("a", args.a), ("b", args.b)):
        if not side.startswith(("adamw:", *rules.ANCHORS)):  # a learned side: its commit
            ref = rules.parse_side(side)[0]
            entry[f"{name}_commit"] = rules.resolve_commit("HEAD" if ref == "." else ref)
    seeds = reserve(args.draws, entry, args.ledger)
    print(
        f"decide: {args.a} against {args.b} on seeds {seeds[0]}-{seeds[-1]}, {args.jobs} jobs",
        flush=True,
    )
    start = time.perf_counter()
    rows = decide(
        args.a,
        args.b,
        seeds,
        args.jobs,
        log=lambda s: print(s, flush=True),
        partial=lambda done: write_json(f"{args.out}.partial", {**entry, "rows": done}, quiet=True),
    )
    minutes = round((time.perf_counter() - start) / 60, 1)
    return conclude(entry, seeds[0], rows, minutes, args.out, args.ledger,
                    command_line("python -m benchmarks.decide", argv))  # fmt: skip


if __name__ == "__main__":
    main()
