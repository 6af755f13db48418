"""Meta-training stages against the hand-set rule, on the validation family: one table.

Run: ``python -m benchmarks.meta_stages`` (``--reference``, ``--stages``). Writes
``benchmarks/results/meta_training_stages.json`` from the validation records already in
``benchmarks/results`` (it trains and runs nothing): for each stage, its single-worker
median step speedup against tuned AdamW, that median over the hand-set rule's (the
issue's "1.15 times the hand-set rule"), its medians on the small problems and on runs of
1000 steps or more, its lowest row and the rows below 0.9x, and the paired comparison:
over every problem and seed that both records ran, the geometric mean of the stage's step
speedup over the hand-set rule's, and on how many of them it was ahead and behind. A
ratio of medians can move by a tenth when another row lands in the middle (stage 8 on six
seeds: 1.13 times the hand-set rule's median, level with it row by row); the paired figure
reads every row. The default stages are those measured against the hand-set rule as it
ships (``validation_nesterov64``), the same code on both sides.
"""

from __future__ import annotations

import argparse
import math
import sys

from benchmarks.common import command_line, write_json
from benchmarks.compare_validation import load

#: The hand-set rule as it ships, and the stages validated against it (in order).
REFERENCE = "validation_nesterov64"
STAGES = (
    "validation_adapt2x_tensor_stage7",
    "validation_adapt2x_tensor_stage8",
    "validation_adapt2x_tensor_stage9",
    "validation_adapt2x_tensor_stage10",
    "validation_adapt2x_tensor_stage10_gossip",
    "validation_adapt2x_tensor_stage11",
    "validation_adapt2x_tensor_stage11_gossip",
    "validation_adapt2x_tail_stage1",
    "validation_adapt2x_tail_from8_stage1",
    "validation_adapt2x_tail_from8_lowlr_stage1",
)
#: What the issue asks of a meta-trained checkpoint before it may ship: its validation
#: median at least this many times the hand-set rule's.
TARGET_TIMES = 1.15


def paired(record: dict, reference: dict) -> dict:
    """The stage's step speedup over the reference's on every problem, horizon and seed
    that both ran: their geometric mean, and how many the stage was ahead and behind on
    (within 1e-4 counts as level)."""
    ref = {(r["task"], r["horizon"]): r for r in reference.get("single", [])}
    seeds = dict(zip(reference.get("seeds", []), range(len(reference.get("seeds", [])))))
    ratios, pairs, ahead, behind = [], 0, 0, 0
    for r in record.get("single", []):
        other = ref.get((r["task"], r["horizon"]))
        if other is None:
            continue
        theirs = other["learned"]["speedup_by_seed"]
        for seed, ours in zip(record.get("seeds", []), r["learned"]["speedup_by_seed"]):
            if seed not in seeds:
                continue
            base, pairs = theirs[seeds[seed]], pairs + 1
            if ours > 0 and base > 0:
                ratios.append(ours / base)
                ahead, behind = ahead + (ours > base * 1.0001), behind + (ours < base * 0.9999)
            else:  # a divergence (speedup 0) is behind whatever did not diverge
                ahead, behind = ahead + (ours > base), behind + (ours < base)
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    return {
        "pairs": pairs,
        "geomean": None if geomean is None else round(geomean, 4),
        "ahead": int(ahead),
        "behind": int(behind),
    }


def row(name: str, record: dict, reference_median: float, reference: dict | None = None) -> dict:
    """One stage's (or the reference's) summary line."""
    s = record["summary"]
    if s.get("median_speedup") is None:
        raise ValueError(f"{name}: no single-worker rows")
    return {
        "record": name,
        "rule": record["side"]["checkpoint"],
        "date": record.get("date"),
        "median": s["median_speedup"],
        "times_reference": round(s["median_speedup"] / reference_median, 4),
        "median_short": s["median_speedup_short"],
        "median_long": s["median_speedup_long"],
        "lowest": s["min_speedup"],
        "below_0.9": s["rows_below_0.9"],
        "divergences": s["divergences"],
        "paired": paired(record, reference if reference is not None else record),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", default=REFERENCE, help="the hand-set rule's record")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), help="stage records")
    parser.add_argument("--out", default="meta_training_stages")
    args = parser.parse_args(argv)
    try:
        reference = load(args.reference)
        base = reference["summary"]["median_speedup"]
        rows = [row(args.reference, reference, base)]
        rows += [row(name, load(name), base, reference) for name in args.stages]
    except ValueError as exc:  # a missing, foreign or gossip-only record: one line
        print(f"meta_stages: {exc}", file=sys.stderr)
        return 2
    best = max(rows[1:], key=lambda r: r["times_reference"])
    payload = {
        "benchmark": "meta_training_stages",
        "reference": args.reference,
        "target_times_reference": TARGET_TIMES,
        "rows": rows,
        "best_stage": best["record"],
        "best_times_reference": best["times_reference"],
        "target_met": best["times_reference"] >= TARGET_TIMES,
        "command": command_line("python -m benchmarks.meta_stages", argv),
    }
    write_json(args.out, payload)
    print(
        f"best stage {best['record']}: {best['times_reference']:.2f} times the hand-set rule "
        f"(target {TARGET_TIMES})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
