"""Checkpoint I/O for learned optimizers: one file, loaded with ``weights_only=True``.

A checkpoint is a plain dict::

    {"format": "learned-opt/1", "config": NetConfig.to_dict(), "mixing": MixingConfig.to_dict(),
     "theta": state_dict, "card": {...}}

``config`` is the update rule and ``mixing`` the mixing head with the rule's bounds under
gossip. Files written before the two were split have no ``mixing``: its fields sit in
``config``, and they load the same.

It holds theta, never per-parameter optimizer state. Every way a file can be wrong raises
:class:`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from importlib import resources
from pathlib import Path

import torch

from .config import split_config
from .network import LearnedOptimizerNet

FORMAT_VERSION = "learned-opt/1"
#: The shipped checkpoint: what a ``LearnedOptimizer`` built without a checkpoint steps
#: with, alone and under gossip, and what the torchrun entry and the Lightning strategy
#: load. One local rule serves both: on the decentralized validation settings it beat the
#: meta-trained gossip rule ``gossip_adapt`` on every criterion (see the results page).
DEFAULT_CHECKPOINT = "adapt_init_2x"
_PACKAGE = "learned_opt.checkpoints"


class CheckpointError(ValueError):
    """A learned-optimizer checkpoint is missing, unreadable or inconsistent."""


def _load_problem(exc: BaseException) -> str:
    """What went wrong reading a torch file, in words; never torch's advice to load the
    file unsafely."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError):
        unsafe = re.search(r"GLOBAL ([\w.]+)", text)
        if unsafe:
            return (
                f"refused: it asks to build the Python object {unsafe.group(1)}, and loading "
                "it could run code; only tensors and plain data (dicts, lists, numbers, "
                "strings) are read"
            )
        return "not a torch file of tensors and plain data (random bytes, a raw pickle, or corrupt)"
    if isinstance(exc, EOFError):
        return "empty or truncated"
    first = text.split(". ")[0].strip() or type(exc).__name__
    if "weights_only" in first:
        first = type(exc).__name__
    return f"truncated, corrupt or not a torch file ({first})"


def _truncated_zip(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts as a zip archive (torch's format) but lacks the
    record every zip archive ends with: the file was cut short."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" and not zipfile.is_zipfile(path)


def read_torch_file(path: str | os.PathLike, what: str = "a checkpoint"):
    """``torch.load(path, weights_only=True)`` onto the CPU, so reading can never run code.

    Any failure raises :class:`CheckpointError` naming the file and, in plain words, the
    problem (``what`` names what the file should have been).
    """
    try:
        with warnings.catch_warnings():  # the reader's own note on an unusual pickle protocol
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, random bytes, pickled code, a folder, ...
        if _truncated_zip(path):
            problem = "truncated: the file ends before its zip archive does (a partial copy?)"
        elif isinstance(exc, OSError):
            problem = f"cannot be opened ({type(exc).__name__}: {exc.strerror or exc})"
        else:
            problem = _load_problem(exc)
        # Not chained: torch's message advises loading the file unsafely.
        raise CheckpointError(f"{path}: cannot be read as {what}: {problem}") from None


def _shipped_dir() -> Path:
    return Path(str(resources.files(_PACKAGE)))


def list_pretrained() -> list[str]:
    """Names of the shipped pretrained optimizers, the default first."""
    names = sorted(p.stem for p in _shipped_dir().glob("*.pt"))
    if DEFAULT_CHECKPOINT in names:
        names.remove(DEFAULT_CHECKPOINT)
        names.insert(0, DEFAULT_CHECKPOINT)
    return names


def is_explicit_path(name_or_path: str | os.PathLike) -> bool:
    """Whether an argument names a file rather than a shipped item: a ``Path``, or a
    string with a directory separator, a leading ``.`` or a suffix (``./default``,
    ``runs/opt.pt``, ``opt.pt``). A bare word such as ``default`` is a name."""
    if not isinstance(name_or_path, str):
        return True
    return (
        "/" in name_or_path
        or os.sep in name_or_path
        or name_or_path.startswith(".")
        or bool(Path(name_or_path).suffix)
    )


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """The file of a shipped name (``"default"``) or of a path.

    A shipped name wins over a file or folder of the same name in the working directory;
    write ``./default`` to mean that file. A bare word that is not shipped is read as a
    path."""
    if not is_explicit_path(name_or_path):
        shipped = _shipped_dir() / f"{name_or_path}.pt"
        if shipped.is_file():
            return shipped
    path = Path(name_or_path)
    if path.is_file():
        return path
    problem = "is a directory, not a checkpoint file" if path.is_dir() else "no such file"
    raise CheckpointError(
        f"{name_or_path}: {problem}, and not a shipped checkpoint; shipped: {list_pretrained()}"
    )


def save_checkpoint(
    net: LearnedOptimizerNet, path: str | os.PathLike, card: dict | None = None
) -> Path:
    """Write ``net`` (theta and config) and its ``card`` to ``path`` atomically."""
    path = Path(path)
    payload = {
        "format": FORMAT_VERSION,
        "config": net.config.to_dict(),
        "mixing": net.mixing.to_dict(),
        "theta": {k: v.detach().cpu().clone() for k, v in net.state_dict().items()},
        "card": dict(card or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(name_or_path: str | os.PathLike) -> tuple[LearnedOptimizerNet, dict]:
    """Load ``(net, card)`` from a shipped name or a file path; raises :class:`CheckpointError`."""
    path = resolve_checkpoint(name_or_path)
    payload = read_torch_file(path, "a learned-opt checkpoint")
    if not isinstance(payload, dict) or not {"format", "config", "theta"} <= set(payload):
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{path}: not a learned-opt checkpoint (expected keys format, config, theta, "
            f"card; found {keys})"
        )
    if payload["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {payload['format']!r} is not supported "
            f"(this version of learned-opt reads {FORMAT_VERSION!r})"
        )
    if not isinstance(payload["config"], dict):
        raise CheckpointError(
            f"{path}: invalid network config: expected a dict, found "
            f"{type(payload['config']).__name__}"
        )
    mixing = payload.get("mixing", {})  # checkpoints before the split: inside config
    if not isinstance(mixing, dict):
        raise CheckpointError(
            f"{path}: invalid mixing config: expected a dict, found {type(mixing).__name__}"
        )
    try:
        net = LearnedOptimizerNet(*split_config(payload["config"], mixing))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: invalid network config: {exc}") from exc
    expected = net.state_dict()
    theta = payload["theta"]
    if not isinstance(theta, dict) or set(theta) != set(expected):
        found = sorted(theta) if isinstance(theta, dict) else type(theta).__name__
        raise CheckpointError(
            f"{path}: theta keys do not match the network: expected {sorted(expected)}, "
            f"found {found}"
        )
    for key, ref in expected.items():
        if not isinstance(theta[key], torch.Tensor) or theta[key].shape != ref.shape:
            value = theta[key]
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(
                f"{path}: shape mismatch for theta[{key!r}]: checkpoint has {got}, "
                f"config expects {tuple(ref.shape)}"
            )
        if not torch.isfinite(theta[key]).all():
            raise CheckpointError(f"{path}: theta[{key!r}] holds NaN or Inf")
    net.load_state_dict(theta)
    card = payload.get("card") or {}
    if not isinstance(card, dict):
        raise CheckpointError(f"{path}: the card must be a dict, found {type(card).__name__}")
    return net, dict(card)
