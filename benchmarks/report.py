"""Regenerate the result tables of README.md and docs/ from ``benchmarks/results/*.json``.

Run: ``python benchmarks/report.py`` (``--check`` exits 1 if a page is out of date).

A page marks each generated section with a pair of comments::

    <!-- results:NAME -->
    ...generated, do not edit...
    <!-- /results:NAME -->

and ``NAME`` is rendered from ``benchmarks/results/NAME.json`` by the function registered
with ``@section("NAME")``. A view of the same file is ``NAME:VIEW`` (a function registered
as ``@section("NAME:VIEW")``), and ``NAME:VIEW:ARG`` passes ``ARG`` to it (a checkpoint's
name, say). To add a section, register a renderer and put the marker pair in a page.
Markers without a result file or renderer are left as they are.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Plots the docs show, copied into docs/assets/ (not tracked: ``make docs`` copies them).
ASSETS = ("quality_heldout.png",)


def pages() -> list[Path]:
    """The pages with generated sections: README.md and every page under docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]


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


#: Step-cost columns: (header, key of a row); a column no row has is left out, so results
#: written before and after a benchmark change both render.
STEP_COLUMNS = (
    ("optimizer step / AdamW", "learned_default_step_ratio"),
    ("training step / AdamW", "learned_default_train_ratio"),
    ("eager reference: step / AdamW", "learned_reference_step_ratio"),
    ("eager reference: training step / AdamW", "learned_reference_train_ratio"),
    ("no orthogonalisation: step / AdamW", "learned_no_ortho_step_ratio"),
    ("no orthogonalisation: training step / AdamW", "learned_no_ortho_train_ratio"),
    ("Newton-Schulz every step: step / AdamW", "learned_ns_every_step_step_ratio"),
    ("Newton-Schulz every step: training step / AdamW", "learned_ns_every_step_train_ratio"),
    ("gossip rule: step / AdamW", "learned_gossip_rule_step_ratio"),
    ("gossip rule: training step / AdamW", "learned_gossip_rule_train_ratio"),
    ("shipped rule: step / AdamW", "learned_shipped_step_ratio"),
    ("shipped rule: training step / AdamW", "learned_shipped_train_ratio"),
    ("Muon + AdamW: step / AdamW", "muon_adamw_step_ratio"),
    ("Muon + AdamW: training step / AdamW", "muon_adamw_train_ratio"),
)


def _shipped_prefix(result: dict) -> str:
    """The row-key prefix of the shipped single-worker rule: ``learned_shipped`` in results
    that measured it beside another build, else ``learned_default`` (``LearnedOptimizer(params)``)."""
    shipped = any("learned_shipped_step_ratio" in r for r in result["rows"])
    return "learned_shipped" if shipped else "learned_default"


def _first_steps(result: dict) -> str:
    """What the result says about the first steps of a new process (the compile)."""
    cold = result.get("cold_start") or result.get("cold_compile")
    if not cold:
        return ""
    parts = []
    first = cold.get("first_step_seconds", cold.get("seconds"))
    if first is not None:
        digits = 2 if first < 0.1 else 1  # 0.04 s, not 0.0 s
        parts.append(f"the first step took {first:.{digits}f} s")
    if cold.get("first_kernel_seconds") is not None:
        parts.append(
            f"the kernel of the costliest kind of bucket was ready after "
            f"{cold['first_kernel_seconds']:.0f} s"
        )
    if cold.get("kernel_ready_seconds") is not None:
        parts.append(f"the compiled kernel was ready after {cold['kernel_ready_seconds']:.0f} s")
    where = f"{cold.get('workload', 'the first workload')}, {cold.get('threads', '?')} threads"
    if cold.get("command"):  # measured again on its own, after the table
        where += f"; measured {cold['date'][:10]} by `{cold['command']}`"
    text = f" In a new process with an empty compile cache ({where}), " + " and ".join(parts) + "."
    if cold.get("warm_kernel_ready_seconds") is not None:  # a second process on that cache
        text += (
            f" A second process on that cache (a later run, another rank) loaded the kernel "
            f"after {cold['warm_kernel_ready_seconds']:.1f} s "
            f"({cold['warm_steps_until_ready']} steps)."
        )
    text += f" {cold['note']}" if cold.get("note") else ""
    probes = result.get("cold_start_isa_probes")
    if probes:
        t, p = probes["medians"]["trusted"], probes["medians"]["probed"]
        text += (
            f" With inductor trusting the CPU's flags for its vector instruction set (as "
            f"shipped) against probing them, {probes['rounds']} cold starts each taking "
            f"turns (`{probes['command']}`, {probes['date'][:10]}), medians: the first kernel "
            f"after {t['first_kernel_seconds']:.0f} s against {p['first_kernel_seconds']:.0f} s, "
            f"the last after {t['kernel_ready_seconds']:.0f} s against "
            f"{p['kernel_ready_seconds']:.0f} s, and in a second process "
            f"{t['warm_kernel_ready_seconds']:.1f} s against {p['warm_kernel_ready_seconds']:.1f} s."
        )
    return text


@section("step_overhead")
@section("step_overhead_newest_torch")
@section("step_overhead_one_momentum")
@section("step_overhead_aot")
@section("step_overhead_aot_contention")
@section("step_overhead_stacked")
def render_step_overhead(result: dict) -> str:
    """Step cost against AdamW: the optimizer step alone and the whole training step."""

    def ratio(r, key):
        return f"{r[key]:.2f}x" if key in r else "-"

    columns = [(h, k) for h, k in STEP_COLUMNS if any(k in r for r in result["rows"])]
    header = ["workload", "params (tensors)", "threads", "machine", "AdamW step ms"]
    header += [h for h, _ in columns]
    rows = [
        [
            r["workload"],
            f"{r['params']:,} ({r.get('tensors', '?')})",
            r.get("threads", 2),
            _load_cell(r),
            f"{r['adamw_foreach_step_ms']:.1f}",
        ]
        + [ratio(r, k) for _, k in columns]
        for r in result["rows"]
    ]
    m = result["machine"]
    load = result.get("load_average_before")
    load_note = f", load average {load[0]:.1f} before measuring" if load else ""
    day = result["date"][:10]
    later = {}  # rows appended by a later run (--append): workload -> date
    for r in result["rows"]:
        if r.get("date", day)[:10] != day:
            later.setdefault(r["workload"], r["date"][:10])
    when = "".join(f"; {w} on {d}" for w, d in later.items())
    return (
        markdown_table(header, rows)
        + f"\n\nMeasured {day}{when} on {m['processor']} ({m['cpu_count']} cores"
        f"{load_note}), torch {m['torch']}; {_samples(result)}, every optimizer on its own "
        "copy of the model, taking turns, so that a busy machine slows them alike (compare "
        f"ratios, not times). AdamW with `foreach=True`.{_first_steps(result)} Command: "
        f"`{result['command']}`. Targets: {result.get('targets', '-')}."
    )


def _samples(result: dict) -> str:
    """How a step-cost run sampled: single steps, or the mean of ``period`` in a row."""
    repeats, warmup, period = (result.get(k, "?") for k in ("repeats", "warmup", "period"))
    if period in ("?", 1):
        return f"median of {repeats} steps after {warmup} warm-up steps"
    return (
        f"median of {repeats} samples, each the mean of {period} consecutive steps (the "
        f"rule's step time alternates with its Newton-Schulz steps), after {warmup} warm-up "
        "samples"
    )


@section("step_overhead:brief")
@section("step_overhead_stacked:brief")
def render_step_overhead_brief(result: dict) -> str:
    """The shipped single-worker rule's step cost against AdamW, one row per workload
    measured as is (no competing processes)."""
    prefix = _shipped_prefix(result)
    rows = [
        [
            r["workload"],
            f"{r['params']:,}",
            r.get("threads", 2),
            f"{r[f'{prefix}_step_ratio']:.1f}x",
            f"{r[f'{prefix}_train_ratio']:.2f}x" if f"{prefix}_train_ratio" in r else "-",
        ]
        for r in result["rows"]
        if r.get("load") == "as is" and f"{prefix}_step_ratio" in r
    ]
    header = [
        "workload",
        "params",
        "CPU threads",
        "optimizer step / AdamW's",
        "training step / AdamW's",
    ]
    m = result["machine"]
    return (
        markdown_table(header, rows)
        + f"\n\nOn {m['processor']}, torch {m['torch']}; the training step is forward, "
        "backward and optimizer step (`-`: not measured)."
    )


def _load_sections() -> None:
    """Import the other renderers (they register themselves with ``@section``)."""
    import importlib

    importlib.import_module("benchmarks.report_sections")
    importlib.import_module("benchmarks.report_heldout")
    importlib.import_module("benchmarks.report_validation")
    importlib.import_module("benchmarks.robust_gossip")
    # run as a script, this module is __main__ and benchmarks.report is a second copy
    RENDERERS.update(importlib.import_module("benchmarks.report").RENDERERS)


#: A generated section of a page: ``<!-- results:NAME[:VIEW[:ARG]] -->`` ... its end marker.
SECTION = re.compile(r"<!-- results:([\w:.-]+) -->.*?<!-- /results:\1 -->", re.DOTALL)


def _served(marker: str, results: Path) -> tuple[str, Path, list[str]] | None:
    """The renderer key, result file and renderer arguments of ``marker``
    (``NAME[:VIEW[:ARG]]``), or None where the renderer or the file is missing."""
    name, *view = marker.split(":")
    key = ":".join([name, *view[:1]])
    path = results / f"{name}.json"
    return (key, path, view[1:]) if key in RENDERERS and path.exists() else None


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every registered, measured section replaced by a fresh rendering
    (a section that no renderer or result serves is left as it is: see :func:`unserved`)."""

    def replace(match: re.Match) -> str:
        marker = match.group(1)
        served = _served(marker, results)
        if served is None:
            return match.group(0)
        key, path, args = served
        body = RENDERERS[key](json.loads(path.read_text()), *args)
        return f"<!-- results:{marker} -->\n{body}\n<!-- /results:{marker} -->"

    return SECTION.sub(replace, text)


def unserved(text: str, results: Path = RESULTS) -> list[str]:
    """The markers of ``text``'s sections that no registered renderer or result file
    serves: their tables would never be regenerated, and go stale unseen."""
    return [m.group(1) for m in SECTION.finditer(text) if _served(m.group(1), results) is None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a page is out of date")
    args = ap.parse_args(argv)
    _load_sections()
    stale, orphans = [], []
    for page in pages():
        old = page.read_text()
        orphans += [f"{page.relative_to(ROOT)} ({m})" for m in unserved(old)]
        new = render(old)
        if new == old:
            continue
        stale.append(page.relative_to(ROOT))
        if not args.check:
            page.write_text(new)
            print(f"updated {page.relative_to(ROOT)}")
    if not args.check:
        (DOCS / "assets").mkdir(exist_ok=True)
        for name in ASSETS:
            shutil.copyfile(RESULTS / name, DOCS / "assets" / name)
    if orphans:
        print(f"sections with no renderer or result: {', '.join(orphans)}")
        return 1
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}: run python benchmarks/report.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
