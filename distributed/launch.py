"""``launch_local``: start N local workers without torchrun (tests, demo, benchmarks).

The parent process hosts a ``TCPStore`` on 127.0.0.1 with a free port (port 0), spawns
``world_size`` processes with ``torch.multiprocessing`` and collects each rank's return
value. Workers run with ``OMP_NUM_THREADS=1``. A worker that raises, dies, or outlives the
timeout never hangs the parent: it is reported (and the stragglers are terminated).
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"


@dataclass
class RankFailure:
    """What a rank left behind when it did not return normally."""

    rank: int
    message: str


class LaunchError(RuntimeError):
    """One or more ranks failed; ``failures`` holds a :class:`RankFailure` per rank."""

    def __init__(self, failures: list[RankFailure]):
        self.failures = failures
        lines = [f"rank {f.rank}: {f.message.strip().splitlines()[-1]}" for f in failures]
        super().__init__("local workers failed:\n  " + "\n  ".join(lines))


def _worker(rank, world_size, port, backend, pg_timeout, fn, args, results):
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
    )
    try:
        timeout = timedelta(seconds=pg_timeout)
        store = dist.TCPStore(_HOST, port, None, is_master=False, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        out = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch_local(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 60.0,
    pg_timeout: float = 10.0,
    backend: str = "gloo",
    raise_on_error: bool = True,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh local processes.

    ``fn`` must be importable (a module-level function). Each worker joins a process group
    (``backend``, default gloo; ``pg_timeout`` seconds) before calling ``fn``. Returns the
    per-rank return values in rank order. A rank that raises, dies or is still running
    after ``timeout`` seconds becomes a :class:`RankFailure`; with ``raise_on_error`` (the
    default) any failure raises :class:`LaunchError` instead.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(_HOST, 0, None, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned interpreters
    try:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store.port, backend, pg_timeout, fn, args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp
    outcomes: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.1)
            outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
        except queue.Empty:
            pass
        for r, p in enumerate(procs):  # a rank that died without reporting
            if r not in outcomes and p.exitcode is not None:
                first = dead_since.setdefault(r, time.monotonic())
                if time.monotonic() - first > 1.0:  # let a last message drain first
                    outcomes[r] = (False, f"process exited with code {p.exitcode} (no result)")
    for r in range(world_size):
        if r not in outcomes:
            outcomes[r] = (False, f"still running after the {timeout:g} s launch timeout")
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
    del store
    failures = [RankFailure(r, str(v)) for r, (ok, v) in sorted(outcomes.items()) if not ok]
    if failures and raise_on_error:
        raise LaunchError(failures)
    return [v if ok else RankFailure(r, str(v)) for r, (ok, v) in sorted(outcomes.items())]
