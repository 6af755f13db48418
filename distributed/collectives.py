"""Collectives and failure handling shared by the communicators over a process group.

:class:`GroupCollectives` owns the :class:`~.membership.Membership` (who is live, on which
gloo group), runs every wait with the timeout, and turns a failed wait into a re-form of
the group (``on_failure="exclude"``) or a :class:`GossipError` naming the rank that failed
(``on_failure="raise"``). Collectives (all_reduce, the layout check) are redone among the
survivors after a re-form.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from .membership import ON_FAILURE, Failure, GossipError, Membership
from .packing import Layout
from .topology import Topology

_ATTEMPTS = 3  # re-forms tried for one operation before giving up


def _seconds(timeout: float | timedelta) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


class _PeerFailure(Exception):
    """An exchange or collective failed (internal; becomes a re-form or a GossipError)."""

    def __init__(self, peer: int | None, message: str):
        super().__init__(message)
        self.peer = peer
        self.message = message


class GroupCollectives:
    """Base of :class:`~.process_group.ProcessGroupCommunicator`: membership, waits with
    timeouts, failure handling and the collectives (see that class for the arguments)."""

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None = None,
        timeout: float | timedelta = 30.0,
        *,
        on_failure: str = "exclude",
        store: dist.Store | None = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupCommunicator needs torch.distributed.init_process_group() first"
            )
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
        size = dist.get_world_size(group)
        if topology.world_size != size:
            raise ValueError(
                f"topology {topology.name!r} is built for {topology.world_size} workers but the "
                f"process group has {size}; build it with get_topology(name, {size})"
            )
        self.topology = topology
        self.group = group
        self.timeout = _seconds(timeout)
        self.on_failure = on_failure
        self.membership = Membership(topology, group, self.timeout, store)
        self.rank = self.membership.rank
        # gloo has no point-to-point calls on device tensors: those go through host memory
        self._host_p2p_only = dist.get_backend(group) == "gloo"
        self.nonfinite_excluded = 0
        self.bytes_sent = 0
        self._layouts: dict[tuple, Layout] = {}
        self._buffers: dict[tuple, tuple[Tensor, list[Tensor]]] = {}
        self._checked: set[Layout] = set()
        self._rounds: dict[int, list] = {}

    @property
    def world_size(self) -> int:
        """Number of live members (the group's size until a rank fails)."""
        return len(self.membership.members)

    @property
    def members(self) -> list[int]:
        """Ranks (of the original group) still in the gossip group."""
        return list(self.membership.members)

    @property
    def failures(self) -> list[Failure]:
        return list(self.membership.failures)

    # ------------------------------------------------------------------ failures

    def _wait(self, work, peer: int | None, what: str, step: int) -> None:
        try:
            work.wait(self.timeout)
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise _PeerFailure(peer, f"{what} failed at step {step}: {exc}") from exc

    def _failed(self, step: int, failure: _PeerFailure) -> None:
        """Agree on the survivors; raise (``on_failure="raise"``) or regroup and go on."""
        m, message = self.membership, failure.message
        for _ in range(_ATTEMPTS):
            try:
                dropped = m.reform(step, message)
            except GossipError:
                raise
            except Exception as exc:  # the store itself is gone (it lived in a dead rank)
                raise GossipError(
                    f"rank {self.rank}: {message}; the survivors could not agree on a new "
                    f"group through the rendezvous store: {exc}"
                ) from exc
            if self.on_failure == "raise":
                blame = dropped or [r for r in [failure.peer] if r is not None]
                who = f"rank {', '.join(map(str, blame))} failed" if blame else "a wait failed"
                raise GossipError(
                    f"rank {self.rank}: {who} at step {step} (timeout "
                    f"{self.timeout.total_seconds():g} s); first failure seen: "
                    f"{m.failures[-1].cause if dropped else message}"
                )
            try:
                m.regroup(self.topology)
                break
            except Exception as exc:  # a member froze while the group was being built
                message = f"building the survivors' group failed at step {step}: {exc}"
        else:
            raise GossipError(f"rank {self.rank}: gave up after {_ATTEMPTS} re-forms: {message}")
        self._buffers.clear()  # a stale receive may still point into the old buffers
        if getattr(self, "_deadline", None) is not None:
            self._deadline.reset()
        self._rounds.clear()

    def _collective(self, start: Callable, what: str, step: int, restore: Callable = None):
        """Run ``start(group)`` and wait for it, re-forming and retrying after a failure."""
        while True:
            try:
                try:
                    work = start(self.membership.group)
                except Exception as exc:
                    raise _PeerFailure(None, f"{what} failed at step {step}: {exc}") from exc
                self._wait(work, None, what, step)
                return
            except _PeerFailure as failure:
                self._failed(step, failure)
                if restore is not None:
                    restore()

    def all_reduce(self, t: Tensor, step: int, what: str = "all_reduce") -> Tensor:
        """Sum ``t`` over the live members in place, with the communicator's timeout.

        After a failure the survivors re-form and redo the sum from ``t``'s value before.
        """
        saved = t.clone() if self.on_failure == "exclude" else None
        self._collective(
            lambda g: g.allreduce([t]),
            what,
            step,
            lambda: t.copy_(saved) if saved is not None else None,
        )
        return t

    def check_layout(self, ys: list[Tensor], step: int = 0, state: int = 0) -> None:
        """Fail with a clear message unless every rank passes the same dtypes and shapes
        (``state``: the last tensors are shared optimizer state, see :meth:`_layout`)."""
        layout = self._layout(ys, state)
        mine = torch.tensor(
            [layout.fingerprint(), len(ys), sum(y.numel() for y in ys)],
            dtype=torch.int64,
            device=ys[0].device if ys else "cpu",
        )
        gathered: list[Tensor] = []

        def start(group):
            gathered[:] = [torch.zeros_like(mine) for _ in range(self.world_size)]
            return group.allgather([gathered], [mine])

        self._collective(start, "parameter layout check (all_gather)", step)
        bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
        if bad:
            desc = ", ".join(
                f"rank {self.membership.members[k]}: {int(g[1])} tensors, {int(g[2])} elements, "
                f"layout {int(g[0]):#x}"
                for k, g in enumerate(gathered)
            )
            raise ValueError(f"parameter layout differs across ranks ({desc})")
        self._checked.add(layout)

    def _layout(self, ys: list[Tensor], state: int = 0) -> Layout:
        """The packed layout of ``ys``, whose last ``state`` tensors are shared optimizer
        state (sent in :func:`~.packing.wire_dtype`)."""
        key = (tuple((y.dtype, tuple(y.shape)) for y in ys), state)
        if key not in self._layouts:
            self._layouts[key] = Layout.of(ys, state)
        return self._layouts[key]

    def consensus_distance(self, ys: list[Tensor], step: int = 0) -> Tensor:
        """``(1/N) sum_i ||x_i - x_bar||^2`` over all tensors and the N live members, with
        one float64 all_reduce. Uses ``mean_i ||x_i||^2 - ||x_bar||^2``; every rank gets the
        same value."""
        dev = ys[0].device
        flat = torch.cat([y.detach().reshape(-1).to(torch.float64) for y in ys])
        buf = torch.cat([flat, flat.square().sum().reshape(1)]).to(dev)
        self.all_reduce(buf, step, "consensus distance (all_reduce)")
        n = self.world_size
        return (buf[-1] / n - (buf[:-1] / n).square().sum()).clamp_min(0.0)
