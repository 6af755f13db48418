"""The meta-training command line as a user meets it: shipped config names, one-line
errors with exit code 2, the subcommands it has, and settings that cannot disagree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from learned_opt import list_pretrained
from learned_opt.cli import main as learned_opt_main
from learned_opt.meta_train.cli import meta_cli_main
from learned_opt.meta_train.data import TaskSeedDataModule
from learned_opt.meta_train.meta_cli import (
    CONFIG_DIR,
    TRAINER_DEFAULTS,
    MetaCLI,
    UsageError,
    resolve_config_args,
    shipped_configs,
)
from learned_opt.meta_train.module import MetaTrainModule


def _parse(tmp_path, *args) -> MetaCLI:
    return MetaCLI(
        MetaTrainModule,
        TaskSeedDataModule,
        args=["--config", str(CONFIG_DIR / "smoke.yaml"), f"--trainer.default_root_dir={tmp_path}"]
        + list(args),
        run=False,
        trainer_defaults=dict(TRAINER_DEFAULTS),
    )


def test_shipped_config_names_resolve_and_paths_stay_paths(tmp_path, monkeypatch):
    assert {"smoke", "default", "finetune"} <= set(shipped_configs())
    resolved = resolve_config_args(["fit", "--config", "smoke", "--config=finetune", "-x"])
    assert resolved == [
        "fit", "--config", str(CONFIG_DIR / "smoke.yaml"),
        f"--config={CONFIG_DIR / 'finetune.yaml'}", "-x",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    for path in ("./smoke", "smoke.yaml", "configs/smoke", "unknown"):
        with pytest.raises(UsageError, match="no such file, and not a shipped config"):
            resolve_config_args(["--config", path])
        (tmp_path / path).write_text("model: {}\n")
        assert resolve_config_args(["--config", path]) == ["--config", path]


@pytest.mark.parametrize(
    "args, first",
    [
        (["fit", "--config", "nosuch"], "--config nosuch: no such file, and not a shipped"),
        (["fit", "--model.no_such_field=3"], "unrecognized arguments: --model.no_such_field"),
    ],
)
def test_parse_errors_print_at_most_three_lines(capsys, monkeypatch, args, first):
    monkeypatch.setattr(sys, "argv", ["learned-opt-meta"])  # as from the console
    with pytest.raises(SystemExit) as info:
        meta_cli_main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3 and lines[0].startswith(f"learned-opt-meta: error: {first}"), lines


def test_finetune_config_resumes_the_stage1_of_the_checkout_by_path(monkeypatch):
    """The stage is a file of the checkout (``meta_train/stages/``), not a shipped name:
    stage checkpoints stay out of the wheel (issue 76)."""
    text = (CONFIG_DIR / "finetune.yaml").read_text()
    assert "init_checkpoint: meta_train/stages/default_stage1.pt" in text
    assert "default_stage1" not in list_pretrained()
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # configs name paths from the root
    MetaTrainModule(init_checkpoint="meta_train/stages/default_stage1.pt", baseline_cache=None)


def test_data_tasks_per_step_follows_the_model_and_runs_are_one_epoch(tmp_path):
    cli = _parse(tmp_path, "--model.tasks_per_step=3")
    assert cli.datamodule.tasks_per_step == cli.model.settings.tasks_per_step == 3
    assert cli.trainer.max_epochs == 1  # the progress bar reads "Epoch 0/0", not "0/-2"
    with pytest.raises(SystemExit):
        _parse(tmp_path, "--data.tasks_per_step=5")


@pytest.mark.parametrize(
    "mistake, message",
    [
        ("--model.family=no_such_family", "meta-training config field 'family'"),
        ("--model.init_checkpoint=./nope.pt", "./nope.pt: no such file"),
    ],
)
def test_config_mistake_is_one_line_with_exit_code_2(tmp_path, capsys, mistake, message):
    with pytest.raises(SystemExit) as info:
        meta_cli_main(
            ["fit", "--config", "smoke", f"--trainer.default_root_dir={tmp_path}", mistake]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"learned-opt-meta: error: {message}"), err
    assert "Traceback" not in err and "Seed set" not in err


def test_command_line_errors_in_a_real_process(tmp_path):
    """The installed entry point: one line for a config mistake; no test/predict."""
    entry = [sys.executable, "-m", "learned_opt.meta_train.cli_entry"]
    bad = subprocess.run(
        [*entry, "fit", "--config", "smoke", "--model.min_length=0",
         f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-2000:]
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert lines == ["learned-opt-meta: error: meta-training config field 'min_length': "
                     "must be a positive integer, got 0"], bad.stderr[-2000:]  # fmt: skip
    helped = subprocess.run([*entry, "--help"], capture_output=True, text=True, timeout=300)
    assert "fit" in helped.stdout and "validate" in helped.stdout
    assert "predict" not in helped.stdout and "{fit,validate}" in helped.stdout


def test_learned_opt_version(capsys):
    assert learned_opt_main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("learned-opt ")


def test_fit_and_validate_always_load_weights_only(tmp_path, monkeypatch):
    cli = _parse(tmp_path)
    seen = []
    for name in ("fit", "validate"):
        monkeypatch.setattr(cli.trainer, name, lambda model, **kw: seen.append(kw))
    cli.fit(cli.model, ckpt_path="x.ckpt", weights_only=False)
    cli.validate(cli.model, ckpt_path="x.ckpt")
    assert [kw["weights_only"] for kw in seen] == [True, True]


@pytest.mark.parametrize(
    "hidden, call, command",
    [
        ("lightning", "meta_cli_main(['fit', '--config', 'smoke'])", "learned-opt-meta"),
        ("tensorboard", "inspect_main(['adapt_init_2x', '--logdir', 'x'])", "learned-opt inspect"),
    ],
)
def test_missing_meta_extra_is_one_line_naming_it(tmp_path, hidden, call, command):
    """A ``None`` entry in ``sys.modules`` makes that import fail, as if not installed."""
    code = (
        f"import sys; sys.modules[{hidden!r}] = None\n"
        "from learned_opt.meta_train.cli import inspect_main, meta_cli_main\n" + call
    )
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [
        f"{command} needs the meta extra ({hidden} is missing): pip install -e '.[meta]' in the learned-opt checkout"
    ]


#: What reStructuredText inline markup leaves in a help text: a backquote or a role.
RST_MARKUP = re.compile(r"`|:(func|class|mod|meth|attr|data|exc):")


@pytest.mark.parametrize("command", ["export", "inspect"])
def test_export_and_inspect_help_is_plain(command, capsys):
    from learned_opt.meta_train import cli

    with pytest.raises(SystemExit) as info:
        (cli.export_main if command == "export" else cli.inspect_main)(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: learned-opt {command}" in out
    assert not RST_MARKUP.search(out), out


def test_meta_fit_help_is_plain(capsys):
    """``learned-opt-meta fit --help``: Lightning's Trainer options and our module's, with
    their docstrings' markup removed."""
    with pytest.raises(SystemExit) as info:
        meta_cli_main(["fit", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.max_steps" in out and "--model.unroll_length" in out
    assert "Holds theta (self.net)" in out
    assert not RST_MARKUP.search(out), [line for line in out.splitlines() if "`" in line]
