"""The training entry as a new user meets it: exit status 0 on success, one line naming the
extra to install in a core-only install, and a word when gossip has nobody to mix with."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from learned_opt.cli import main as learned_opt_main
from learned_opt.distributed import GossipOptimizer, SimulatedCommunicator, get_topology
from learned_opt.distributed.gossip import NOTHING_TO_MIX


def test_train_command_exits_0_and_says_there_is_nothing_to_mix(capsys):
    argv = ["train", "--task", "digits_mlp", "--optimizer", "adam", "--steps", "3"]
    with pytest.warns(UserWarning, match="world size 1, so there is nothing to mix"):
        assert learned_opt_main(argv) == 0
    assert capsys.readouterr().out.startswith("task=digits_mlp optimizer=adam")


def test_gossip_with_one_worker_warns_once_per_optimizer():
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.warns(UserWarning) as record:
        GossipOptimizer(
            torch.optim.SGD([param], lr=0.1),
            communicator=SimulatedCommunicator(get_topology("ring", 1)),
            mixing="metropolis",
        )
    assert [str(w.message) for w in record] == [NOTHING_TO_MIX]


@pytest.mark.parametrize("hidden, named", [("sklearn", "scikit-learn"), ("numpy", "numpy")])
def test_core_only_install_gets_one_line_naming_the_extra(tmp_path, hidden, named):
    """A ``None`` entry in ``sys.modules`` makes that import fail, as if not installed."""
    code = (
        f"import sys; sys.modules[{hidden!r}] = None\n"
        "from learned_opt.distributed.train import main\n"
        "main(['--task', 'digits_mlp', '--steps', '1'])\n"
    )
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [
        f"learned-opt train needs the tasks extra ({named} is missing): "
        "pip install -e '.[tasks]' in the learned-opt checkout"
    ]


def test_train_help_is_plain(capsys):
    """The torchrun entry's ``--help`` is plain text, not its docstring's markup."""
    import re

    from learned_opt.distributed.train import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "Decentralized training of a task from learned_opt.tasks" in out
    assert not re.search(r"`|:(func|class|mod|meth|attr):", out), out
