"""``ProcessGroupCommunicator``: real neighbour exchange over ``torch.distributed``.

Each rank packs its tensors into one flat byte buffer: a float64 header (the batch loss
and a finite flag) followed by one section per dtype, each tensor at a fixed offset. The
buffer goes to every neighbour whole, byte for byte, so the neighbour's tensors arrive
exactly. Exchanges run in rounds that are matchings of the graph
(:meth:`Topology.rounds`): in a round each rank swaps buffers with at most one peer, both
directions at once, which cannot deadlock on gloo or NCCL. Every wait has a timeout; a
neighbour that dies or stalls raises :class:`GossipError` naming the rank and the step.

The mixing math is :func:`~learned_opt.distributed.mixing.mix`, the same function the
simulator calls, over the same neighbour order (sorted by rank).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from learned_opt.config import NetConfig
from learned_opt.network import Theta

from .mixing import learned_edge_weight, mix
from .simulated import check_rule
from .topology import Topology

_ALIGN = 16
_HEADER = 2  # float64 slots: loss (NaN when absent), finite flag (1.0 / 0.0)


class GossipError(RuntimeError):
    """A neighbour died, timed out or disagreed; the message names the rank and the step."""


def _seconds(timeout: float | timedelta) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


@dataclass(frozen=True)
class _Layout:
    """Where each tensor lives inside the flat byte buffer."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    sections: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, byte offset, numel)
    offsets: tuple[tuple[int, int], ...]  # per tensor: (section index, element offset)
    nbytes: int

    @classmethod
    def of(cls, ys: list[Tensor]) -> _Layout:
        dtypes = tuple(dict.fromkeys(y.dtype for y in ys))
        sections, offsets, pos = [], [None] * len(ys), 8 * _HEADER
        for s, dt in enumerate(dtypes):
            numel = 0
            for k, y in enumerate(ys):
                if y.dtype == dt:
                    offsets[k] = (s, numel)
                    numel += y.numel()
            pos = -(-pos // _ALIGN) * _ALIGN
            sections.append((dt, pos, numel))
            pos += numel * dt.itemsize
        return cls(
            tuple(y.shape for y in ys),
            tuple(y.dtype for y in ys),
            tuple(sections),
            tuple(offsets),
            pos,
        )

    def describe(self) -> str:
        return f"{len(self.shapes)} tensors, {sum(n for _, _, n in self.sections)} elements"

    def fingerprint(self) -> int:
        text = repr([(str(d), tuple(s)) for d, s in zip(self.dtypes, self.shapes)])
        return zlib.crc32(text.encode())

    def header(self, buf: Tensor) -> Tensor:
        return buf[: 8 * _HEADER].view(torch.float64)

    def section(self, buf: Tensor, s: int) -> Tensor:
        dt, off, numel = self.sections[s]
        return buf[off : off + numel * dt.itemsize].view(dt)

    def unpack(self, buf: Tensor) -> list[Tensor]:
        """Views of every tensor inside ``buf`` (no copies)."""
        secs = [self.section(buf, s) for s in range(len(self.sections))]
        return [
            secs[s][o : o + shape.numel()].view(shape)
            for (s, o), shape in zip(self.offsets, self.shapes)
        ]


class ProcessGroupCommunicator:
    """Neighbour exchange and mixing for this rank over a process group.

    Args:
        topology: the graph; its ``world_size`` must equal the group's size.
        group: the process group (default: the global one).
        timeout: seconds (or a ``timedelta``) any single wait may take.

    Attributes ``rank``, ``world_size``, ``nonfinite_excluded`` (neighbour tensors dropped
    because they held NaN/Inf) and ``bytes_sent`` (bytes sent by the last :meth:`mix`).
    """

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None = None,
        timeout: float | timedelta = 30.0,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupCommunicator needs torch.distributed.init_process_group() first"
            )
        self.topology = topology
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if topology.world_size != self.world_size:
            raise ValueError(
                f"topology {topology.name!r} is built for {topology.world_size} workers but the "
                f"process group has {self.world_size}; build it with get_topology(name, "
                f"{self.world_size})"
            )
        self.timeout = _seconds(timeout)
        # gloo has no point-to-point calls on device tensors: those go through host memory
        self._host_p2p_only = dist.get_backend(group) == "gloo"
        self.nonfinite_excluded = 0
        self.bytes_sent = 0
        self._layouts: dict[tuple, _Layout] = {}
        self._buffers: dict[tuple, tuple[Tensor, list[Tensor]]] = {}
        self._checked: set[_Layout] = set()
        self._rounds: dict[int, list] = {}

    # ------------------------------------------------------------------ collectives

    def _wait(self, work, what: str, step: int) -> None:
        try:
            work.wait(self.timeout)
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise GossipError(
                f"rank {self.rank}: {what} failed at step {step} (timeout "
                f"{self.timeout.total_seconds():g} s): {exc}"
            ) from exc

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _swap(self, send: Tensor, recv: Tensor, peer: int, step: int) -> None:
        """Send ``send`` to ``peer`` and receive its buffer into ``recv``, both at once."""
        what = f"exchange with neighbour rank {peer}"
        dest = None
        if send.is_cuda and self._host_p2p_only:  # gloo with device tensors: stage on host
            send, dest, recv = send.cpu(), recv, torch.empty(recv.shape, dtype=recv.dtype)
        try:
            if send.is_cuda:  # NCCL pairs its point-to-point calls through a batch
                ops = [
                    dist.P2POp(dist.isend, send, self._peer(peer), self.group),
                    dist.P2POp(dist.irecv, recv, self._peer(peer), self.group),
                ]
                works = dist.batch_isend_irecv(ops)
            else:  # gloo: plain isend/irecv (batch_isend_irecv can hang on gloo)
                works = [
                    dist.isend(send, self._peer(peer), group=self.group),
                    dist.irecv(recv, self._peer(peer), group=self.group),
                ]
        except Exception as exc:
            raise GossipError(f"rank {self.rank}: {what} failed at step {step}: {exc}") from exc
        for work in works:
            self._wait(work, what, step)
        if dest is not None:
            dest.copy_(recv)

    def all_reduce(self, t: Tensor, step: int, what: str = "all_reduce") -> Tensor:
        """Sum ``t`` over the group in place, with the communicator's timeout."""
        self._wait(dist.all_reduce(t, group=self.group, async_op=True), what, step)
        return t

    def check_layout(self, ys: list[Tensor], step: int = 0) -> None:
        """Fail with a clear message unless every rank passes the same dtypes and shapes."""
        layout = self._layout(ys)
        mine = torch.tensor(
            [layout.fingerprint(), len(ys), sum(y.numel() for y in ys)],
            dtype=torch.int64,
            device=ys[0].device if ys else "cpu",
        )
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        self._wait(work, "parameter layout check (all_gather)", step)
        bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
        if bad:
            desc = ", ".join(
                f"rank {r}: {int(g[1])} tensors, {int(g[2])} elements, layout {int(g[0]):#x}"
                for r, g in enumerate(gathered)
            )
            raise ValueError(f"parameter layout differs across ranks ({desc})")
        self._checked.add(layout)

    # ------------------------------------------------------------------ mixing

    def _layout(self, ys: list[Tensor]) -> _Layout:
        key = tuple((y.dtype, tuple(y.shape)) for y in ys)
        if key not in self._layouts:
            self._layouts[key] = _Layout.of(ys)
        return self._layouts[key]

    def _buffers_for(self, layout: _Layout, device: torch.device, peers: int):
        key = (layout, str(device))
        send, recvs = self._buffers.get(key, (None, []))
        if send is None:
            send = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        while len(recvs) < peers:
            recvs.append(torch.empty(layout.nbytes, dtype=torch.uint8, device=device))
        self._buffers[key] = (send, recvs)
        return send, recvs

    def _pack(self, layout: _Layout, ys: list[Tensor], loss, buf: Tensor) -> None:
        finite = True
        for s, (dt, _, _) in enumerate(layout.sections):
            sec = layout.section(buf, s)
            members = [y.reshape(-1) for y, d in zip(ys, layout.dtypes) if d == dt]
            torch.cat(members, out=sec)
            if sec.is_floating_point() or sec.is_complex():
                acc = torch.float64 if dt == torch.float64 else torch.float32
                finite = finite and bool(torch.isfinite(sec.sum(dtype=acc)))
        loss = float("nan") if loss is None else float(loss)
        head = torch.tensor([loss, 1.0 if finite else 0.0], dtype=torch.float64)
        layout.header(buf).copy_(head)

    def exchange(
        self, ys: list[Tensor], step: int, loss: Tensor | float | None = None
    ) -> tuple[list[int], list[list[Tensor]], list[float], list[bool]]:
        """Swap this rank's tensors (and loss) with its neighbours at ``step``.

        Returns ``(peers, tensors, losses, finite)``, one entry per neighbour sorted by rank;
        ``tensors[k]`` are views into a receive buffer, valid until the next call.
        """
        layout = self._layout(ys)
        if layout not in self._checked:
            self.check_layout(ys, step)
        peers = self.topology.neighbors(self.rank, step)
        send, recvs = self._buffers_for(layout, ys[0].device, len(peers))
        self._pack(layout, ys, loss, send)
        slot = {p: k for k, p in enumerate(peers)}
        key = step % self.topology.period
        if key not in self._rounds:
            self._rounds[key] = self.topology.rounds(key)
        for matching in self._rounds[key]:
            for i, j in matching:
                if self.rank in (i, j):
                    peer = j if self.rank == i else i
                    self._swap(send, recvs[slot[peer]], peer, step)
        self.bytes_sent = layout.nbytes * len(peers)
        heads = [layout.header(recvs[k]).tolist() for k in range(len(peers))]
        tensors = [layout.unpack(recvs[k]) for k in range(len(peers))]
        return peers, tensors, [h[0] for h in heads], [h[1] == 1.0 for h in heads]

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
        ``nonfinite_excluded``. Returns the mixed tensors and ``{"neighbors", "weights"
        (one ``[deg]`` tensor per tensor), "excluded", "bytes_sent"}``.
        """
        check_rule(rule, theta, cfg)
        if not ys:
            return [], {"neighbors": [], "weights": [], "excluded": [], "bytes_sent": 0}
        own_loss = None if loss is None else float(torch.as_tensor(loss).detach())
        peers, tensors, losses, finite = self.exchange(ys, step, own_loss)
        keep = [k for k in range(len(peers)) if finite[k]]
        excluded = [peers[k] for k in range(len(peers)) if not finite[k]]
        self.nonfinite_excluded += len(excluded)
        weights = [
            self._weights(ys, t, peers, tensors, losses, own_loss, keep, step, rule, theta, cfg)
            for t in range(len(ys))
        ]
        targets = out if out is not None else [None] * len(ys)
        mixed = [
            mix(y, [tensors[k][t] for k in keep], w, out=o)
            for t, (y, w, o) in enumerate(zip(ys, weights, targets))
        ]
        info = {
            "neighbors": [peers[k] for k in keep],
            "weights": [torch.tensor([float(x) for x in w], dtype=torch.float64) for w in weights],
            "excluded": excluded,
            "bytes_sent": self.bytes_sent,
        }
        return mixed, info

    def _weights(self, ys, t, peers, tensors, losses, own_loss, keep, step, rule, theta, cfg):
        """Weights of tensor ``t`` for the kept neighbours, ordered as ``keep``."""
        topo, me = self.topology, self.rank
        if rule != "learned":
            return [topo.weight(me, peers[k], step, rule) for k in keep]
        out = []
        for k in keep:
            j = peers[k]
            pair = [(me, ys[t], own_loss), (j, tensors[k][t], losses[k])]
            (_, y_a, l_a), (_, y_b, l_b) = sorted(pair, key=lambda e: e[0])
            if l_a is None or l_b is None or l_a != l_a or l_b != l_b:
                l_a = l_b = None  # both ends see the same two losses, so they agree
            deg = max(topo.degree(me, step), topo.degree(j, step))
            out.append(learned_edge_weight(theta, cfg, y_a, y_b, l_a, l_b, deg, step))
        return out

    def consensus_distance(self, ys: list[Tensor], step: int = 0) -> Tensor:
        """``(1/N) sum_i ||x_i - x_bar||^2`` over all tensors, with one float64 all_reduce.

        Uses ``mean_i ||x_i||^2 - ||x_bar||^2``; every rank gets the same value.
        """
        dev = ys[0].device
        flat = torch.cat([y.detach().reshape(-1).to(torch.float64) for y in ys])
        buf = torch.cat([flat, flat.square().sum().reshape(1)]).to(dev)
        self.all_reduce(buf, step, "consensus distance (all_reduce)")
        n = self.world_size
        return (buf[-1] / n - (buf[:-1] / n).square().sum()).clamp_min(0.0)
