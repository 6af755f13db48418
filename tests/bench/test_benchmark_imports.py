"""The benchmark modules import one another without a circle (a function-level import counts),
and every entry point of ``python -m benchmarks`` names a module that exists."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.__main__ import ENTRIES, SUITE, listing  # noqa: E402

BENCHMARKS = ROOT / "benchmarks"


def _imports(path: Path) -> set[str]:
    """The ``benchmarks`` modules that ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "benchmarks":
                found |= {a.name for a in node.names}
            elif node.module.startswith("benchmarks."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return found


def test_no_import_circle_among_the_benchmarks():
    graph = {p.stem: _imports(p) for p in BENCHMARKS.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import circle: {' -> '.join(path + [module])}"
        if module in done or module not in graph:
            return
        for other in sorted(graph[module]):
            visit(other, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_entry_points_name_modules_that_exist():
    assert len(ENTRIES) <= 12
    for entry in ENTRIES.values():
        assert (BENCHMARKS / f"{entry.module}.py").is_file(), entry.module
        if entry.variant:
            assert (BENCHMARKS / f"{entry.variant[1]}.py").is_file(), entry.variant
    assert all(step[0] in ENTRIES for step in SUITE)
    assert all(name in listing() for name in ENTRIES)
