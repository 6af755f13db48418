"""What a new user reads first says one thing: how to install (from a checkout, torch's CPU
build first) and that the shipped rule is hand-set, not meta-trained."""

from __future__ import annotations

import re

import pytest
from snippets import ROOT, blocks, commands, pages

import learned_opt

#: The one story, in the same words on every first page.
HAND_SET = "hand-set, not meta-trained"
#: Pages that record the past (the changelog quotes earlier install lines).
RECORDS = ("docs/changelog.md", "docs/history.md", "docs/results.md")
#: An install from the package index, where learned-opt is not published.
FROM_INDEX = re.compile(r"pip install\s+['\"]?learned-opt\b")


def _description() -> str:
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is not in Python 3.10)
    return re.search(r'^description = "([^"]*)"$', text, re.M).group(1)


def test_the_package_description_does_not_call_the_shipped_rule_meta_trained():
    description = _description()
    assert not description.lower().startswith("meta-trained"), description
    assert HAND_SET in description


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/guide/meta-training.md"])
def test_the_first_pages_say_the_shipped_rule_is_hand_set(page):
    text = " ".join((ROOT / page).read_text().split())
    assert HAND_SET in text


def test_the_package_docstring_does_not_call_itself_meta_trained():
    first = " ".join(learned_opt.__doc__.split("\n\n")[0].split())
    assert "meta-trained learned optimizers" not in first
    assert HAND_SET in first


def test_no_page_installs_from_the_package_index():
    """``pip install learned-opt`` fails (the name is not on the index): no page says to run
    it, and no message of the package names it."""
    for page in pages():
        name = str(page.relative_to(ROOT))
        if name in RECORDS:
            continue
        for block in blocks(page):
            for line in commands(block.code):
                assert not FROM_INDEX.search(line), f"{block.id}: {line}"
    for folder in ("learned_opt", "meta_train", "distributed", "tasks"):
        for path in (ROOT / folder).rglob("*.py"):
            assert not FROM_INDEX.search(path.read_text()), path


def test_the_readme_installs_torch_s_cpu_build_before_the_checkout():
    install = [
        line
        for block in blocks(ROOT / "README.md")
        if block.lang == "bash"
        for line in commands(block.code)
        if line.startswith(("pip install", ".venv/bin/pip install"))
    ]
    first_checkout = next(i for i, line in enumerate(install) if "pip install -e" in line)
    cpu = "--index-url https://download.pytorch.org/whl/cpu"
    assert cpu in install[0] and install[0].split()[-3].startswith("torch"), install
    assert first_checkout > 0
    assert {"pip install -e .", "pip install -e '.[tasks]'", "pip install -e '.[meta]'"} <= set(
        install
    )
