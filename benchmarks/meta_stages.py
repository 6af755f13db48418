"""Meta-training stages against the hand-set rule, on the validation family: one table.

Run: ``python -m benchmarks.meta_stages`` (``--reference``, ``--stages``). Writes
``benchmarks/results/meta_training_stages.json`` from the validation records already in
``benchmarks/results`` (it trains and runs nothing): for each stage, its single-worker
median step speedup against tuned AdamW, that median over the hand-set rule's (the
issue's "1.15 times the hand-set rule"), its medians on the small problems and on runs of
1000 steps or more, its lowest row and the rows below 0.9x. The default stages are those
measured against the hand-set rule as it ships (``validation_nesterov64``), the same code
on both sides.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import write_json
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


def row(name: str, record: dict, reference_median: float) -> dict:
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
        rows += [row(name, load(name), base) for name in args.stages]
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
        "command": "python -m benchmarks.meta_stages",
    }
    write_json(args.out, payload)
    print(
        f"best stage {best['record']}: {best['times_reference']:.2f} times the hand-set rule "
        f"(target {TARGET_TIMES})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
