"""Docstrings as plain text for ``--help``: reStructuredText's inline markup removed."""

from __future__ import annotations

import argparse
import re

#: ``:role:`target``` (any domain: ``:py:func:``), ``:role:`text <target>```.
_ROLE = re.compile(r":(?:[\w-]+:)+`([^`]+)`")
#: ```text <https://...>`_`` and ```text`_``.
_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^`>]*>)?`__?")
_LITERAL = re.compile(r"``(.+?)``", re.S)
_INTERPRETED = re.compile(r"(?<![\w`])`([^`]+)`(?![\w`])")


def _role(match: re.Match) -> str:
    text = match.group(1).strip()
    labelled = re.fullmatch(r"(.+?)\s*<[^<>]+>", text, re.S)
    if labelled:
        return labelled.group(1)
    if text.startswith("~"):  # Sphinx shows the last component only
        return text.rsplit(".", 1)[-1]
    return text.lstrip(".!")


def plain(text: str | None) -> str:
    """``text`` without inline reStructuredText markup: literals and interpreted text lose
    their backquotes, a role (``:func:``, ``:class:`` ...) keeps its target (only the last
    component after a ``~``), and a labelled role or a link keeps its label."""
    if not text:
        return ""
    text = _ROLE.sub(_role, text)
    text = _LINK.sub(lambda m: m.group(1), text)
    text = _LITERAL.sub(lambda m: m.group(1), text)
    return _INTERPRETED.sub(lambda m: m.group(1), text)


class PlainText:
    """A mixin for an ``argparse`` help formatter: headings, descriptions and option help
    printed as :func:`plain` text (``class F(PlainText, argparse.HelpFormatter)``)."""

    def start_section(self, heading) -> None:
        super().start_section(plain(heading) if heading else heading)

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action) -> str:
        return plain(super()._expand_help(action))


class PlainHelpFormatter(PlainText, argparse.HelpFormatter):
    """``argparse.HelpFormatter`` printing :func:`plain` text."""
