"""The job scheduling of the held-out suite: a process pool fed in priority order, and tuned
AdamW's grid, extended at an edge as its results come in.

``concurrent.futures`` runs jobs first in, first out, and a job submitted is a job
committed. The suite adds jobs as results come in (a learning rate beyond a grid edge) that
should run before the long tail already queued, so jobs wait here, and at most ``width`` of
them are in the pool at any time.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait

from benchmarks import heldout_single as single

#: Rates added beyond a grid edge, per horizon of a task (and seed).
MAX_EXTENSIONS = 2


class JobQueue:
    """Jobs by priority (lower first, then submission order), ``width`` at a time in
    ``executor``."""

    def __init__(self, executor: Executor, width: int = 1):
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


class AdamWGrid:
    """Tuned AdamW's grid per task and seed, over the task's horizons: ``self.cache``
    (:class:`benchmarks.common.Cache`), ``self.lrs`` and ``self.extensions`` keyed by
    ``(task, seed)``, ``self.pending`` (ticket -> ``(kind, key, task)``), and
    ``horizons(task)`` (the rows' horizons) and ``lengths(task)`` (every run length that
    may be cached) are the subclass's."""

    def adamw_key(self, task, schedule, lr, steps, seed) -> str:
        return f"single|{task}|{schedule}|{lr!r}|{steps}|{seed}"

    def adamw_runs(self, task: str, seed: int) -> dict[str, list[float]]:
        """Cached AdamW curves of ``task`` at ``seed`` on its current grid, keyed for
        :func:`~benchmarks.heldout_single.best_adamw`."""
        out = {}
        for lr in self.lrs[task, seed]:
            for schedule in single.SCHEDULES:
                for steps in self.lengths(task):
                    key = self.adamw_key(task, schedule, lr, steps, seed)
                    if key in self.cache.data:
                        out[f"{schedule}|{lr!r}|{steps}"] = self.cache.data[key]
        return out

    def submit_adamw(self, pool, task: str, lr: float, horizons: list[int], seed: int) -> None:
        """AdamW at ``lr`` and ``seed``: a cosine run at each horizon and a constant run as
        long as the longest (its prefixes serve the shorter ones), unless cached."""
        for schedule, steps in [("cosine", h) for h in horizons] + [("constant", max(horizons))]:
            key = self.adamw_key(task, schedule, lr, steps, seed)
            if key not in self.cache.data:
                f = pool.submit(single.run_job, task, None, steps, lr=lr, schedule=schedule,
                                seed=seed)  # fmt: skip
                self.pending[f] = ("adamw", key, task)

    def busy_horizons(self, task: str, seed: int) -> set[int]:
        """The horizons of the AdamW runs of ``task`` at ``seed`` still pending."""
        keys = [k.split("|") for kind, k, t in self.pending.values()
                if kind == "adamw" and t == task]  # fmt: skip
        return {int(steps) for *_, steps, s in keys if int(s) == seed}

    def maybe_extend(self, pool, task: str, seed: int) -> None:
        """Per horizon, once its grid runs at ``seed`` are in, add a rate beyond an edge that
        holds the best (at most :data:`MAX_EXTENSIONS` per length); repeats while the added
        runs are cached."""
        added = True
        while added and self.extensions[task, seed] < MAX_EXTENSIONS * len(self.lengths(task)):
            added = False
            busy = self.busy_horizons(task, seed)
            runs = self.adamw_runs(task, seed)
            lrs = self.lrs[task, seed]
            for h in self.horizons(task):
                if h in busy:
                    continue
                best = single.best_adamw({k: c for k, c in runs.items()
                                          if int(k.split("|")[2]) == h}, h)  # fmt: skip
                new = best and single.edge_extension(best, sorted(lrs))
                if new and new not in lrs:
                    lrs.add(new)
                    self.extensions[task, seed] += 1
                    added = True
                    print(f"  {task} seed {seed}: best AdamW lr {best['lr']:g} at the grid's "
                          f"edge at {h} steps; adding {new:g}", flush=True)  # fmt: skip
                    with pool.urgent():  # before the long tail already queued
                        self.submit_adamw(pool, task, new, self.horizons(task), seed)

    def grid_complete(self, task: str, h: int, seed: int) -> bool:
        """Whether every AdamW run of ``task``'s grid at horizon ``h`` and ``seed`` is in
        (and no edge extension for it is under way)."""
        if h in self.busy_horizons(task, seed):
            return False
        runs = self.adamw_runs(task, seed)
        return all(
            f"cosine|{lr!r}|{h}" in runs
            and any(k.startswith(f"constant|{lr!r}|") and int(k.split("|")[2]) >= h for k in runs)
            for lr in self.lrs[task, seed]
        )
