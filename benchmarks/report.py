"""Regenerate the result tables of README.md and docs/ from ``benchmarks/results/*.json``.

Run: ``python benchmarks/report.py`` (``--check`` exits 1 if a page is out of date).

A page marks each generated section with a pair of comments::

    <!-- results:NAME -->
    ...generated, do not edit...
    <!-- /results:NAME -->

and ``NAME`` is rendered from ``benchmarks/results/NAME.json`` by the function registered
with ``@section("NAME")`` (:mod:`benchmarks.report_sections`); ``NAME:VIEW`` is a view of
the same file, and ``NAME:VIEW:ARG`` passes ``ARG`` to it (a checkpoint's name, say).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))
import benchmarks.report_choices  # noqa: E402, F401  (each registers its sections)
import benchmarks.report_heldout  # noqa: E402, F401
import benchmarks.report_speed  # noqa: E402, F401
from benchmarks.report_sections import RENDERERS, RESULTS, markdown_table, section  # noqa: E402, F401

README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Plots the docs show, copied into docs/assets/ (not tracked: ``make docs`` copies them).
ASSETS = ("quality_heldout.png", "local_steps.png")


def pages() -> list[Path]:
    """The pages with generated sections: README.md and every page under docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]


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
