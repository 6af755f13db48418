"""The meta-training CLI end to end: smoke config, TensorBoard tags, resume, export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learned_opt import LearnedOptimizer, load_checkpoint
from learned_opt.checkpoint import CheckpointError
from learned_opt.meta_train.cli import export, inspect, meta_cli_main
from learned_opt.meta_train.meta_cli import CONFIG_DIR

CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def smoke_args(tmp_path, *extra):
    """CLI arguments for the smoke config, writing under ``tmp_path``."""
    return [
        "fit", "--config", str(CONFIG_DIR / "smoke.yaml"),
        f"--trainer.default_root_dir={tmp_path}", *extra,
    ]  # fmt: skip


def _run_dir(root: Path) -> Path:
    return sorted(root.glob("lightning_logs/version_*"))[-1]


def _scalars_and_tags(run: Path) -> tuple[dict, set]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"images": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    return {t: acc.Scalars(t) for t in tags["scalars"]}, set(
        tags["scalars"] + tags["images"] + tags["histograms"]
    )


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    meta_cli_main(smoke_args(root))
    return root


#: Parses each config named on its command line with ``--print_config``, in one process
#: (each process pays about 3.5 s to import Lightning), and prints one line per config:
#: its path and whether the printed config holds the meta-training fields.
_PARSE_CONFIGS = """
import contextlib, io, sys
from learned_opt.meta_train.cli import meta_cli_main
paths, sys.argv[1:] = sys.argv[1:], []  # the CLI is given its arguments, not sys.argv
for path in paths:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            meta_cli_main(["fit", "--config", path, "--print_config"])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    print(path, "unroll_length" in out.getvalue(), flush=True)
"""


def test_shipped_configs_parse():
    assert {c.name for c in CONFIGS} >= {"smoke.yaml", "default.yaml"}
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_CONFIGS, *map(str, CONFIGS)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [x for c in CONFIGS for x in (str(c), "True")], proc.stdout


def test_smoke_writes_expected_tensorboard_tags(smoke_run):
    scalars, tags = _scalars_and_tags(_run_dir(smoke_run))
    expected = {
        "meta/loss", "meta/grad_norm", "meta/outer_lr", "meta/inner_steps_x_workers_per_s",
        "val/median_speedup_adam", "val/median_speedup_dadam", "probe/loss_curves",
        "probe/mixing_matrix", "train/update_rms", "train/mixing_weights",
        "val/consensus/iris_mlp",
    }  # fmt: skip
    assert expected <= tags, expected - tags
    assert len(scalars["meta/loss"]) == 4
    assert all(torch.isfinite(torch.tensor(e.value)) for e in scalars["meta/loss"])


def test_resume_continues_the_run(smoke_run, tmp_path):
    ckpt = _run_dir(smoke_run) / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == 4 and saved["meta_slots"], "slots are saved"
    meta_cli_main(
        smoke_args(tmp_path, "--trainer.max_steps=6", f"--ckpt_path={ckpt}",
                   "--trainer.val_check_interval=100")
    )  # fmt: skip
    resumed = torch.load(_run_dir(tmp_path) / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 6
    old = saved["state_dict"]["net.elem_out.weight"]
    assert not torch.equal(old, resumed["state_dict"]["net.elem_out.weight"])


def test_export_loads_and_trains(smoke_run, tmp_path):
    ckpt = _run_dir(smoke_run) / "checkpoints" / "last.ckpt"
    out = export(str(ckpt), str(tmp_path / "opt.pt"))
    net, card = load_checkpoint(out)
    assert (
        card["trained"]
        and card["meta_steps"] == 4
        and card["command"].startswith("learned-opt-meta")
    )
    assert "median_speedup_adam" in card["validation"]
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    x, y = torch.randn(64, 5), torch.randn(64, 1)
    opt = LearnedOptimizer(model.parameters(), checkpoint=out, lr=10.0)
    first = None
    for _ in range(100):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = first if first is not None else float(loss)
        loss.backward()
        opt.step()
    assert float(loss) < 0.9 * first


def test_export_rejects_bad_files(tmp_path):
    with pytest.raises(CheckpointError, match="no such"):
        export(str(tmp_path / "missing.ckpt"), str(tmp_path / "o.pt"))
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="bad.ckpt"):
        export(str(bad), str(tmp_path / "o.pt"))


def test_inspect_writes_card_and_response_curves(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    inspect("default", str(tmp_path))
    inspect("default", str(tmp_path))  # again: replaces, never duplicates
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    images = set(acc.Tags()["images"])
    assert {"response/mixing_weight", "response/update_step_100"} <= images
    assert any(t.startswith("card/") for t in acc.Tags()["tensors"])


def test_meta_training_from_ortho_init_runs_and_exports_an_ortho_checkpoint(tmp_path):
    """The "ortho" output (Newton-Schulz inside the unroll) meta-trains end to end."""
    meta_cli_main(smoke_args(tmp_path, "--model.init_checkpoint=ortho_init"))
    run = _run_dir(tmp_path)
    scalars, _ = _scalars_and_tags(run)
    assert all(torch.isfinite(torch.tensor(s.value)) for s in scalars["meta/loss"])
    out = export(str(run / "checkpoints" / "last.ckpt"), tmp_path / "ortho.pt", validate=False)
    net, _ = load_checkpoint(out)
    assert net.config.output == "ortho" and net.config.ortho_min_dim == 16
    start, _ = load_checkpoint("ortho_init")
    moved = [k for k, v in net.theta().items() if not torch.equal(v, start.theta()[k])]
    assert moved, "the outer steps changed theta"


def test_export_of_a_run_saved_without_its_net_config_uses_the_init_checkpoints(tmp_path):
    """Runs saved before the config was stored still export with their real output."""
    meta_cli_main(smoke_args(tmp_path, "--model.init_checkpoint=ortho_init"))
    ckpt_path = _run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    del ckpt["meta_state"]["net_config"]
    torch.save(ckpt, tmp_path / "old.ckpt")
    out = export(str(tmp_path / "old.ckpt"), tmp_path / "old.pt", validate=False)
    assert load_checkpoint(out)[0].config.output == "ortho"


def test_export_of_a_run_saved_before_the_mixing_config_was_split(tmp_path):
    """Runs saved before the split hold the mixing head's fields in ``net_config``."""
    meta_cli_main(smoke_args(tmp_path, "--model.init_checkpoint=ortho_init"))
    ckpt = torch.load(_run_dir(tmp_path) / "checkpoints" / "last.ckpt", weights_only=True)
    state = ckpt["meta_state"]
    assert state["net_mixing"] == load_checkpoint("ortho_init")[0].mixing.to_dict()
    state["net_config"].update(state.pop("net_mixing"), lr_adapt_max_gossip=3.0)
    torch.save(ckpt, tmp_path / "old.ckpt")
    net = load_checkpoint(export(str(tmp_path / "old.ckpt"), tmp_path / "old.pt", validate=False))[
        0
    ]
    assert net.config.output == "ortho" and net.mixing.lr_adapt_max_gossip == 3.0


def test_a_smoke_fit_prints_no_lightning_notices(tmp_path):
    """``learned-opt-meta fit --config smoke`` for 2 steps, as a user runs it: Lightning's
    notices (the unused hardware, an advert, the seed, a deprecation, a 12-line example
    about checkpoints) are gone; the progress bar and the line saying where the run's logs
    and checkpoints are remain."""
    cmd = [
        sys.executable, "-m", "learned_opt.meta_train.cli_entry", "fit", "--config", "smoke",
        "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    for notice in (
        "GPU available", "TPU available", "Tip", "litlogger", "Seed set", "was configured so",
        "deprecated", "Warning", "saved_models", "`Trainer.fit` stopped",
    ):  # fmt: skip
        assert notice not in text, text
    assert "Epoch 0" in text  # the progress bar
    assert f"learned-opt-meta: 2 meta-steps; logs in {tmp_path}" in text
    assert "checkpoints/last.ckpt out.pt" in text
    assert len(text.strip().splitlines()) <= 10, text
