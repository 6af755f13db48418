"""The wheel lists every package of the source tree (a subpackage left out of
``[tool.setuptools] packages`` installs without its modules, and import fails)."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_in_the_wheel():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(tool["packages"]), tool["package-dir"]
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "stages" in rel.parts or "__pycache__" in rel.parts:
                continue
            package = ".".join([name, *rel.parts])
            assert package in listed, f"{package} ({init.parent}) is not in pyproject's packages"
