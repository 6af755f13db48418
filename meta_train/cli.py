"""Command-line entry points of meta-training: ``learned-opt-meta`` (LightningCLI),
``learned-opt export`` and ``learned-opt inspect``."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

from learned_opt.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_torch_file,
    resolve_checkpoint,
    save_checkpoint,
)
from learned_opt.config import MixingConfig, NetConfig, split_config
from learned_opt.network import LearnedOptimizerNet

#: Packages of the ``[meta]`` extra (with those of ``[tasks]`` it includes).
META_PACKAGES = (
    "lightning",
    "jsonargparse",
    "matplotlib",
    "tensorboard",
    "numpy",
    "sklearn",
    "yaml",
)


@contextlib.contextmanager
def meta_extra(command: str):
    """Turn a missing package of the ``[meta]`` extra into one line naming what to install
    (exit code 1), instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in META_PACKAGES:
            raise
        print(
            f"{command} needs the meta extra ({exc.name} is missing): "
            "pip install -e '.[meta]' in the learned-opt checkout",
            file=sys.stderr,
        )
        raise SystemExit(1) from None


def meta_cli_main(args: list[str] | None = None):
    """``learned-opt-meta fit --config default`` (a LightningCLI; see :mod:`.meta_cli`).

    A config mistake or an unreadable or unsafe checkpoint is printed as one line on
    stderr and exits with code 2 (``SystemExit``)."""
    with meta_extra("learned-opt-meta"):
        from .data import TaskSeedDataModule
        from .meta_cli import (
            TRAINER_DEFAULTS,
            MetaCLI,
            UsageError,
            lightning_notices_silenced,
            resolve_config_args,
        )
        from .module import MetaTrainModule

    command = " ".join(["learned-opt-meta", *(sys.argv[1:] if args is None else args)])
    MetaTrainModule.launch_command = command
    try:
        if args is None:  # LightningCLI reads sys.argv itself
            sys.argv[1:] = resolve_config_args(sys.argv[1:])
        else:
            args = resolve_config_args(list(args))
        with lightning_notices_silenced():
            MetaCLI(
                MetaTrainModule,
                TaskSeedDataModule,
                args=args,
                seed_everything_default=0,
                save_config_kwargs={"overwrite": True},
                trainer_defaults=dict(TRAINER_DEFAULTS),
                # a parse error is raised, not printed after 70 lines of usage
                parser_kwargs={"exit_on_error": False},
            )
    except (UsageError, CheckpointError, argparse.ArgumentError) as exc:
        message = " ".join(str(exc).split())  # jsonargparse's message may span lines
        print(f"learned-opt-meta: error: {message}", file=sys.stderr)
        if isinstance(exc, argparse.ArgumentError):
            print(
                "learned-opt-meta: run 'learned-opt-meta fit --help' for the options",
                file=sys.stderr,
            )
        raise SystemExit(2) from None


def _read_lightning_checkpoint(path: str) -> dict:
    """A meta-training run's Lightning checkpoint, read as tensors and plain data only.

    The project's checkpoints need no allow-listed classes: hyper-parameters, loop and
    callback state, optimizer state and the persistent trajectories are all plain data.
    """
    if not Path(path).is_file():
        raise CheckpointError(f"{path}: no such Lightning checkpoint")
    ckpt = read_torch_file(path, "a Lightning checkpoint")
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no state_dict)")
    return ckpt


def card_summary(card: dict) -> str:
    """One paragraph saying how a meta-trained checkpoint was made and what it measured."""
    v = card.get("validation", {})
    setting = v.get("setting", {})
    if "es_geomean_speedup" in v:  # the es estimator: the constants against the base rule
        measured = (
            f" Validation ({setting.get('draws')} draws of {setting.get('family')!r} from seed "
            f"{setting.get('first_seed')}, runs capped at {setting.get('horizon_cap')} steps): "
            f"geometric mean step speedup {v['es_geomean_speedup']:.3f}x over the base rule, "
            f"final loss {1 / v.get('es_geomean_final_ratio', math.nan):.3f} of its; "
            f"{v.get('diverged', 0)} diverged."
        )
        return (
            f"Meta-trained by `{card.get('command')}`: {card.get('meta_steps')} meta-steps, "
            f"{card.get('wall_time_s')} s of training.{measured}"
        )
    measured = (
        f" Validation ({setting.get('horizon', '?')} steps, held-in tasks "
        f"{[r['task'] for r in v.get('single', [])]}): median speedup "
        f"{v['median_speedup_adam']:.2f}x over learning-rate-tuned Adam (1 worker) and "
        f"{v['median_speedup_dadam']:.2f}x over tuned D-Adam/Metropolis "
        f"({setting.get('workers')} workers, {setting.get('topology')}, "
        f"{setting.get('partition')} {setting.get('alpha')}); {v.get('diverged', 0)} diverged."
        if "median_speedup_adam" in v
        else " No validation recorded."
    )
    return (
        f"Meta-trained by `{card.get('command')}`: {card.get('meta_steps')} meta-steps, "
        f"{card.get('wall_time_s')} s of training.{measured}"
    )


def _net_configs(lightning_ckpt, state: dict, hp: dict) -> tuple[NetConfig, MixingConfig]:
    """The network's configs (update rule, mixing head): saved with the run (runs saved
    before the split hold both in ``net_config``), else those of its ``init_checkpoint``
    (runs saved before the configs were), else the defaults at the run's width."""
    try:
        if "net_config" in state:
            return split_config(state["net_config"], state.get("net_mixing"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{lightning_ckpt}: malformed net_config: {exc}") from exc
    if hp.get("init_checkpoint"):
        net = load_checkpoint(hp["init_checkpoint"])[0]
        return net.config, net.mixing
    return NetConfig(width=int(hp.get("width", 8))), MixingConfig()


def export(lightning_ckpt: str, out: str, validate: bool = True) -> Path:
    """Write the deployable checkpoint of a meta-training run, with its card.

    With ``validate`` the run's validation is measured afresh on the exported theta (the
    card then holds these numbers); otherwise the card keeps the run's last validation.
    """
    ckpt = _read_lightning_checkpoint(lightning_ckpt)
    hp = {k: v for k, v in ckpt.get("hyper_parameters", {}).items() if not k.startswith("_")}
    theta = {k[len("net.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}
    if not theta:
        raise CheckpointError(f"{lightning_ckpt}: holds no learned-optimizer network (net.*)")
    state = ckpt.get("meta_state", {})
    config, mixing = _net_configs(lightning_ckpt, state, hp)
    net = LearnedOptimizerNet(config, mixing)
    try:
        net.load_state_dict(theta)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{lightning_ckpt}: network does not match its config {config}: {exc}"
        ) from exc
    validation = state.get("last_validation", {})
    if validate:
        from .module import MetaTrainModule

        module = MetaTrainModule(**hp)
        module.net.load_state_dict(theta)
        if "theta_c" in ckpt["state_dict"]:  # the es estimator's constants
            module.theta_c.data.copy_(ckpt["state_dict"]["theta_c"])
        print("measuring validation on the exported optimizer ...", flush=True)
        validation, _, _ = module.run_validation()
        validation["global_step"] = int(ckpt.get("global_step", 0))
    card = {
        "name": Path(out).stem,
        "trained": True,
        "command": state.get("command", "unknown"),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in hp.items()},
        "data": (
            f"whole runs of jobs drawn from {hp.get('family')!r}, evolution strategies over "
            f"the rule's constants {list(hp.get('es_constants', []))}"
            if hp.get("estimator") == "es"
            else f"task family {hp.get('family')!r} from learned_opt.tasks (offline data only)"
        ),
        "meta_steps": int(ckpt.get("global_step", 0)),
        "wall_time_s": round(float(state.get("train_seconds", 0.0)), 1),
        "skipped_outer_steps": int(state.get("skipped_steps", 0)),
        "validation": validation,
        "exported_from": str(lightning_ckpt),
        "exported_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    card["summary"] = card_summary(card)
    return save_checkpoint(net, out, card)


def inspect(checkpoint: str, logdir: str) -> Path:
    """Write a checkpoint's card and response curves to TensorBoard under ``logdir``.

    Event files already directly in ``logdir`` (an earlier ``inspect``) are replaced, so
    running it twice does not show every curve twice."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    from .summaries import mixing_response, response_image, update_response

    net, card = load_checkpoint(checkpoint)
    theta = {k: v.detach() for k, v in net.named_parameters()}
    for old in Path(logdir).glob("events.out.tfevents.*"):
        old.unlink()
    writer = SummaryWriter(logdir)
    writer.add_text("card/json", "```\n" + json.dumps(card, indent=2, default=str) + "\n```", 0)
    for step in (1, 100, 1000):
        img = response_image(
            update_response(theta, net.config, step=step), "g / rms(g)", "update",
            f"update vs normalised gradient, step {step}",
        )  # fmt: skip
        writer.add_image(f"response/update_step_{step}", img, 0, dataformats="HWC")
    img = response_image(
        mixing_response(theta, net.config), "||y_a - y_b|| / (||y_a|| + ||y_b||)", "weight",
        "learned mixing weight vs edge distance",
    )  # fmt: skip
    writer.add_image("response/mixing_weight", img, 0, dataformats="HWC")
    writer.close()
    return Path(logdir)


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="learned-opt export",
        description="Write the deployable checkpoint of a meta-training run, with its card. "
        "The run's validation is measured afresh on the exported optimizer, and the card "
        "holds these numbers; --no-validate keeps the run's last validation instead.",
    )
    parser.add_argument("lightning_ckpt")
    parser.add_argument("out")
    parser.add_argument(
        "--no-validate", action="store_true", help="keep the run's last validation in the card"
    )
    a = parser.parse_args(argv)
    with meta_extra("learned-opt export"):
        print(f"wrote {export(a.lightning_ckpt, a.out, validate=not a.no_validate)}")
    return 0


def inspect_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="learned-opt inspect",
        description="Write a checkpoint's card and response curves to TensorBoard under "
        "--logdir. Event files already directly in it (an earlier inspect) are replaced, "
        "so running it twice does not show every curve twice.",
    )
    parser.add_argument("checkpoint", help="a file path or a shipped name such as 'default'")
    parser.add_argument(
        "--logdir", default="runs/inspect", help="event files already in it are replaced"
    )
    a = parser.parse_args(argv)
    with meta_extra("learned-opt inspect"):
        out = inspect(a.checkpoint, a.logdir)
    print(f"inspected {resolve_checkpoint(a.checkpoint)}")
    print(f"wrote TensorBoard events to {out}; view with: tensorboard --logdir {out}")
    return 0
