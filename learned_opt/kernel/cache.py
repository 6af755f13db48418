"""The kernels on disk: the folder, the package names, the host lock and pruning.

A package is code this process runs, so the folder is the user's own (:func:`kernel_dir`),
and a package's name hashes all the kernel depends on (:func:`package_file`), so that new
code or another torch never loads an old one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

#: the package, whose settings (:data:`~learned_opt.kernel.KEEP_PACKAGES`) are read at each call
knobs = sys.modules[__package__]


def package_file(key, digest: str) -> Path:
    """The package file in :func:`kernel_dir` whose name hashes ``key`` (what a kernel is
    built for), torch's version and ``digest`` (:func:`source_digest` of the code it
    runs)."""
    key = (torch.__version__, digest, key)
    return kernel_dir() / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:40]}.pt2"


@functools.cache
def source_digest(folder: Path) -> str:
    """A hash of the Python sources of ``folder`` and of its packages' (this package's, for
    the step): a kernel built by other code is not used."""
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.py")) + sorted(folder.glob("*/*.py")):
        digest.update(str(file.relative_to(folder)).encode() + file.read_bytes())
    return digest.hexdigest()


def kernel_dir() -> Path:
    """The folder of the compiled kernels, shared by this user's processes on the host:
    ``$LEARNED_OPT_KERNEL_DIR``, else ``learned_opt_kernels`` in ``$TORCHINDUCTOR_CACHE_DIR``,
    else ``learned_opt_kernels_<uid>`` in the temporary folder. Created private (``0700``);
    one owned by another user, or writable by others, is refused (``PermissionError``):
    a package there is code this process would run."""
    folder = os.environ.get(knobs.KERNEL_DIR_ENV)
    if not folder and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        folder = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "learned_opt_kernels")
    if not folder:
        user = os.getuid() if hasattr(os, "getuid") else "user"
        folder = os.path.join(tempfile.gettempdir(), f"learned_opt_kernels_{user}")
    path = Path(folder)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(path)
    return path


def check_private(path: Path) -> None:
    """Raise ``PermissionError`` unless ``path`` is this user's and not writable by others
    (POSIX; nothing is checked elsewhere)."""
    if not hasattr(os, "getuid"):
        return
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"{path} is not private to this user (owner uid {info.st_uid}, mode "
            f"{oct(info.st_mode & 0o777)}); set {knobs.KERNEL_DIR_ENV} to a folder of your own"
        )


def prune_packages(folder: Path, keep: Sequence[Path] = (), limit: int | None = None) -> list[Path]:
    """Remove the packages of ``folder`` beyond the ``limit`` (default
    :data:`~learned_opt.kernel.KEEP_PACKAGES`) most recently used (a load touches its file),
    never those in ``keep``; returns the removed paths. Each torch version and source
    revision builds packages of its own, which would otherwise pile up in the folder."""
    limit = knobs.KEEP_PACKAGES if limit is None else limit
    found = []
    for path in folder.glob("*.pt2"):
        try:
            found.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # removed meanwhile
            continue
    kept = set(keep)
    others = [path for _, path in sorted(found, reverse=True) if path not in kept]
    room = limit - (len(found) - len(others))  # the kept ones take their places
    removed = others[max(room, 0) :]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


@contextlib.contextmanager
def host_lock():
    """An exclusive lock shared by the processes of this host and user that use the same
    :func:`kernel_dir` (``fcntl``; none where that is missing): one of them builds a
    package, the others then load it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: each process compiles for itself
        yield
        return
    with open(kernel_dir() / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
