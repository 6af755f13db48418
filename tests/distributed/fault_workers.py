"""Worker functions for the failure tests: ranks that die or freeze in the middle of a run.

A frozen rank stops itself with SIGSTOP; a small shell process it starts first wakes it
(SIGCONT) long after the survivors have excluded it, so it can report what it found.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import torch

from learned_opt.distributed import GossipError, GossipOptimizer


def freeze(seconds: float) -> None:
    """Stop this process now; it resumes after ``seconds``."""
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def kill_then_freeze(rank: int, n: int, timeout: float, steps: int) -> dict:
    """Ring of 4, pure mixing (SGD with lr 0): rank 3 dies at step 5, rank 1 freezes at
    step 12. Returns the survivors' per-step values, members and failures."""
    params = [torch.full((50,), float(rank), requires_grad=True)]
    opt = GossipOptimizer(
        torch.optim.SGD(params, lr=0.0), "ring", "metropolis", timeout=timeout, metrics_every=4
    )
    values = []
    for step in range(steps):
        if rank == 3 and step == 5:
            os._exit(1)
        if rank == 1 and step == 12:
            freeze(3.5 * timeout)
        try:
            opt.step()
        except GossipError as exc:
            return {"error": str(exc), "step": step}
        values.append(params[0].detach().clone())
    comm = opt.communicator
    return {
        "values": torch.stack(values),
        "members": comm.members,
        "failures": [f.as_dict() for f in opt.failures],
        "metrics": dict(opt.metrics),
        "resume_at": comm.membership.resume_at,
    }


def frozen_with_raise(rank: int, n: int, timeout: float) -> str:
    """Ring of 4 with ``on_failure="raise"``: rank 2 freezes at step 4, the others must
    blame rank 2 (not a rank that already stopped)."""
    params = [torch.full((50,), float(rank), requires_grad=True)]
    opt = GossipOptimizer(
        torch.optim.SGD(params, lr=0.0), "ring", "metropolis", timeout=timeout, on_failure="raise"
    )
    for step in range(20):
        if rank == 2 and step == 4:
            freeze(3.5 * timeout)
        opt.step()
    return "finished"


def _pure_mixing(rank: int, size: int, topology: str, timeout: float, deadline: float):
    """A parameter of ``size`` elements all equal to ``rank`` and a gossip optimizer that
    only mixes it (SGD at lr 0), with ``step_deadline``."""
    params = [torch.full((size,), float(rank), requires_grad=True)]
    sgd = torch.optim.SGD(params, lr=0.0)
    opt = GossipOptimizer(
        sgd, topology, "metropolis", timeout=timeout, step_deadline=deadline, metrics_every=0
    )
    return params, opt


def straggler(
    rank: int, n: int, timeout: float, deadline: float, steps: int, kill: bool = False
) -> dict:
    """Ring of 4, pure mixing with ``step_deadline``, every step paced at ``deadline / 5``:
    rank 2 sleeps ``3 * deadline`` before step 5 (with ``kill``: rank 3 dies at step 12 as
    well). Returns per-step values, the neighbours skipped at each step and the values
    after ``flush``."""
    params, opt = _pure_mixing(rank, 50, "ring", timeout, deadline)
    values, skipped = [], []
    for step in range(steps):
        time.sleep(deadline / 5)
        if rank == 2 and step == 5:
            time.sleep(3 * deadline)
        if kill and rank == 3 and step == 12:
            os._exit(1)
        opt.step()
        values.append(params[0].detach().clone())
        skipped.append(opt.communicator.skipped)
    opt.flush()
    comm = opt.communicator
    return {
        "values": torch.stack(values),
        "final": params[0].detach().clone(),
        "skipped": skipped,
        "members": comm.members,
        "failures": [f.as_dict() for f in opt.failures],
        "skipped_total": comm.skipped_total,
        "late_total": comm.late_total,
        "metric": opt.metrics["gossip/skipped_edges"],
    }


def slow_rank_time_varying(rank: int, n: int, timeout: float, steps: int) -> dict:
    """One-peer ring (a neighbour per step, alternating), pure mixing with a short
    ``step_deadline``: rank 2 takes 10x as long per step as the others. Returns the
    parameters after ``flush`` and the exchanges mixed late."""
    params, opt = _pure_mixing(rank, 20, "one_peer_ring", timeout, 0.01)
    for _ in range(steps):
        time.sleep(0.05 if rank == 2 else 0.005)
        opt.step()
    opt.flush()
    return {"final": params[0].detach().clone(), "late": opt.communicator.late_total}
