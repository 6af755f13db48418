"""The reporting draw: the shipped rule against tuned AdamW and the zero-tuning anchors on
fixed draws of the task distribution whose seeds serve for reporting only.

Seeds ``0 .. --draws - 1`` (150 by default; every decision draws from
:data:`benchmarks.decide.DECISION_SEEDS` on, so none of these ever chose anything). On each
draw, once, cached in ``benchmarks/results/report_draw_cache.json.gz`` (keyed by the draw's
description, so a changed distribution is run again):

* AdamW over 6 learning rates x (constant, cosine), the grid extended by x3 (twice at most)
  where the best sits at its edge; the best by final smoothed training loss (its curve is
  kept, to score any rule against);
* the anchors at their recommended settings (``benchmarks/rules.py``): schedule-free AdamW,
  Prodigy with cosine, and ``torch.optim.Muon`` with AdamW; their step speedups over tuned
  AdamW are kept.

Then the side under report (``--side``, default ``.``: this checkout's shipped rule) trains
every draw, and its step speedup over tuned AdamW is scored as the held-out suite scores
(:func:`learned_opt.meta_train.evaluation.speedup`; a diverged run scores 0). The summary: the
geometric mean (speedups clipped to [1/20, 20]), the share of draws at 1.0x or better,
divergences, and per kind the rule's and each anchor's geometric mean.

    OMP_NUM_THREADS=1 python -m benchmarks.report_draw --jobs 2

Writes ``benchmarks/results/report_draw.json``. The cache is written as runs finish, so a
stopped run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed, wait
from pathlib import Path

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks import rules  # noqa: E402
from benchmarks.common import RESULTS, command_line, write_json  # noqa: E402
from benchmarks.decide import DECISION_SEEDS, clipped, geomean  # noqa: E402
from learned_opt.meta_train.evaluation import final_loss, speedup  # noqa: E402
from learned_opt.tasks.distribution import draw  # noqa: E402

CACHE = RESULTS / "report_draw_cache.json.gz"
ADAMW_LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
DRAWS = 150


def read_cache(path: Path = CACHE) -> dict:
    if not path.is_file():
        return {}
    return json.loads(gzip.decompress(path.read_bytes()))


def write_cache(cache: dict, path: Path = CACHE) -> None:
    text = json.dumps(cache, separators=(",", ":"), sort_keys=True)
    path.write_bytes(gzip.compress(text.encode(), mtime=0))


def _run(seed: int, side: str) -> dict:
    return rules.run(draw(seed), side)


def adamw_sides(lrs) -> tuple[str, ...]:
    return tuple(f"adamw:{lr:g}{s}" for lr in lrs for s in ("", ":cosine"))


ADAMW_SIDES = adamw_sides(ADAMW_LRS)


def edge(runs: dict[str, dict]) -> float | None:
    """The learning rate one step (x3) beyond the grid where its best run sits at an edge
    and that rate has not run yet; ``None`` otherwise."""
    finals = {s: final_loss(r["curve"]) for s, r in runs.items() if s.startswith("adamw:")}
    lr = float(min(finals, key=lambda s: (finals[s], s)).split(":")[1])
    tried = {float(s.split(":")[1]) for s in finals}
    beyond = lr * 3 if lr == max(tried) else lr / 3 if lr == min(tried) else None
    return beyond if beyond is not None and len(tried) < len(ADAMW_LRS) + 2 else None


def baseline_entry(runs: dict[str, dict]) -> dict:
    """A draw's cache entry from its AdamW runs and anchor runs: the best AdamW side and curve
    (5 significant digits), every AdamW run's final loss and the anchors' speedups."""
    finals = {s: final_loss(r["curve"]) for s, r in runs.items() if s.startswith("adamw:")}
    best = min(finals, key=lambda s: (finals[s], s))
    curve = [float(f"{x:.5g}") for x in runs[best]["curve"]]
    anchors = {a: score(runs[a]["curve"], curve) for a in rules.ANCHORS}
    return {"best": best, "curve": curve, "finals": finals, "anchors": anchors,
            "seconds": {s: r["seconds"] for s, r in runs.items()}}  # fmt: skip


def score(learned: list[float], tuned: list[float]) -> float:
    """Step speedup over tuned AdamW; 0 when the run diverged."""
    return 0.0 if rules.diverged(learned) else speedup(learned, tuned)


def row(seed: int, runs: dict[str, dict], base: dict) -> dict:
    """One draw's row: the rule's step speedup over tuned AdamW (its cached curve) and its
    time speedup, the step speedup times AdamW's seconds over the rule's in the runs made
    side by side (0 where the rule diverged), and the anchors' cached step speedups."""
    spec, rule, adamw = draw(seed), runs["rule"]["curve"], runs["adamw"]
    steps = score(rule, base["curve"])
    per_step = adamw["seconds"] / max(runs["rule"]["seconds"], 1e-9)
    return {"seed": seed, "kind": spec.kind, "horizon": spec.horizon, "rule": steps,
            "time": steps * per_step, "rule_diverged": rules.diverged(rule), "adamw": base["best"],
            "seconds": runs["rule"]["seconds"], "adamw_seconds": adamw["seconds"],
            **base["anchors"]}  # fmt: skip


def fill_cache(seeds: list[int], jobs: int, cache: dict, log=print) -> None:
    """Run the AdamW grid and the anchors on every seed the cache lacks, saving as each
    draw completes. Where the best AdamW run sits at an edge of the grid, the grid is
    extended by a factor of 3 that way (twice at most). Runs are handed out a few at a time,
    a draw's extension before any new draw, so draws complete in order and a stopped fill
    loses only the draws in flight."""
    todo = [s for s in seeds if draw(s).describe() not in cache]
    if not todo:
        return
    log(f"report_draw: tuning AdamW and running the anchors on {len(todo)} draws")
    queue = deque((s, side) for s in todo for side in ADAMW_SIDES + rules.ANCHORS)
    runs: dict[int, dict] = {}
    with ProcessPoolExecutor(jobs) as pool:
        pending: dict = {}
        while queue or pending:
            while queue and len(pending) < jobs:
                seed, side = queue.popleft()
                pending[pool.submit(_run, seed, side)] = (seed, side)
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                seed, side = pending.pop(fut)
                runs.setdefault(seed, {})[side] = fut.result()
                if any(s == seed for s, _ in [*pending.values(), *queue]):
                    continue
                beyond = edge(runs[seed])
                if beyond is not None:
                    queue.extendleft((seed, side) for side in reversed(adamw_sides([beyond])))
                    continue
                cache[draw(seed).describe()] = baseline_entry(runs.pop(seed))
                write_cache(cache)
                log(f"  cached seed {seed} ({len(cache)} draws in the cache)")


def summary(rows: list[dict]) -> dict:
    """The rule's and the anchors' geometric means, overall and per kind, and the shares."""
    names = ("rule", "time", *rules.ANCHORS)
    kinds = {}
    for k in sorted({r["kind"] for r in rows}):
        sub = [r for r in rows if r["kind"] == k]
        kinds[k] = {"n": len(sub), **{n: summary_of(sub, n) for n in names}}
    return {
        "n": len(rows),
        "geomean": {n: summary_of(rows, n) for n in names},
        "won": round(sum(r["rule"] >= 1.0 for r in rows) / len(rows), 3),
        "divergences": sum(r["rule_diverged"] for r in rows),
        "kinds": kinds,
        "worst_kind": min(kinds, key=lambda k: kinds[k]["rule"]),
        "ahead_of_every_anchor_on_every_kind": all(
            v["rule"] > v[a] for v in kinds.values() for a in rules.ANCHORS),
    }  # fmt: skip


def summary_of(rows: list[dict], key: str) -> float:
    return round(geomean(clipped(r[key]) if r[key] > 0 else 1 / 20 for r in rows), 4)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", default=".", help="the rule under report (default: this checkout's)")
    p.add_argument(
        "--draws", type=int, default=DRAWS, help=f"reporting seeds 0..N-1 (default {DRAWS})"
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--baselines-only", action="store_true", help="fill the cache, report nothing")
    args = p.parse_args(argv)
    if not 1 <= args.draws <= DECISION_SEEDS:
        raise SystemExit(f"report_draw: --draws must be in 1..{DECISION_SEEDS}")
    seeds = list(range(args.draws))
    cache = read_cache()
    start = time.perf_counter()
    fill_cache(seeds, args.jobs, cache, log=lambda s: print(s, flush=True))
    if args.baselines_only:
        return {}
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        # the rule and the draw's tuned AdamW side run again side by side, for the time score
        sides = {s: {"rule": args.side, "adamw": cache[draw(s).describe()]["best"]} for s in seeds}
        futures = {pool.submit(_run, s, side): (s, role)
                   for s in seeds for role, side in sides[s].items()}  # fmt: skip
        done: dict[int, dict] = {}
        for fut in as_completed(futures):
            seed, role = futures[fut]
            runs = done.setdefault(seed, {})
            runs[role] = fut.result()
            if len(runs) < 2:
                continue
            rows.append(row(seed, done.pop(seed), cache[draw(seed).describe()]))
            print(
                f"[{len(rows)}/{len(seeds)}] seed {seed} {rows[-1]['kind']}: "
                f"{rows[-1]['rule']:.2f}x in steps, {rows[-1]['time']:.2f}x in time",
                flush=True,
            )
    rows.sort(key=lambda r: r["seed"])
    payload = {"side": args.side, "commit": rules.resolve_commit("HEAD"), "of": DRAWS,
               "command": command_line("python -m benchmarks.report_draw", argv),
               "minutes": round((time.perf_counter() - start) / 60, 1),
               "summary": summary(rows), "rows": rows}  # fmt: skip
    write_json("report_draw", payload)
    s = payload["summary"]
    print(f"rule over tuned AdamW: geometric mean {s['geomean']['rule']}x in steps, "
          f"{s['geomean']['time']}x in time, {s['won']:.0%} of draws "
          f"at 1.0x or better, worst kind {s['worst_kind']}, {s['divergences']} divergences")  # fmt: skip
    return payload


if __name__ == "__main__":
    main()
