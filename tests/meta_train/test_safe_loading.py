"""No loader of the project runs code from a file.

A pickle whose ``__reduce__`` calls ``os.system`` (raw, and inside a torch zip) is refused
by every way a file gets loaded: ``LearnedOptimizer(checkpoint=...)``, ``learned-opt
export``, the ``--ckpt_path`` resume of ``learned-opt-meta fit``, and ``learned-opt
inspect``; the marker file its command would create never appears, and no error advises
loading the file unsafely. An audit checks every ``torch.load`` call in the repository.
"""

from __future__ import annotations

import ast
import os
import pickle
import shlex
import zipfile
from pathlib import Path

import pytest
import torch

from learned_opt import LearnedOptimizer, load_checkpoint
from learned_opt.checkpoint import CheckpointError
from learned_opt.cli import main as learned_opt_main
from learned_opt.meta_train.cli import export, inspect, meta_cli_main
from learned_opt.meta_train.meta_cli import CONFIG_DIR

REPO = Path(__file__).resolve().parents[2]


class RunsCode:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _unpickle_unsafely(path: Path) -> None:
    """Unpickle ``path`` with plain ``pickle`` (what an unsafe loader does)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            data = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    else:
        data = path.read_bytes()
    pickle.loads(data)


@pytest.fixture(params=["raw_pickle_protocol_2", "raw_pickle_protocol_5", "torch_zip"])
def payload(request, tmp_path) -> tuple[Path, Path]:
    """``(file, marker)``: a checkpoint-shaped file whose unpickling creates ``marker``.

    torch's weights-only reader stops a protocol-5 pickle at its first frame, and the others
    at the ``os.system`` global."""
    marker = tmp_path / "marker"
    content = {
        "format": "learned-opt/1",
        "config": {},
        "theta": {},
        "state_dict": {},
        "card": {"x": RunsCode(marker)},
    }
    path = tmp_path / "payload.ckpt"
    if request.param.startswith("raw_pickle"):
        path.write_bytes(pickle.dumps(content, protocol=int(request.param[-1])))
    else:
        torch.save(content, path)
    return path, marker


def _refused(message: str) -> None:
    assert "cannot be read" in message, message
    assert ("refused" in message and "posix.system" in message) or "not a torch file" in message
    assert "weights_only" not in message, "never advise loading a file unsafely"


def test_the_payload_runs_code_when_unpickled_unsafely(payload):
    path, marker = payload
    _unpickle_unsafely(path)
    assert marker.exists(), "the payload must be real for the tests below to mean anything"


def test_learned_optimizer_and_load_checkpoint_refuse(payload):
    path, marker = payload
    for load in (
        lambda: LearnedOptimizer([torch.zeros(3, requires_grad=True)], checkpoint=str(path)),
        lambda: load_checkpoint(path),
    ):
        with pytest.raises(CheckpointError) as info:
            load()
        _refused(str(info.value))
    assert not marker.exists()


def test_export_refuses(payload, tmp_path, capsys):
    path, marker = payload
    with pytest.raises(CheckpointError) as info:
        export(str(path), str(tmp_path / "out.pt"), validate=False)
    _refused(str(info.value))
    assert learned_opt_main(["export", str(path), str(tmp_path / "out.pt")]) == 2
    _refused(capsys.readouterr().err)
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_inspect_refuses(payload, tmp_path, capsys):
    path, marker = payload
    with pytest.raises(CheckpointError) as info:
        inspect(str(path), str(tmp_path / "tb"))
    _refused(str(info.value))
    assert learned_opt_main(["inspect", str(path), "--logdir", str(tmp_path / "tb")]) == 2
    _refused(capsys.readouterr().err)
    assert not marker.exists()


def test_meta_fit_resume_refuses(payload, tmp_path, capsys):
    path, marker = payload
    args = [
        "fit", "--config", str(CONFIG_DIR / "smoke.yaml"),
        f"--trainer.default_root_dir={tmp_path / 'run'}", f"--ckpt_path={path}",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        meta_cli_main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    _refused(err)
    assert err.strip().splitlines()[-1].startswith("learned-opt-meta: error: "), err
    assert "Traceback" not in err
    assert not marker.exists()
    assert not (tmp_path / "run").exists(), "refused before any training started"


def test_meta_fit_refuses_weights_only_false(tmp_path, capsys):
    args = [
        "fit", "--config", str(CONFIG_DIR / "smoke.yaml"),
        f"--trainer.default_root_dir={tmp_path}", "--weights_only=false",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        meta_cli_main(args)
    assert info.value.code == 2
    assert "--weights_only false is not supported" in capsys.readouterr().err


def _torch_load_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            yield node


def test_every_torch_load_in_the_repository_is_weights_only():
    checked = 0
    sources = [REPO / d for d in ("learned_opt", "meta_train", "distributed", "tasks")]
    sources += [REPO / d for d in ("benchmarks", "tests", "checkpoints")]
    for path in (p for d in sources for p in d.rglob("*.py")):
        for call in _torch_load_calls(ast.parse(path.read_text(), str(path))):
            flag = {k.arg: k.value for k in call.keywords}.get("weights_only")
            where = f"{path.relative_to(REPO)}:{call.lineno}"
            assert isinstance(flag, ast.Constant) and flag.value is True, where
            checked += 1
    assert checked >= 2, "the audit must find the project's loaders"


def test_resume_check_passes_lightning_names_and_refuses_missing_files(tmp_path):
    from learned_opt.meta_train.meta_cli import UsageError, check_resume_checkpoint

    for name in ("last", "best", None):
        check_resume_checkpoint(name, None)
    with pytest.raises(UsageError, match="no such checkpoint file"):
        check_resume_checkpoint(str(tmp_path / "missing.ckpt"), True)
