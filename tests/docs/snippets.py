"""Read the code blocks of the project's Markdown pages, for ``test_snippets.py``.

A page's ``python`` blocks run in order in one namespace (a later block may use what an
earlier one defined); each ``bash`` block runs its command lines in a shell. A block right
after a ``<!-- snippet: skip (reason) -->`` comment is not run: the page's text must say
why (installing packages, starting a server, a long run). A block right after
``<!-- snippet: file PATH -->`` shows a file of the repository (a script that a later
``bash`` block runs) and must equal it. Blocks of other languages (``text``, ``yaml``)
are output or file contents, not code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(
    r"(?:<!-- snippet: (?:skip \((?P<why>[^)]+)\)|file (?P<file>\S+)) -->\n)?"
    r"^```(?P<lang>\w*)\n(?P<code>.*?)^```$",
    re.M | re.S,
)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None
    file: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order."""
    text = page.read_text()
    name = str(page.relative_to(ROOT))
    return [
        Block(
            name,
            text.count("\n", 0, m.start("code")),
            m.group("lang"),
            m.group("code"),
            m.group("why"),
            m.group("file"),
        )
        for m in FENCE.finditer(text)
    ]


def commands(code: str) -> list[str]:
    """The command lines of a bash block: comments dropped, continuation lines joined."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    lines = [line.split(" # ")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]
