"""The background build: one worker thread per process, one child process per batch of builds.

The worker thread never traces or runs a kernel: a child process builds the packages
(:func:`compile_job`, at low priority) and the thread loads each as it appears. Tracing in
this process would hold the interpreter lock between the training thread's eager ops (an
eager step 10-15 times slower for as long as it took), and a kernel's first call on this
thread would give the thread an OpenMP team of its own, after which every torch op of the
training thread waits on a futex wake-up (measured: AdamW's step 5x slower). A
:class:`Recipe` says what is built and how: the step's (:mod:`.export`), or another
module's (the gossip distances').
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from .cache import host_lock, prune_packages

#: the package, whose settings (:data:`~learned_opt.kernel.CHILD_NICE`, ...) are read at each use
knobs = sys.modules[__package__]

_YIELDED: list[tuple[int, int]] = []  # (the training's thread count, the count while yielding)


def kernel_threads() -> int:
    """The thread count a kernel is built for and keyed by: the training process's own,
    also while it yields threads to a build (:data:`~learned_opt.kernel.YIELD_THREADS`)."""
    return _YIELDED[0][0] if _YIELDED else torch.get_num_threads()


def _yield_threads(building: bool) -> None:
    """On the training thread, at a step: while ``building`` set torch's thread count
    :data:`~learned_opt.kernel.YIELD_THREADS` lower, and once no build is left restore it (unless the
    program set another count meanwhile, which then stands)."""
    if building and not _YIELDED and knobs.YIELD_THREADS > 0:
        threads = torch.get_num_threads()
        if threads > 1:
            _YIELDED.append((threads, max(1, threads - knobs.YIELD_THREADS)))
            torch.set_num_threads(_YIELDED[0][1])
    elif not building and _YIELDED:
        threads, during = _YIELDED.pop()
        if torch.get_num_threads() == during:
            torch.set_num_threads(threads)


class Entry:
    """One kind of kernel of a user (an optimizer, a communicator): its compiled function
    once loaded, and when its build was queued."""

    def __init__(self):
        self.fn: Callable | None = None
        self.eager_steps = 0
        self.eager_seconds = 0.0  # what the reference has cost this kind
        self.queued = False
        self.built = False  # its package was on disk at its first step
        self.failed = False  # its kernel raised: the reference steps it for good
        self.done = threading.Event()


class _Worker:
    """The process-wide compiler: one thread finds or builds the kernels of the queued sets
    of tensors, all those queued together at once (:meth:`_build_and_load`), and exits
    once the queue is empty (a later job starts a fresh thread).

    The thread never traces or runs a kernel (see the module): a child process builds the
    packages and the thread loads them."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.child: subprocess.Popen | None = None  # see _build_in_child
        self.closed = False

    def submit(self, entry: Entry, args: tuple, recipe: Recipe | None = None) -> None:
        """Queue the kernel of ``args`` (the step's, or another ``recipe``'s) for
        ``entry``."""
        # the job holds copies (the live tensors keep changing) and only a weak reference
        # to the entry, so a dropped optimizer's compile is skipped
        recipe = recipe or _RECIPES["step"]
        copies = recipe.copy(args)
        with self.lock:
            if self.closed:  # the interpreter is exiting: the reference keeps stepping
                entry.done.set()
                return
            self.jobs.put((weakref.ref(entry), recipe, copies))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="learned-opt-compile", daemon=True
                )
                self.thread.start()

    def busy(self) -> bool:
        """Whether a build is queued or in progress (the thread is alive)."""
        return self.thread is not None

    def join_if_idle(self, timeout: float | None = None) -> None:
        """Wait for the thread to exit if no job is left (it is about to)."""
        with self.lock:
            thread = self.thread if self.jobs.empty() else None
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        """At interpreter exit: drop the queued jobs, stop the child that is building a
        package and wait for the thread."""
        with self.lock:
            self.closed = True
            while not self.jobs.empty():
                entry = self.jobs.get_nowait()[0]()
                if entry is not None:
                    entry.done.set()
            thread = self.thread
            if self.child is not None:
                self.child.kill()
        if thread is not None:
            thread.join()

    def _take(self) -> list:
        """Every job queued within :data:`~learned_opt.kernel.GATHER_SECONDS`, or ``[]`` (and the thread
        marked gone) when the queue is empty."""
        time.sleep(knobs.GATHER_SECONDS)  # the other kinds of the same step, or other optimizers
        with self.lock:
            jobs = []
            while not self.jobs.empty():
                jobs.append(self.jobs.get_nowait())
            if not jobs:
                self.thread = None
            return jobs

    def _build_in_child(
        self,
        builds: list[tuple[tuple, Path]],
        built: Callable[[int], None] = lambda i: None,
        recipe: Recipe | None = None,
    ) -> None:
        """Build the packages of ``builds`` (``(args, path)`` each, of one ``recipe``: the
        step's by default), in order, in one child process at low priority
        (:data:`~learned_opt.kernel.CHILD_NICE`; the training process keeps the cores it needs): the child
        pays torch's and the compiler's start-up once for all of them. ``built(i)`` is
        called as the package of ``builds[i]`` appears, while the child goes on with the
        next. Raises a ``RuntimeError`` that says why when a package was not built (those
        before it were).

        The child trusts the CPU's flags for inductor's vector instruction set
        (:data:`~learned_opt.kernel.ISA_ENV`) instead of having inductor compile a probe for each (9 s of a
        build on an empty cache, about 1 s on a warm one); where that child fails (a
        compiler that lacks an instruction set the CPU has), a second child that probes
        builds the packages the first left. Where :data:`~learned_opt.kernel.ISA_ENV` is set, it stands."""
        if knobs.ISA_ENV in os.environ:
            return self._run_child(builds, built, recipe, {})
        done: list[int] = []
        try:
            self._run_child(
                builds, lambda i: (done.append(i), built(i)), recipe, {knobs.ISA_ENV: "1"}
            )
        except _ChildFailed:
            if self.closed:
                raise
            first = len(done)
            self._run_child(builds[first:], lambda i: built(first + i), recipe, {})

    def _run_child(self, builds, built, recipe, extra_env: dict[str, str]) -> None:
        """:meth:`_build_in_child`'s one child, with ``extra_env`` in its environment."""
        recipe = recipe or _RECIPES["step"]
        jobs = [recipe.payload(args) | {"out": str(path)} for args, path in builds]
        job = {"builds": jobs, "recipe": recipe.name, "module": recipe.module,
               "threads": kernel_threads(), "nice": knobs.CHILD_NICE,
               "parent": os.getpid()}  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
               **extra_env}  # fmt: skip
        paths, seen = [path for _, path in builds], 0
        with tempfile.TemporaryDirectory() as folder:
            job_path, log_path = os.path.join(folder, "job.pt"), os.path.join(folder, "log")
            torch.save(job, job_path)
            with open(log_path, "wb") as log:
                with self.lock:
                    if self.closed:
                        raise RuntimeError("the interpreter is exiting")
                    try:
                        self.child = subprocess.Popen(
                            [sys.executable, "-c", knobs._CHILD, job_path], env=env,
                            stdout=subprocess.DEVNULL, stderr=log,
                        )  # fmt: skip
                    except OSError as e:
                        raise RuntimeError(f"cannot start a compile process: {e}") from None
                deadline = time.monotonic() + knobs.CHILD_COMPILE_TIMEOUT * len(builds)
                try:
                    code = None
                    while code is None and time.monotonic() < deadline:
                        code = self._wait_child(knobs.BUILT_POLL_SECONDS)
                        while seen < len(paths) and paths[seen].is_file():
                            built(seen)
                            seen += 1
                    exited = code is not None
                    if code is None:
                        code = f"timeout after {knobs.CHILD_COMPILE_TIMEOUT} s a package"
                finally:
                    self.child.kill()  # no-op once it has exited
                    self.child.wait()
                    for path in paths:
                        for partial in path.parent.glob(f".partial-{self.child.pid}-*"):
                            partial.unlink(missing_ok=True)  # what a stopped child left
                    self.child = None
            if seen < len(paths):
                with open(log_path, errors="replace") as log:
                    lines = [line.strip() for line in log if line.strip()]
                why = lines[-1] if lines else f"exit status {code}"
                failure = _ChildFailed if exited else RuntimeError
                raise failure(f"the compile process failed: {why}")

    def _wait_child(self, seconds: float):
        """The child's exit status, or None if it still runs after ``seconds``."""
        try:
            return self.child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def _run(self) -> None:
        while jobs := self._take():
            entries = [(ref(), recipe, args) for ref, recipe, args in jobs]
            entries = [job for job in entries if job[0] is not None]
            entries.sort(key=lambda job: -job[0].eager_seconds)  # the costliest kind first
            del jobs
            try:
                self._build_and_load(entries)
            finally:
                for entry, _, _ in entries:
                    entry.done.set()
                del entries

    def _build_and_load(self, entries: list) -> None:
        """Load the kernel of every ``(entry, recipe, args)``: from its package if one is
        on disk, else built first, those of one recipe in one child; a failure warns once
        per entry and leaves it the reference."""
        failed: dict[int, Exception] = {}

        def load(i: int, path: Path) -> None:
            try:
                entries[i][0].fn = entries[i][1].load(path)
            except Exception as e:  # a package that does not load: the reference steps
                failed[i] = e

        def keep_reference(ids, e: Exception) -> None:  # those not loaded already
            failed.update({i: e for i in ids if entries[i][0].fn is None and i not in failed})

        todo: dict[Path, list[int]] = {}  # a package to build, and the entries it serves
        by_recipe: dict[str, list[Path]] = {}  # the packages to build, by recipe
        try:
            with host_lock():  # one process of the host builds, the others load
                for i, (_, recipe, args) in enumerate(entries):
                    path = recipe.path(args)
                    if path.is_file():
                        load(i, path)
                        continue
                    if path not in todo:  # entries of two optimizers of one model share one
                        by_recipe.setdefault(recipe.name, []).append(path)
                    todo.setdefault(path, []).append(i)
                for paths in by_recipe.values():  # one child per recipe
                    if self.closed:
                        break
                    first = [todo[path][0] for path in paths]
                    builds = [(entries[i][2], path) for i, path in zip(first, paths)]

                    def built(k: int, paths=paths) -> None:
                        for i in todo[paths[k]]:
                            load(i, paths[k])

                    try:
                        self._build_in_child(builds, built, recipe=entries[first[0]][1])
                    except Exception as e:  # this recipe's entries keep the reference
                        keep_reference([i for path in paths for i in todo[path]], e)
                    finally:
                        prune_packages(paths[0].parent, keep=list(todo))
        except Exception as e:  # the kernel folder or its lock: every build keeps the reference
            keep_reference([i for ids in todo.values() for i in ids], e)
        if self.closed:  # cut short by the exit
            return
        for i, e in failed.items():
            warn_failed(entries[i][1], e)


def warn_failed(recipe: Recipe, e: Exception) -> None:
    """The one warning of a kernel that could not be built or loaded."""
    what, fallback = recipe.what
    warnings.warn(
        f"learned_opt: compiling {what} failed ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); {fallback} (correct, slower)",
        RuntimeWarning,
        stacklevel=1,
    )


@contextlib.contextmanager
def cpu_flags_trusted():
    """Inductor trusts the CPU's flags for its vector instruction set (:data:`~learned_opt.kernel.ISA_ENV`)
    within, unless the user set :data:`~learned_opt.kernel.ISA_ENV`. Loading a package asks inductor for the
    instruction set only to warn where it differs from the package's; probing for it
    compiles a program per instruction set (7-8 s on an empty cache) and loads each in a
    new Python process (about 1 s on a warm one). Inductor keeps the answer for the
    process."""
    from torch._inductor import config

    section, option = knobs.ISA_OPTION
    if knobs.ISA_ENV in os.environ or not hasattr(getattr(config, section, None), option):
        yield  # the user's choice, or a torch without the option: inductor decides
        return
    with config.patch({f"{section}.{option}": True}):
        yield


class _ChildFailed(RuntimeError):
    """A compile child exited with a failure before it built all its packages."""


class Recipe(NamedTuple):
    """What the compile worker builds for one kind of kernel, and how: the step's
    (:data:`~learned_opt.kernel.STEP`), or another module's (:func:`register`), whose kernels then share the
    worker, its child process, the host lock and the kernel folder.

    Each function takes the kernel's ``args`` (a tuple of the recipe's own): ``copy``
    copies the tensors to build on (the live ones keep changing); ``payload`` gives what
    the child receives (``torch.save``-able, loaded with ``weights_only``); ``build``
    runs in the child on that payload and writes the package at a path; ``path`` names
    the package (:func:`package_file`); ``load`` loads it as the kernel."""

    name: str  #: its key in the registry
    module: str  #: the module that registers it, imported by the child
    what: tuple[str, str]  #: for a failure's warning: what failed, what runs instead
    copy: Callable[[tuple], tuple]
    payload: Callable[[tuple], dict]
    build: Callable[[dict, Path], None]
    path: Callable[[tuple], Path]
    load: Callable[[Path], Callable]


_RECIPES: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Make ``recipe`` known to the compile worker's child (which imports its module)."""
    _RECIPES[recipe.name] = recipe
    return recipe


_PACKAGE = __name__.partition(".")[0]


def compile_job(path: str) -> None:
    """The child of :meth:`_Worker._build_in_child`: its recipe's ``build`` of each saved
    set of tensors in turn (a file it owns; loaded with ``weights_only``), at low priority."""
    job = torch.load(path, weights_only=True)
    if not job["module"].startswith(_PACKAGE + "."):
        raise ValueError(f"not a {_PACKAGE} module: {job['module']!r}")
    _exit_with_parent(job["parent"])
    if hasattr(os, "nice"):
        os.nice(job["nice"])
    torch.set_num_threads(job["threads"])
    importlib.import_module(job["module"])  # registers its recipe
    recipe = _RECIPES[job["recipe"]]
    for build in job["builds"]:
        recipe.build(build, Path(build["out"]))


def _exit_with_parent(parent: int, poll: float = 1.0) -> None:
    """In the child: a daemon thread that ends the process once its parent (process id
    ``parent``) is gone (a training process killed without its exit handlers), instead
    of compiling on for nobody. POSIX: on Windows a process keeps its dead parent's id,
    and the child compiles on until :data:`~learned_opt.kernel.CHILD_COMPILE_TIMEOUT`."""

    def watch():
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    threading.Thread(target=watch, name="learned-opt-parent-watch", daemon=True).start()


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> _Worker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _Worker()
            atexit.register(_WORKER.close)
        return _WORKER
