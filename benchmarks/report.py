"""Regenerate the result tables in README.md from ``benchmarks/results/*.json``.

Run: ``python benchmarks/report.py`` (``--check`` exits 1 if README.md is out of date).

README.md marks each generated section with a pair of comments::

    <!-- results:NAME -->
    ...generated, do not edit...
    <!-- /results:NAME -->

and ``NAME`` is rendered from ``benchmarks/results/NAME.json`` by the function registered
with ``@section("NAME")``. To add a section, register a renderer here and put the marker
pair in README.md. Markers without a result file or renderer are left as they are.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"

RENDERERS: dict[str, Callable[[dict], str]] = {}


def section(name: str):
    """Register ``fn(result_dict) -> markdown`` as the renderer of ``results/NAME.json``."""

    def register(fn):
        RENDERERS[name] = fn
        return fn

    return register


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@section("step_overhead")
def render_step_overhead(result: dict) -> str:
    header = [
        "params",
        "width",
        "learned ms/step",
        "AdamW ms/step",
        "ratio to AdamW (median)",
        "ratio (best step)",
        "FLOPs/element",
        "state B/param (ours / AdamW)",
    ]
    rows = [
        [
            f"{r['size']} ({r['params']:,} in {r['tensors']} tensors)",
            r["width"],
            f"{r['learned_ms']:.1f}",
            f"{r['adamw_ms']:.1f}",
            f"**{r['ratio']:.1f}x**",
            f"{r['ratio_of_best']:.1f}x" if "ratio_of_best" in r else "",
            r["flops_per_element"],
            f"{r['learned_state_bytes_per_param']:.0f} / {r['adamw_state_bytes_per_param']:.0f}",
        ]
        for r in result["rows"]
    ]
    m = result["machine"]
    load = result.get("load_average")
    load_note = f", load average {load[0]:.1f} while measuring" if load else ""
    return (
        markdown_table(header, rows)
        + f"\n\nMeasured {result['date'][:10]} on {m['processor']} ({m['cpu_count']} cores, "
        f"{m['torch_threads']} torch threads{load_note}), torch {m['torch']}; median (and "
        f"fastest) of {result['repeats']} steps after {result['warmup']} warm-up steps, the "
        f"optimizers taking turns step by step; AdamW timed with foreach on and off and the "
        f"faster one used. Command: `{result['command']}`. Target: {result['target']}."
    )


def _load_sections() -> None:
    """Import the other renderers (they register themselves with ``@section``)."""
    import importlib

    importlib.import_module("benchmarks.report_sections")
    importlib.import_module("benchmarks.report_heldout")
    # run as a script, this module is __main__ and benchmarks.report is a second copy
    RENDERERS.update(importlib.import_module("benchmarks.report").RENDERERS)


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every registered, measured section replaced by a fresh rendering."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        path = results / f"{name}.json"
        if name not in RENDERERS or not path.exists():
            return match.group(0)
        body = RENDERERS[name](json.loads(path.read_text()))
        return f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->"

    pattern = re.compile(r"<!-- results:([\w-]+) -->.*?<!-- /results:\1 -->", re.DOTALL)
    return pattern.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if README.md is out of date")
    args = ap.parse_args(argv)
    _load_sections()
    old = README.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md results are out of date: run python benchmarks/report.py")
            return 1
        return 0
    if new != old:
        README.write_text(new)
        print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
