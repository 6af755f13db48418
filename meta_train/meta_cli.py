"""``MetaCLI``: the ``learned-opt-meta`` LightningCLI, made safe and readable.

- A ``--ckpt_path`` to resume from is read with ``torch.load(weights_only=True)`` before
  anything else (a file that would run code is refused), and the run resumes with
  ``weights_only=True``; ``--weights_only false`` is refused.
- The subcommands are ``fit`` and ``validate``: the module has no ``test_step`` or
  ``predict_step``.
- A mistake in the config (a bad field, an unreadable checkpoint) is raised as
  :class:`UsageError`, which the entry point prints as one line (exit code 2).
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from learned_opt.checkpoint import CheckpointError, read_torch_file


class UsageError(Exception):
    """A command-line or config mistake, reported as one line with exit code 2."""


def check_resume_checkpoint(ckpt_path: str | None, weights_only: bool | None) -> None:
    """Refuse an unsafe or unreadable ``--ckpt_path`` before any training starts."""
    if weights_only is False:
        raise UsageError(
            "--weights_only false is not supported: checkpoints are always read as tensors "
            "and plain data, so that loading one can never run code"
        )
    if not ckpt_path:
        return
    if not Path(ckpt_path).is_file():
        raise UsageError(f"--ckpt_path {ckpt_path}: no such checkpoint file")
    payload = read_torch_file(ckpt_path, "a Lightning checkpoint")
    if not isinstance(payload, dict) or "state_dict" not in payload:
        raise CheckpointError(f"{ckpt_path}: not a Lightning checkpoint (no state_dict)")


class MetaCLI(LightningCLI):
    """LightningCLI with the ``fit`` and ``validate`` subcommands and safe resuming."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        subcommands = LightningCLI.subcommands()
        return {name: subcommands[name] for name in ("fit", "validate")}

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            settings = self.config[subcommand]
            check_resume_checkpoint(settings.get("ckpt_path"), settings.get("weights_only"))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, CheckpointError) as exc:  # validate_settings, init_checkpoint
            raise UsageError(str(exc)) from exc

    def fit(self, model, **kwargs) -> None:
        """``Trainer.fit``, always resuming with ``weights_only=True``."""
        self.trainer.fit(model, **{**kwargs, "weights_only": True})

    def validate(self, model, **kwargs):
        """``Trainer.validate``, always loading with ``weights_only=True``."""
        return self.trainer.validate(model, **{**kwargs, "weights_only": True})
