"""What the gossip benchmarks share: how they time configurations in turns, what they record
about where and how they ran, and Decent-DP (the peer they are timed against, never a
dependency: :data:`DECENT_DP_HINT`) when it is importable."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

#: How the worker processes of a run on real ranks are set up.
GLOO = "OMP_NUM_THREADS=1 per worker, gloo over loopback"


def gossip_run_info(command: str, load: float, when: str, how: str = GLOO) -> dict:
    """``date``, ``machine`` (``how`` it ran, with the load average ``load``, measured
    ``when``: "at start" or "at the end"), ``torch`` and ``command`` of a gossip run."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {how}, load average "
        f"{load:.1f} {when}",
        "torch": torch.__version__,
        "command": command,
    }


def time_in_turns(configs: dict, train_step: Callable, rounds: int, steps: int) -> dict[str, float]:
    """This rank's milliseconds per step of each configuration ``name: (model, opt)``: the
    configurations take turns, ``steps`` calls of ``train_step(model, opt)`` each, every
    turn from a barrier; the median over rounds (round 0 warms up) of the mean step."""
    times: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(rounds + 1):
        for name, (model, opt) in configs.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                train_step(model, opt)
            if r:
                times[name].append((time.perf_counter() - start) * 1e3 / steps)
    return {name: statistics.median(ts) for name, ts in times.items()}


DECENT_DP_HINT = "pip install --no-deps --target DIR decent-dp loguru, then PYTHONPATH=DIR"


class DecentDPStep:
    """Decent-DP steps inside backward (its hooks); nothing to do in zero_grad or step."""

    def zero_grad(self):
        pass

    def step(self, loss=None):
        pass


def decent_dp(model: Callable[[], torch.nn.Module], world: int, fused: bool = False):
    """``(wrapper, None)``: Decent-DP's wrapper of ``model()`` on its ring, with Adam at lr
    1e-3 (its own example optimizer, torch's default Adam, or with ``fused`` the fused Adam
    that ``dadam`` steps with); ``(None, why)`` where it cannot run."""
    try:
        from decent_dp.ddp import DecentralizedDataParallel
        from decent_dp.optim import optim_fn_adam
    except ImportError as exc:
        return None, f"decent_dp is not importable ({exc}); {DECENT_DP_HINT}"
    if world % 2:
        return None, f"Decent-DP's ring needs an even number of ranks, got {world}"
    if fused:

        def fn(named):
            return torch.optim.Adam([p for _, p in named], lr=1e-3, fused=True)

    else:
        fn = functools.partial(optim_fn_adam, lr=1e-3, weight_decay=0.0)
    return DecentralizedDataParallel(model(), fn, topology="ring", _local_world_size=world), None
