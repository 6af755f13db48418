"""How far choosing per problem could take the rule: the validation records' headroom.

Run: ``python -m benchmarks.validation_headroom`` (``--reference``, ``--out``). It trains
and runs nothing: it reads every single-worker record of :mod:`benchmarks.validation` in
``benchmarks/results`` that ran the reference's problems at its seeds (each a variant of
the rule, a meta-trained stage or a schedule measured against the same cached tuned AdamW
baselines) and asks what a rule that knew which problem it was on, and took the best of
those variants there, would score:

- **in sample**: each row and seed takes the variant best there (an upper bound that
  also selects on noise: with dozens of variants, some win a row by chance);
- **across seeds**: each row takes the variant best on the other seeds (the sum of log
  speedups) and is scored on the seed left out, every seed in turn; what a selector that
  learned the problem, not the seed, could carry over;
- **one variant** for every row, the best by its geometric mean over the reference, and
  the best **pair** (each row and seed taking the better of two).

Each is summarised as the issue's targets read it (:mod:`benchmarks.validation_scores`):
the median, the small problems' and long runs' medians, the lowest row, and the geometric
mean over the reference's step speedup, row by row and seed by seed.

Under gossip it reads every record's decentralized settings (at any seeds) and counts, per
setting, the records that ran it and those whose averaged model ended no worse than tuned
D-Adam's at every seed, the issue's bar for every setting.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from pathlib import Path

from benchmarks import common
from benchmarks.common import command_line, write_json
from benchmarks.compare_validation import load
from benchmarks.meta_stages import TARGET_TIMES
from benchmarks.report_validation import _x
from benchmarks.validation_scores import LONG, SHORT, TARGETS, _median

#: The shipped rule at the code the most recent variants were measured against.
REFERENCE = "validation_handset_now"


def speedups(record: dict) -> dict[tuple[str, int], list[float]]:
    """``{(task, horizon): [step speedup per seed]}`` of a record's single-worker rows."""
    return {(r["task"], r["horizon"]): r["learned"]["speedup_by_seed"] for r in record["single"]}


def comparable(record: dict, reference: dict) -> bool:
    """Whether ``record`` ran every single-worker row of ``reference`` at its seeds."""
    if (
        not record.get("complete")
        or record.get("quick")
        or record.get("seeds") != reference["seeds"]
    ):
        return False
    ours, theirs = speedups(record), speedups(reference)
    return set(ours) == set(theirs) and all(
        len(v) == len(reference["seeds"]) for v in ours.values()
    )


def label(name: str, record: dict) -> str:
    """A variant's name: its record's, with the schedule it ran under when not held."""
    schedule = record.get("schedule") or "constant"
    return name if schedule == "constant" else f"{name} ({schedule})"


def summarise(per_seed: dict[tuple[str, int], list[float]], ref: dict) -> dict:
    """The targets' figures of per-row, per-seed speedups: per-row medians over the seeds,
    their median, small and long medians and lowest, and the geometric mean over the
    reference's speedups ``ref`` (:func:`speedups`; a divergence, speedup 0, counts as a
    hundredth of it)."""
    rows = {k: statistics.median(v) for k, v in per_seed.items()}
    logs = [
        math.log(max(s, 1e-2 * b) / b)
        for k, v in per_seed.items()
        for s, b in zip(v, ref[k])
        if b > 0
    ]
    pick = lambda keep: [s for (_, h), s in rows.items() if keep(h)]  # noqa: E731
    return {
        "median": _median(rows.values()),
        "median_short": _median(pick(lambda h: h <= SHORT)),
        "median_long": _median(pick(lambda h: h >= LONG)),
        "lowest": round(min(rows.values()), 4),
        "rows_below_0.9": sorted(f"{t}@{h}" for (t, h), s in rows.items() if s < 0.9),
        "geomean_over_reference": round(math.exp(sum(logs) / len(logs)), 4),
    }


def best_of(variants: dict[str, dict], names) -> dict:
    """Each row and seed at the best speedup of ``names``."""
    keys = next(iter(variants.values()))
    return {k: [max(variants[n][k][i] for n in names) for i in range(len(keys[k]))] for k in keys}


def across_seeds(variants: dict[str, dict]) -> tuple[dict, dict]:
    """Leave one seed out: each row's variant chosen on the other seeds (the largest sum of
    log speedups), scored on the seed left out. Returns the per-seed speedups and, per
    row, the variant chosen at each seed."""
    keys = next(iter(variants.values()))
    scored, chosen = {}, {}

    def fit(n, k, out):  # the log speedups of variant n on row k but for seed out
        return sum(math.log(max(s, 1e-4)) for i, s in enumerate(variants[n][k]) if i != out)

    for k, ref in keys.items():
        picks = [max(sorted(variants), key=lambda n: fit(n, k, out)) for out in range(len(ref))]
        scored[k] = [variants[n][k][i] for i, n in enumerate(picks)]
        chosen[f"{k[0]}@{k[1]}"] = picks
    return scored, chosen


def decentralized(records: dict[str, dict]) -> list[dict]:
    """Per decentralized setting: how many records ran it, which of them ended no worse
    than tuned D-Adam at every seed, and the best speedup among those."""
    settings: dict[tuple, dict] = {}
    for name, record in sorted(records.items()):
        for r in record.get("decentralized") or []:
            key = (r["task"], r["workers"], r["topology"], r["partition"], r["alpha"])
            row = settings.setdefault(key, {"records": 0, "not_worse": {}})
            row["records"] += 1
            if not r["worse_than_dadam"]:
                row["not_worse"][name] = r["speedup"]
    out = []
    for (task, workers, topology, partition, alpha), row in settings.items():
        best = max(row["not_worse"], key=row["not_worse"].get, default=None)
        out.append({"task": task, "workers": workers, "topology": topology,
                    "partition": partition, "alpha": alpha, "records": row["records"],
                    "not_worse_than_dadam": sorted(row["not_worse"]), "best": best,
                    "best_speedup": None if best is None else row["not_worse"][best]})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", default=REFERENCE, help="the shipped rule's record")
    parser.add_argument("--out", default="validation_headroom")
    args = parser.parse_args(argv)
    try:
        reference = load(args.reference)
        if not reference.get("single"):
            raise ValueError(f"{args.reference}: no single-worker rows")
    except ValueError as exc:
        print(f"validation_headroom: {exc}", file=sys.stderr)
        return 2
    ref_name = label(Path(args.reference).stem, reference)
    variants = {ref_name: speedups(reference)}  # the reference is a variant too
    records = {}
    for path in sorted(common.RESULTS.glob("validation_*.json")):
        try:
            records[path.stem] = record = load(str(path))
        except ValueError:
            continue  # another benchmark's file that shares the prefix
        if record.get("single") and comparable(record, reference):
            variants[label(path.stem, record)] = speedups(record)
    if len(variants) < 2:
        print("validation_headroom: fewer than two comparable records", file=sys.stderr)
        return 2
    cv, chosen = across_seeds(variants)
    ref = variants[ref_name]
    singles = {n: summarise(v, ref) for n, v in variants.items()}
    best_single = max(singles, key=lambda n: singles[n]["geomean_over_reference"])
    pairs = {(a, b): summarise(best_of(variants, (a, b)), ref)
             for a, b in itertools.combinations(sorted(variants), 2)}  # fmt: skip
    best_pair = max(pairs, key=lambda p: pairs[p]["geomean_over_reference"])
    payload = {
        "benchmark": "validation_headroom",
        "reference": ref_name,
        "seeds": reference["seeds"],
        "variants": sorted(variants),
        "targets": {
            "median_long": TARGETS["median_speedup_long"],
            "lowest": TARGETS["min_speedup"],
            "times_reference": f">= {TARGET_TIMES}",
        },  # fmt: skip
        "summaries": {
            "reference": singles[ref_name],
            "best_variant": {"names": [best_single], **singles[best_single]},
            "best_pair": {"names": list(best_pair), **pairs[best_pair]},
            "per_row_across_seeds": summarise(cv, ref),
            "per_row_in_sample": summarise(best_of(variants, variants), ref),
        },
        "chosen_across_seeds": chosen,
        "decentralized": decentralized(records),
        "command": command_line("python -m benchmarks.validation_headroom", argv),
    }
    write_json(args.out, payload)
    s = payload["summaries"]
    for name in (
        "reference",
        "best_variant",
        "best_pair",
        "per_row_across_seeds",
        "per_row_in_sample",
    ):
        x = s[name]
        print(f"{name:22s} median {_x(x['median'])}  long {_x(x['median_long'])}  "
              f"lowest {_x(x['lowest'])}  geomean {x['geomean_over_reference']:.3f}")  # fmt: skip
    for row in payload["decentralized"]:
        print(f"{row['task']} {row['workers']} ranks {row['partition']}: "
              f"{len(row['not_worse_than_dadam'])} of {row['records']} records no worse than D-Adam")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
