"""Worker threads for the chunked fast path.

A step of the learned optimizer is a long list of small, independent chunk tasks (a few
dozen tensor ops on tens of thousands of elements each). Run one after another with
torch's intra-op threads, every op pays a thread fork/join and the tiny matrix products of
the per-element MLP barely scale. :class:`ChunkRunner` instead runs the tasks on
``workers`` Python threads that each use one intra-op thread: torch ops release the GIL,
so each core works through its own chunks with no barrier between ops. Measured on the
2-core development machine, the MLP chain runs about 3x faster this way than with two
intra-op threads.

The threads live only for one :meth:`ChunkRunner.map` (starting them costs about 0.1 ms
each). Threads that stay alive after running torch ops make the OpenMP runtime stop
busy-waiting in the caller's parallel regions, which measured 2x slower for a
small-op-heavy workload (``torch.optim.AdamW`` with ``foreach=False``) in the same process.

Results come back in task order, and each task's arithmetic does not depend on which
thread ran it, so a step is deterministic (and bitwise repeatable) whatever the schedule.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Fewer tasks than this per map run in the calling thread: the work does not pay for
#: starting threads (about 0.1 ms each).
MIN_THREADED_TASKS = 4


#: Where Linux counts the threads runnable right now (the ``procs_running`` line), and
#: where it lists this process's threads with their states.
PROC_STAT, OWN_TASKS = "/proc/stat", "/proc/self/task"


def runnable_threads(path: str = PROC_STAT) -> int | None:
    """The number of threads on the machine runnable at this instant (running or waiting
    for a core; the caller's own included), or None where the system does not say."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def own_runnable_threads(tasks: str = OWN_TASKS) -> int:
    """How many of this process's threads are runnable at this instant (at least the
    caller): an OpenMP team that just finished a parallel region busy-waits for a while,
    and is not another process's load."""
    count = 0
    try:
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
            count += state == b"R"
    except OSError:
        pass
    return max(count, 1)


def machine_is_free(threads: int) -> bool:
    """Whether ``threads`` threads would find free cores. Both must leave room for them:
    the 1-minute load average (which counts this process), and the other processes'
    threads runnable at this instant (:func:`runnable_threads` less
    :func:`own_runnable_threads`; the load average lags a minute behind processes that
    just started). On a busy machine a thread that waits for a core another process holds
    stalls the whole step."""
    if threads < 2:
        return False
    cores = os.cpu_count() or 1
    try:
        if os.getloadavg()[0] > cores + 0.5:
            return False
    except OSError:  # no load average on this platform
        return False
    now = runnable_threads()
    return now is None or max(now - own_runnable_threads(), 0) + threads <= cores


def worth_threads(runner: ChunkRunner, tasks: int) -> bool:
    """Whether ``tasks`` chunk tasks should run on ``runner``'s threads (enough work, and
    free cores) rather than in the calling thread."""
    n = runner.num_workers()
    return n > 1 and tasks >= MIN_THREADED_TASKS and machine_is_free(n)


class ChunkRunner:
    """Maps a task function over tasks on worker threads, each with one intra-op thread.

    Args:
        workers: number of threads; ``None`` uses ``torch.get_num_threads()`` of the caller
            at each call. With one worker the tasks run in the calling thread.

    Each worker owns a ``workspace`` dict (scratch buffers kept across calls), passed as the
    task function's second argument.
    """

    def __init__(self, workers: int | None = None):
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive int or None, got {workers!r}")
        self.workers = workers
        self._workspaces: list[dict] = [{}]

    def num_workers(self) -> int:
        return self.workers if self.workers is not None else torch.get_num_threads()

    def map(self, fn: Callable[[Any, dict], Any], tasks: Sequence) -> list:
        """``[fn(task, workspace) for task in tasks]``, run on the workers; in task order.
        Tasks run in the caller's grad mode. An exception in any task is raised here once
        all workers stopped."""
        n = min(self.num_workers(), len(tasks))
        if n <= 1:
            return [fn(task, self._workspaces[0]) for task in tasks]
        self._workspaces += [{} for _ in range(n - len(self._workspaces))]
        results: list = [None] * len(tasks)
        errors: list[BaseException] = []
        pending = iter(range(len(tasks)))
        lock = threading.Lock()
        grad_mode = torch.is_grad_enabled()  # thread-local: hand it to the workers
        caller_threads = torch.get_num_threads()

        def work(workspace: dict) -> None:
            torch.set_num_threads(1)
            with torch.set_grad_enabled(grad_mode):
                while not errors:
                    with lock:
                        i = next(pending, None)
                    if i is None:
                        return
                    try:
                        results[i] = fn(tasks[i], workspace)
                    except BaseException as e:  # re-raised in the caller
                        errors.append(e)

        threads = [
            threading.Thread(target=work, args=(self._workspaces[j],), name=f"learned-opt-{j}")
            for j in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # set_num_threads(1) in the workers also wrote torch's process-wide default; put
        # back the caller's, so threads the user starts later are unaffected
        torch.set_num_threads(caller_threads)
        if errors:
            raise errors[0]
        return results


#: Runs tasks one after another in the calling thread.
SERIAL = ChunkRunner(workers=1)
