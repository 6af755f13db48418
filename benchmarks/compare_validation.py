"""Two or more validation records side by side: each row's speedup, and each summary.

Run: ``python -m benchmarks.compare_validation BASE OTHER [OTHER ...]``, each a record of
:mod:`benchmarks.validation` (a name under ``benchmarks/results`` such as
``validation_nesterov64``, or a path). It prints one line per single-worker problem and
horizon and per decentralized setting, with every record's speedup (``-`` where a record
has no such row), then each record's summary, and its median against the first record's
(the "times the hand-set rule" of the issue's targets, when BASE is the hand-set rule).
It reads the records and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.report_validation import _x  # the results tables' speedup text


def load(name: str) -> dict:
    """A validation record by name (under ``benchmarks/results``) or path."""
    path = Path(name)
    if not path.is_file():
        path = RESULTS / (name if name.endswith(".json") else f"{name}.json")
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{name}: no such validation record (a name or a path)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("benchmark") != "validation":
        raise ValueError(f"{path}: not a record of benchmarks.validation")
    return record


def rows(record: dict) -> dict[str, tuple[float | None, str]]:
    """``{row label: (speedup, mark)}``: single-worker rows as ``task@horizon``, settings as
    ``task w<workers> <topology> <partition>``; the mark says a divergence, or a
    decentralized final loss above tuned D-Adam's."""
    out = {}
    for r in record.get("single", []):
        learned = r["learned"]
        out[f"{r['task']}@{r['horizon']}"] = (
            learned["speedup"],
            "d" if learned.get("diverged") else "",
        )
    for r in record.get("decentralized", []):
        key = f"{r['task']} w{r['workers']} {r['topology']} {r['partition']}"
        mark = "d" if r.get("diverged") else ("+" if r.get("worse_than_dadam") else "")
        out[key] = (r["speedup"], mark)
    return out


def compare(records: list[tuple[str, dict]]) -> str:
    """The side-by-side text of ``records`` (``(label, record)``, the first the base)."""
    tables = [rows(r) for _, r in records]
    keys = list(dict.fromkeys(k for t in tables for k in t))
    width = max([len(k) for k in keys] + [7])
    labels = [label for label, _ in records]
    cols = [max(8, len(label)) for label in labels]
    lines = [" ".join([f"{'row':{width}}", *(f"{lab:>{c}}" for lab, c in zip(labels, cols))])]
    for key in keys:
        cells = []
        for table, c in zip(tables, cols):
            speedup, mark = table.get(key, (None, ""))
            cells.append(f"{_x(speedup) + mark:>{c}}")
        lines.append(" ".join([f"{key:{width}}", *cells]))
    lines.append("")
    lines.append("(d: diverged; +: final loss above tuned D-Adam's)")
    base = records[0][1]["summary"]
    for label, record in records:
        s = record["summary"]
        parts = [
            f"median {_x(s.get('median_speedup'))}",
            f"short {_x(s.get('median_speedup_short'))}",
            f"long {_x(s.get('median_speedup_long'))}",
            f"lowest {_x(s.get('min_speedup'))}",
            f"below 0.9x {len(s.get('rows_below_0.9') or [])}",
        ]
        if s.get("median_speedup") and base.get("median_speedup"):
            parts.append(f"{s['median_speedup'] / base['median_speedup']:.2f} times the first")
        if s.get("decentralized_rows"):
            parts.append(
                f"decentralized median {_x(s.get('median_speedup_decentralized'))}, "
                f"{s.get('decentralized_worse_than_dadam')} of {s['decentralized_rows']} "
                "above D-Adam"
            )
        schedule = record.get("schedule") or "constant"
        lines.append(f"{label} ({schedule}): " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="validation records: names or paths")
    args = parser.parse_args(argv)
    if len(args.records) < 2:
        parser.error("name at least two records: the base, then those to compare with it")
    try:
        records = [(Path(name).stem, load(name)) for name in args.records]
    except ValueError as exc:
        print(f"compare_validation: {exc}", file=sys.stderr)
        return 2
    print(compare(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
