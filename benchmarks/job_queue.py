"""A process pool fed in priority order, a few jobs at a time.

``concurrent.futures`` runs jobs first in, first out, and a job submitted is a job
committed. The held-out suite adds jobs as results come in (a learning rate beyond a grid
edge) that should run before the long tail already queued, so jobs wait here, and at most
``width`` of them are in the pool at any time.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait


class JobQueue:
    """Jobs by priority (lower first, then submission order), ``width`` at a time in
    ``executor``. Without an executor nothing ever runs (jobs are only recorded)."""

    def __init__(self, executor: Executor | None, width: int = 1):
        self.executor, self.width = executor, width
        self.priority = 0
        self._waiting: list = []
        self._running: dict[Future, object] = {}
        self._seq = 0

    def submit(self, fn, *args, **kwargs) -> object:
        """Queue ``fn(*args, **kwargs)``; returns the job's ticket."""
        ticket = object()
        heapq.heappush(self._waiting, (self.priority, self._seq, ticket, fn, args, kwargs))
        self._seq += 1
        return ticket

    @contextlib.contextmanager
    def urgent(self):
        """Jobs submitted inside run before every job queued so far."""
        before, self.priority = self.priority, -1
        try:
            yield
        finally:
            self.priority = before

    def __len__(self) -> int:
        return len(self._waiting) + len(self._running)

    def wait_any(self) -> list[tuple[object, Future]]:
        """Fill the pool, wait until a job ends, and return ``(ticket, future)`` of those
        that ended."""
        if self.executor is None:
            raise RuntimeError("this queue has no executor: its jobs never run")
        while self._waiting and len(self._running) < self.width:
            _, _, ticket, fn, args, kwargs = heapq.heappop(self._waiting)
            self._running[self.executor.submit(fn, *args, **kwargs)] = ticket
        done, _ = wait(list(self._running), return_when=FIRST_COMPLETED)
        return [(self._running.pop(f), f) for f in done]


def run_jobs(owner, jobs: int, after_each: Callable[[], None] | None = None) -> None:
    """Run ``owner``'s jobs on ``jobs`` processes: ``owner.submit_all(pool)`` queues them,
    ``owner.record(pool, ticket, future)`` takes each result (and may queue more) until
    ``owner.pending`` is empty; ``after_each`` runs after every batch of results."""
    with ProcessPoolExecutor(jobs) as executor:
        pool = JobQueue(executor, jobs)
        owner.submit_all(pool)
        print(f"{len(owner.pending)} jobs on {jobs} processes", flush=True)
        while owner.pending:
            for ticket, future in pool.wait_any():
                owner.record(pool, ticket, future)
            if after_each is not None:
                after_each()
