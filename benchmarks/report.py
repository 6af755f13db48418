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


def _load_cell(r: dict) -> str:
    if r["load"] == "as is":
        return "as is"
    blocks = r.get("blocks")
    if not blocks:
        return "2 busy processes beside"
    each = ", ".join(f"{b:.2f}x" for b in blocks)
    return f"2 busy processes beside (median of {len(blocks)} blocks: {each})"


@section("step_overhead")
def render_step_overhead(result: dict) -> str:
    def ratio(r, key):
        return f"{r[key]:.2f}x" if key in r else "-"

    header = [
        "workload",
        "params (tensors)",
        "threads",
        "machine",
        "AdamW step ms",
        "optimizer step / AdamW (default: fused)",
        "(eager chunked)",
        "training step / AdamW (default: fused)",
        "(eager chunked)",
        "shipped single-worker rule (`adapt_init`; `adapt_init_2x` steps alike): step / AdamW",
        "training step / AdamW",
    ]
    rows = [
        [
            r["workload"],
            f"{r['params']:,} ({r['tensors']})",
            r.get("threads", 2),
            _load_cell(r),
            f"{r['adamw_foreach_step_ms']:.1f}",
            f"**{ratio(r, 'learned_default_step_ratio')}**",
            ratio(r, "learned_eager_step_ratio"),
            f"**{ratio(r, 'learned_default_train_ratio')}**"
            if "learned_default_train_ratio" in r
            else "(step only)",
            ratio(r, "learned_eager_train_ratio"),
            ratio(r, "learned_shipped_step_ratio"),
            ratio(r, "learned_shipped_train_ratio"),
        ]
        for r in result["rows"]
    ]
    m = result["machine"]
    first = max(r["learned_default_first_step_ms"] for r in result["rows"]) / 1e3
    cold = result.get("cold_compile")
    cold_note = (
        f" In a new process with an empty inductor cache, the first step of the 0.5M "
        f"transformer took {cold['seconds']:.0f} s ({cold['threads']} threads, load average "
        f"{cold['load_average_before'][0]:.1f}): the one-time compile of the passes."
        if cold
        else ""
    )
    load = result.get("load_average_before")
    load_note = f", load average {load[0]:.1f} before measuring" if load else ""
    return (
        markdown_table(header, rows)
        + f"\n\nMeasured {result['date'][:10]} on {m['processor']} ({m['cpu_count']} cores"
        f"{load_note}), torch {m['torch']}, width "
        f"{result['width']} ({result['flops_per_element']} FLOPs per element); median of "
        f"{result['repeats']} steps after {result['warmup']} warm-up steps, every optimizer on "
        f"its own copy of the model, taking turns step by step, so that a busy machine slows "
        f"them alike (the machine is shared: compare ratios, not times). AdamW with "
        f"`foreach=True`. Compile route: {result['compile_route']}; the first step of the run "
        f"took {first:.0f} s (the one-time compile; inductor's on-disk cache makes later "
        f"processes faster).{cold_note} Command: `{result['command']}`. Targets: "
        f"{result['targets']}."
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
