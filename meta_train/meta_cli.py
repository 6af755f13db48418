"""``MetaCLI``: the ``learned-opt-meta`` LightningCLI, made safe and readable.

- A ``--ckpt_path`` to resume from is read with ``torch.load(weights_only=True)`` before
  anything else (a file that would run code is refused), and the run resumes with
  ``weights_only=True``; ``--weights_only false`` is refused.
- The subcommands are ``fit`` and ``validate``: the module has no ``test_step`` or
  ``predict_step``.
- A mistake in the config (a bad field, an unreadable checkpoint) is raised as
  :class:`UsageError`, which the entry point prints as one line (exit code 2).
- ``--config smoke`` names a shipped config (``learned_opt/meta_train/configs/smoke.yaml``,
  installed with the package); a path (``./my.yaml``, ``configs/x.yaml``) is read as such.
- ``data.tasks_per_step`` is not a setting of its own: it follows ``model.tasks_per_step``.
- The run is one epoch of an endless stream of task seeds (``max_epochs: 1``); ``max_steps``
  or ``max_time`` ends it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from pathlib import Path

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningCLI

from learned_opt.checkpoint import (
    CheckpointError,
    is_explicit_path,
    load_checkpoint,
    read_torch_file,
)
from learned_opt.helptext import PlainText

from .settings import validate_settings

#: The shipped meta-training configs (``--config <name>``), installed with the package.
CONFIG_DIR = Path(__file__).parent / "configs"

#: Trainer settings of every run unless the config says otherwise.
TRAINER_DEFAULTS = {"default_root_dir": "runs/meta", "max_epochs": 1}


#: Lightning's own notices that say nothing about the run: the hardware it did not use, an
#: advert, the seed, a limit the config set, and why ``fit`` stopped (``max_steps``).
LIGHTNING_NOTICES = re.compile(
    r"^(\[rank: \d+\] )?(GPU available|TPU available|HPU available|💡 Tip|Seed set to "
    r"|`Trainer\(\w+=1(\.0)?\)` was configured so|`Trainer.fit` stopped)"
)
#: Lightning's warnings that do not apply (``message`` regex, category).
LIGHTNING_WARNINGS = (
    # the meta-state is saved after the outer step, which is what a resumed run needs
    (r"Using ModelCheckpoint with manual optimization and every_n_train_steps", Warning),
    # torch deprecates a class that Lightning's own code still builds
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
)
#: The loggers Lightning's notices come through.
LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.seed",
)


def _not_a_notice(record: logging.LogRecord) -> bool:
    return not LIGHTNING_NOTICES.search(record.getMessage())


@contextlib.contextmanager
def lightning_notices_silenced():
    """Within it, Lightning's notices (:data:`LIGHTNING_NOTICES`) and its warnings that do
    not apply (:data:`LIGHTNING_WARNINGS`) are not printed; its other warnings, errors and
    the progress bar are."""
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    with warnings.catch_warnings():
        for message, category in LIGHTNING_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for logger in loggers:
            logger.addFilter(_not_a_notice)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(_not_a_notice)


class UsageError(Exception):
    """A command-line or config mistake, reported as one line with exit code 2."""


#: ``--ckpt_path`` values that Lightning resolves to a checkpoint of the run itself.
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")


def shipped_configs() -> list[str]:
    """Names of the shipped meta-training configs (``--config <name>``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with each ``--config <shipped name>`` replaced by the shipped file's path;
    a :class:`UsageError` when a config is neither a shipped name nor a file."""

    def resolve(value: str) -> str:
        shipped = CONFIG_DIR / f"{value}.yaml"
        if not is_explicit_path(value) and shipped.is_file():
            return str(shipped)
        if not Path(value).is_file():
            raise UsageError(
                f"--config {value}: no such file, and not a shipped config "
                f"(shipped: {', '.join(shipped_configs())})"
            )
        return value

    out: list[str] = []
    for i, arg in enumerate(args):
        if i > 0 and args[i - 1] == "--config":
            out.append(resolve(arg))
        elif arg.startswith("--config="):
            out.append("--config=" + resolve(arg[len("--config=") :]))
        else:
            out.append(arg)
    return out


def check_resume_checkpoint(ckpt_path: str | None, weights_only: bool | None) -> None:
    """Refuse an unsafe or unreadable ``--ckpt_path`` before any training starts."""
    if weights_only is False:
        raise UsageError(
            "--weights_only false is not supported: checkpoints are always read as tensors "
            "and plain data, so that loading one can never run code"
        )
    if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_NAMES:
        return  # Lightning finds that file itself, and loads it with weights_only=True
    if not Path(ckpt_path).is_file():
        raise UsageError(f"--ckpt_path {ckpt_path}: no such checkpoint file")
    payload = read_torch_file(ckpt_path, "a Lightning checkpoint")
    if not isinstance(payload, dict) or "state_dict" not in payload:
        raise CheckpointError(f"{ckpt_path}: not a Lightning checkpoint (no state_dict)")


class PlainHelpFormatter(PlainText, DefaultHelpFormatter):
    """jsonargparse's help (types, defaults) as plain text: Lightning's docstrings and ours
    are reStructuredText."""


class MetaCLI(LightningCLI):
    """LightningCLI with the ``fit`` and ``validate`` subcommands and safe resuming."""

    def init_parser(self, **kwargs):
        """Lightning's parser, printing ``--help`` as plain text (no reStructuredText)."""
        kwargs.setdefault("formatter_class", PlainHelpFormatter)
        return super().init_parser(**kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        subcommands = LightningCLI.subcommands()
        return {name: subcommands[name] for name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.tasks_per_step", "data.tasks_per_step")

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            settings = self.config[subcommand]
            check_resume_checkpoint(settings.get("ckpt_path"), settings.get("weights_only"))
            model = settings.get("model")
            if model is not None:  # before seeding, logging or any process starts
                try:
                    validate_settings(model.as_dict())
                    if model.get("init_checkpoint"):
                        load_checkpoint(model.init_checkpoint)
                except (ValueError, CheckpointError) as exc:
                    raise UsageError(str(exc)) from None

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, CheckpointError) as exc:  # validate_settings, init_checkpoint
            raise UsageError(str(exc)) from exc

    def fit(self, model, **kwargs) -> None:
        """``Trainer.fit``, always resuming with ``weights_only=True``; then one line says
        where the run's logs and checkpoints are."""
        trainer = self.trainer
        trainer.fit(model, **{**kwargs, "weights_only": True})
        log_dir = trainer.log_dir  # a collective in a data-parallel run: every rank asks
        if trainer.is_global_zero:
            last = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
            print(
                f"learned-opt-meta: {trainer.global_step} meta-steps; logs in {log_dir}"
                + (f"; export with: learned-opt export {last} out.pt" if last else ""),
                flush=True,
            )
        _close_process_group()

    def validate(self, model, **kwargs):
        """``Trainer.validate``, always loading with ``weights_only=True``."""
        return self.trainer.validate(model, **{**kwargs, "weights_only": True})


def _close_process_group() -> None:
    """After a data-parallel fit, the ranks meet once more and close their process group, so
    that none exits while the group's threads are alive (under load, a rank's exit then
    aborted with "terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
