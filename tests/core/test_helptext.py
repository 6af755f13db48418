"""``--help`` is plain text: the docstrings it is made of are reStructuredText, and their
markup (double backquotes, ``:func:`` roles, links) is removed."""

from __future__ import annotations

import re

import pytest

from learned_opt.cli import main
from learned_opt.helptext import plain

#: What reStructuredText inline markup leaves in a help text: a backquote or a role.
MARKUP = re.compile(r"`|:(func|class|mod|meth|attr|data|exc):")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a ``literal`` here", "a literal here"),
        ("Default: ``'auto'``, or `N`", "Default: 'auto', or N"),
        (":func:`learned_opt.step.tensor_step`", "learned_opt.step.tensor_step"),
        (":class:`~.local_steps.LocalSteps` and :py:meth:`~a.B.c`", "LocalSteps and c"),
        (":meth:`under_gossip <learned_opt.config.MixingConfig.under_gossip>`", "under_gossip"),
        ("`argparse <https://docs.python.org/3/library/argparse.html>`_", "argparse"),
        ("spans ``max_epochs\n = 1000`` lines", "spans max_epochs\n = 1000 lines"),
        ("it's plain, don't touch", "it's plain, don't touch"),
        (None, ""),
    ],
)
def test_plain_removes_inline_markup(text, expected):
    assert plain(text) == expected


def test_learned_opt_help_is_plain(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "learned-opt export <lightning.ckpt> <out.pt>" in out
    assert not MARKUP.search(out), out
