"""``ProcessGroupCommunicator``: real neighbour exchange over ``torch.distributed``.

Each rank packs its tensors into one flat byte buffer (:mod:`.packing`) and sends it to
every neighbour whole, so the neighbour's tensors arrive exactly. Exchanges run in rounds
that are matchings of the graph (:meth:`Topology.rounds`): in a round each rank swaps
buffers with at most one peer, both directions at once, which cannot deadlock on gloo or
NCCL. Every wait has a timeout.

When a neighbour dies or times out, the survivors drop it and go on
(``on_failure="exclude"``, the default; see :mod:`.membership`), or every rank raises
:class:`GossipError` naming the rank that failed (``on_failure="raise"``).

The mixing math is :func:`~learned_opt.distributed.mixing.mix`, the same function the
simulator calls, over the same neighbour order (sorted by rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from learned_opt.config import NetConfig
from learned_opt.network import Theta

from .membership import ON_FAILURE, Failure, GossipError, Membership
from .mixing import learned_edge_weight, mix
from .packing import Layout
from .simulated import check_rule
from .topology import Topology

_DATA_TAG = 0
_ATTEMPTS = 3  # re-forms tried for one operation before giving up


def _seconds(timeout: float | timedelta) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


class _PeerFailure(Exception):
    """An exchange or collective failed (internal; becomes a re-form or a GossipError)."""

    def __init__(self, peer: int | None, message: str):
        super().__init__(message)
        self.peer = peer
        self.message = message


@dataclass(frozen=True)
class _Exchanged:
    """One exchange's neighbours and what came back, with the graph it ran on."""

    peers: list[int]
    tensors: list[list[Tensor]]
    losses: list[float]
    finite: list[bool]
    own_finite: bool
    graph: Topology  # over the indices of ``members``
    members: list[int]


class ProcessGroupCommunicator:
    """Neighbour exchange and mixing for this rank over a process group.

    Args:
        topology: the graph; its ``world_size`` must equal the group's size.
        group: the process group (default: the global one).
        timeout: seconds (or a ``timedelta``) any single wait may take; after a failure,
            also how long the survivors wait for each other to rejoin.
        on_failure: ``"exclude"`` (default): drop a neighbour that died or timed out, and
            go on with the survivors; ``"raise"``: raise :class:`GossipError` on every rank.
        store: the rendezvous store used to agree on the survivors (default: the default
            group's). Create communicators in the same order on every rank.

    Attributes ``rank`` (in ``group``), ``world_size`` (live members), ``members``,
    ``failures`` (one :class:`~learned_opt.distributed.membership.Failure` per rank
    dropped), ``nonfinite_excluded`` (neighbour tensors dropped because they held NaN/Inf)
    and ``bytes_sent`` (bytes sent by the last :meth:`mix`).
    """

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
                blame = dropped or [failure.peer]
                raise GossipError(
                    f"rank {self.rank}: rank {', '.join(map(str, blame))} failed at step {step} "
                    f"(timeout {self.timeout.total_seconds():g} s); first failure seen: "
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

    # ------------------------------------------------------------------ collectives

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _swap(self, send: Tensor, recv: Tensor, peer: int, step: int) -> None:
        """Send ``send`` to ``peer`` and receive its buffer into ``recv``, both at once."""
        what = f"exchange with neighbour rank {peer}"
        m = self.membership
        dest = None
        host_only = self._host_p2p_only or m.epoch > 0  # a re-formed group is gloo
        if send.is_cuda and host_only:  # gloo with device tensors: stage on host
            send, dest, recv = send.cpu(), recv, torch.empty(recv.shape, dtype=recv.dtype)
        try:
            if send.is_cuda:  # NCCL pairs its point-to-point calls through a batch
                ops = [
                    dist.P2POp(dist.isend, send, self._peer(peer), self.group),
                    dist.P2POp(dist.irecv, recv, self._peer(peer), self.group),
                ]
                works = dist.batch_isend_irecv(ops)
            else:  # gloo: plain send/recv (batch_isend_irecv can hang on gloo)
                works = [
                    m.group.send([send], m.local(peer), _DATA_TAG),
                    m.group.recv([recv], m.local(peer), _DATA_TAG),
                ]
        except Exception as exc:
            raise _PeerFailure(peer, f"{what} failed at step {step}: {exc}") from exc
        for work in works:
            self._wait(work, peer, what, step)
        if dest is not None:
            dest.copy_(recv)

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

    def check_layout(self, ys: list[Tensor], step: int = 0) -> None:
        """Fail with a clear message unless every rank passes the same dtypes and shapes."""
        layout = self._layout(ys)
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

    # ------------------------------------------------------------------ exchange

    def _layout(self, ys: list[Tensor]) -> Layout:
        key = tuple((y.dtype, tuple(y.shape)) for y in ys)
        if key not in self._layouts:
            self._layouts[key] = Layout.of(ys)
        return self._layouts[key]

    def _buffers_for(self, layout: Layout, device: torch.device, peers: int):
        key = (layout, str(device))
        send, recvs = self._buffers.get(key, (None, []))
        if send is None:
            send = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        while len(recvs) < peers:
            recvs.append(torch.empty(layout.nbytes, dtype=torch.uint8, device=device))
        self._buffers[key] = (send, recvs)
        return send, recvs

    def _schedule(self, graph: Topology, me: int, step: int) -> list[int]:
        """This rank's peers (indices into the members) in round order."""
        key = step % graph.period
        if key not in self._rounds:
            self._rounds[key] = graph.rounds(key)
        return [
            j if me == i else i
            for matching in self._rounds[key]
            for i, j in matching
            if me in (i, j)
        ]

    def _exchange(self, ys: list[Tensor], step: int, loss: float | None) -> _Exchanged:
        layout = self._layout(ys)
        if layout not in self._checked:
            self.check_layout(ys, step)
        m = self.membership
        graph, members = m.graph, list(m.members)
        me = members.index(self.rank)
        peers = [members[k] for k in graph.neighbors(me, step)]
        send, recvs = self._buffers_for(layout, ys[0].device, len(peers))
        own_finite = layout.pack(ys, loss, send)
        done: set[int] = set()
        if step >= m.resume_at:  # else: catching up after a failure, local steps only
            try:
                for k in self._schedule(graph, me, step):
                    slot = peers.index(members[k])
                    self._swap(send, recvs[slot], members[k], step)
                    done.add(slot)
            except _PeerFailure as failure:
                self._failed(step, failure)  # keeps what completed, or raises
        got = sorted(done)
        self.bytes_sent = layout.nbytes * len(got)
        heads = [layout.header(recvs[k]).tolist() for k in got]
        return _Exchanged(
            [peers[k] for k in got],
            [layout.unpack(recvs[k]) for k in got],
            [h[0] for h in heads],
            [h[1] == 1.0 for h in heads],
            own_finite,
            graph,
            members,
        )

    def exchange(
        self, ys: list[Tensor], step: int, loss: Tensor | float | None = None
    ) -> tuple[list[int], list[list[Tensor]], list[float], list[bool]]:
        """Swap this rank's tensors (and loss) with its neighbours at ``step``.

        Returns ``(peers, tensors, losses, finite)``, one entry per neighbour reached,
        sorted by rank; ``tensors[k]`` are views into a receive buffer, valid until the next
        call.
        """
        ex = self._exchange(ys, step, None if loss is None else float(loss))
        return ex.peers, ex.tensors, ex.losses, ex.finite

    # ------------------------------------------------------------------ mixing

    def mix(
        self,
        ys: list[Tensor],
        step: int,
        rule: str = "metropolis",
        theta: Theta | None = None,
        cfg: NetConfig | None = None,
        loss: Tensor | float | None = None,
        *,
        out: list[Tensor] | None = None,
    ) -> tuple[list[Tensor], dict]:
        """Exchange with the neighbours and mix this rank's tensors ``ys``.

        Same rules as :meth:`SimulatedCommunicator.mix`; ``loss`` is this rank's batch loss
        (``None``: absent). ``out`` (e.g. the parameters themselves, which may be ``ys``)
        receives the result in place. A neighbour whose tensors hold NaN/Inf is left out
        of this step's mix (its weight stays with self) and counted in
        ``nonfinite_excluded``; a rank whose own tensors hold NaN/Inf sends them marked as
        such and then raises :class:`GossipError`. Returns the mixed tensors and
        ``{"neighbors", "weights" (one ``[deg]`` tensor per tensor), "excluded",
        "bytes_sent"}``.
        """
        check_rule(rule, theta, cfg)
        if not ys:
            return [], {"neighbors": [], "weights": [], "excluded": [], "bytes_sent": 0}
        own_loss = None if loss is None else float(torch.as_tensor(loss).detach())
        ex = self._exchange(ys, step, own_loss)
        if not ex.own_finite:
            raise GossipError(
                f"rank {self.rank}: its own tensors hold NaN or Inf at step {step} (after its "
                "local step); its neighbours leave them out. Lower the learning rate, or check "
                "this rank's data and loss"
            )
        keep = [k for k in range(len(ex.peers)) if ex.finite[k]]
        excluded = [ex.peers[k] for k in range(len(ex.peers)) if not ex.finite[k]]
        self.nonfinite_excluded += len(excluded)
        weights = [
            self._weights(ys, t, ex, own_loss, keep, step, rule, theta, cfg) for t in range(len(ys))
        ]
        targets = out if out is not None else [None] * len(ys)
        mixed = [
            mix(y, [ex.tensors[k][t] for k in keep], w, out=o)
            for t, (y, w, o) in enumerate(zip(ys, weights, targets))
        ]
        info = {
            "neighbors": [ex.peers[k] for k in keep],
            "weights": [torch.tensor([float(x) for x in w], dtype=torch.float64) for w in weights],
            "excluded": excluded,
            "bytes_sent": self.bytes_sent,
        }
        return mixed, info

    def _weights(self, ys, t, ex: _Exchanged, own_loss, keep, step, rule, theta, cfg):
        """Weights of tensor ``t`` for the kept neighbours, ordered as ``keep``, on the graph
        the exchange ran on (both ends of an edge use the same graph, so they agree)."""
        graph, index = ex.graph, {r: k for k, r in enumerate(ex.members)}
        me = index[self.rank]
        if rule != "learned":
            return [graph.weight(me, index[ex.peers[k]], step, rule) for k in keep]
        out = []
        for k in keep:
            j = ex.peers[k]
            pair = [(self.rank, ys[t], own_loss), (j, ex.tensors[k][t], ex.losses[k])]
            (_, y_a, l_a), (_, y_b, l_b) = sorted(pair, key=lambda e: e[0])
            if l_a is None or l_b is None or l_a != l_a or l_b != l_b:
                l_a = l_b = None  # both ends see the same two losses, so they agree
            deg = max(graph.degree(me, step), graph.degree(index[j], step))
            out.append(learned_edge_weight(theta, cfg, y_a, y_b, l_a, l_b, deg, step))
        return out

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
