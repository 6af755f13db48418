"""Worker threads for the chunked fast path.

A step of the learned optimizer is a long list of small, independent chunk tasks (a few
dozen tensor ops on tens of thousands of elements each). Run one after another with
torch's intra-op threads, every op pays a thread fork/join and the tiny matrix products of
the per-element MLP barely scale. :class:`ChunkRunner` instead runs the tasks on
``workers`` Python threads that each use one intra-op thread: torch ops release the GIL,
so each core works through its own chunks with no barrier between ops. Measured on the
2-core development machine, the MLP chain runs about 3x faster this way than with two
intra-op threads.

Results come back in task order, and each task's arithmetic does not depend on which
thread ran it, so a step is deterministic (and bitwise repeatable) whatever the schedule.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def _single_threaded() -> None:
    torch.set_num_threads(1)


class ChunkRunner:
    """Maps a task function over tasks on worker threads, each with one intra-op thread.

    Args:
        workers: number of threads; ``None`` uses ``torch.get_num_threads()`` of the caller
            at each call. With one worker the tasks run in the calling thread.

    Each worker owns a ``workspace`` dict (scratch buffers reused across calls), passed as
    the task function's second argument. The threads are started on first use and are
    daemon-like: they hold no resources between calls besides their workspaces.
    """

    def __init__(self, workers: int | None = None):
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive int or None, got {workers!r}")
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._workspaces: list[dict] = [{}]

    def __getstate__(self) -> dict:  # threads do not pickle or copy; start fresh
        return {"workers": self.workers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["workers"])

    def num_workers(self) -> int:
        return self.workers if self.workers is not None else torch.get_num_threads()

    def map(self, fn: Callable[[Any, dict], Any], tasks: Sequence) -> list:
        """``[fn(task, workspace) for task in tasks]``, run on the workers; in task order.
        Tasks run in the caller's grad mode. An exception in any task is raised here once
        all workers stopped."""
        n = min(self.num_workers(), len(tasks))
        if n <= 1:
            return [fn(task, self._workspaces[0]) for task in tasks]
        pool = self._ensure_pool(n)
        results: list = [None] * len(tasks)
        pending = iter(range(len(tasks)))
        lock, failed = threading.Lock(), threading.Event()
        grad_mode = torch.is_grad_enabled()  # thread-local: hand it to the workers

        @torch.set_grad_enabled(grad_mode)
        def work(workspace: dict) -> None:
            while not failed.is_set():
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                try:
                    results[i] = fn(tasks[i], workspace)
                except BaseException:
                    failed.set()
                    raise

        futures = [pool.submit(work, self._workspaces[j]) for j in range(n)]
        for f in futures:
            f.exception()  # wait for all before raising
        for f in futures:
            f.result()
        return results

    def _ensure_pool(self, n: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_size < n:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            caller_threads = torch.get_num_threads()
            self._pool = ThreadPoolExecutor(n, "learned-opt", initializer=_single_threaded)
            self._pool_size = n
            self._workspaces += [{} for _ in range(n - len(self._workspaces))]
            # start every thread now, then undo the process-wide default their
            # set_num_threads(1) wrote, so threads the user starts later are unaffected
            barrier = threading.Barrier(n)
            for f in [self._pool.submit(barrier.wait) for _ in range(n)]:
                f.result()
            torch.set_num_threads(caller_threads)
        return self._pool

    def close(self) -> None:
        """Stop the worker threads (they are restarted on the next :meth:`map`)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._pool_size = None, 0


#: Runs tasks one after another in the calling thread.
SERIAL = ChunkRunner(workers=1)
