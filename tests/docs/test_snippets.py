"""Every code block of README.md and docs/*.md runs as written (see ``snippets.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import ROOT, blocks, commands, pages

RUNNABLE = ("python", "bash")
PAGES = pages()


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_code_blocks_run(page, tmp_path, monkeypatch, capsys):
    found = blocks(page)
    for block in found:
        assert block.lang, f"{block.id}: a code block needs a language (python, bash, text)"
    monkeypatch.chdir(tmp_path)  # files a snippet writes land here
    for folder in ("examples", "benchmarks"):  # the scripts a page runs
        (tmp_path / folder).symlink_to(ROOT / folder)
    namespace: dict = {"__name__": "__snippet__"}
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    for block in found:
        if block.file:
            assert block.code == (ROOT / block.file).read_text(), f"{block.id}: not {block.file}"
            continue
        if block.skip or block.lang not in RUNNABLE:
            continue
        if block.lang == "python":
            exec(compile(block.code, block.id, "exec"), namespace)  # noqa: S102
            continue
        for command in commands(block.code):
            run = subprocess.run(
                command,
                shell=True,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert run.returncode == 0, f"{block.id}: {command}\n{run.stderr[-3000:]}"
    _leave_no_process_group()


def _leave_no_process_group() -> None:
    """A page's snippets may leave the default process group up (Lightning's strategies
    keep theirs after ``fit``); the tests after it expect none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def test_skipped_blocks_say_why_in_the_text():
    """A skipped block's page says, in its own words, that the tests do not run it."""
    for page in pages():
        text = " ".join(page.read_text().split())  # sentences wrap across lines
        for block in blocks(page):
            if block.skip:
                assert "tests do not run" in text or "not run by the tests" in text, block.id


def test_shell_commands_are_parsed_whole():
    assert commands("a \\\n  --b 1  # note\n# comment\nc\n") == ["a --b 1", "c"]


def test_front_page_is_short_and_carries_no_history():
    """README.md: at most 250 lines, and no dates or commit hashes (those are history)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a date on the front page"
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", text), "a hash"
