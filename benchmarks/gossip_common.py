"""What the gossip benchmarks record about where and how they ran (one helper for all)."""

from __future__ import annotations

import datetime
import os
import platform

import torch


def gossip_run_info(command: str, load: float, when: str) -> dict:
    """``date``, ``machine`` (with the load average ``load``, measured ``when``: "at start"
    or "at the end"), ``torch`` and ``command`` of a run of local gloo worker processes."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS=1 per "
        f"worker, gloo over loopback, load average {load:.1f} {when}",
        "torch": torch.__version__,
        "command": command,
    }
