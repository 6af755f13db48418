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

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from learned_opt.config import NetConfig
from learned_opt.network import Theta

from .collectives import GroupCollectives, _PeerFailure
from .compression import ErrorFeedback
from .deadline import DeadlineExchange, _Failed
from .distance_kernel import Distances
from .membership import GossipError
from .mixing import (
    check_rule,
    learned_edge_weight,
    mix,
    parse_robust,
    robust_weight_lists,
    tensor_rules,
)
from .packing import Layout
from .topology import Topology

_DATA_TAG = 0


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
    # step_deadline: the step each exchange was posted at, and for one posted before this
    # step the tensors this rank sent in it (None: sent now); see :mod:`.deadline`
    steps: list[int] | None = None
    sent: list[list[Tensor] | None] | None = None


@dataclass
class Inflight:
    """An exchange that :meth:`ProcessGroupCommunicator.begin` started; hand it to
    :meth:`~ProcessGroupCommunicator.finish_mix`."""

    step: int
    epoch: int  # the group it was posted on
    loss: float | None
    layout: Layout
    own_finite: bool
    graph: Topology
    members: list[int]
    peers: list[int]  # neighbours at this step, sorted
    recvs: list[Tensor]
    pending: list = field(default_factory=list)  # (slot, works, device buffer or None)
    done: set = field(default_factory=set)  # slots received
    failure: _PeerFailure | None = None
    full: bool = True  # compression: the tensors went whole (the copies start)


class ProcessGroupCommunicator(GroupCollectives):
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
        compression: ``None`` (exact exchange), ``"topk:R"``, ``"sign"`` or ``"int8"``: send
            compressed differences with error feedback; the average stays exact (see
            :mod:`.compression`).
        consensus_step: ``gamma`` of the compressed mix, in (0, 1] (only with compression;
            default: :func:`~.compression.default_consensus_step`, stable for the compressor).
        drift_correction: ``beta``, the integral step of the compressed mix's drift
            correction, in [0, ``consensus_step``]; 0 turns it off (only with compression;
            default: :func:`~.compression.default_drift_correction`, ``R / 20`` for top-k).
        step_deadline: seconds a step waits for a neighbour's tensors (``None``: up to
            ``timeout``). An exchange that missed it is mixed at the step it arrives, by
            the difference it carries (the average stays exact), and a neighbour that
            stays slow is mixed at its own pace. CPU tensors over gloo, one layout for
            every exchange, without compression (see :mod:`.deadline`).
        robust: ``None`` (plain mixing) or ``"clip"`` / ``"clip:C"``: clip what each
            neighbour sends to ``C`` times the closest neighbour's distance, so one bad
            neighbour moves this rank by a bounded step (see :mod:`.mixing`).

    Attributes ``rank`` (in ``group``), ``world_size`` (live members), ``members``,
    ``failures`` (one :class:`~learned_opt.distributed.membership.Failure` per rank
    dropped), ``nonfinite_excluded`` (neighbour tensors dropped because they held NaN/Inf),
    ``bytes_sent`` (bytes sent by the last :meth:`mix`), ``drift_correction`` (the ``beta`` in
    use, ``None`` without compression) and, with ``step_deadline``,
    ``skipped`` (this step's neighbours not mixed at it), ``skipped_total`` and
    ``late_total`` (exchanges mixed at a later step than they were posted).
    """

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None = None,
        timeout: float | timedelta = 30.0,
        *,
        on_failure: str = "exclude",
        store: dist.Store | None = None,
        compression: str | None = None,
        consensus_step: float | None = None,
        drift_correction: float | None = None,
        step_deadline: float | None = None,
        robust: str | None = None,
    ):
        clip = parse_robust(robust)
        super().__init__(topology, group, timeout, on_failure=on_failure, store=store)
        self.robust, self._clip = robust, clip
        #: the robust mix's distances, compiled once they have cost enough (see
        #: :mod:`.distance_kernel`); ``distances.wait()`` blocks until they are
        self.distances = Distances() if clip is not None else None
        self.compression = compression
        self._codec = None
        if compression:
            self._codec = ErrorFeedback(compression, consensus_step, drift_correction)
        self.drift_correction = self._codec.beta if self._codec is not None else None
        self.step_deadline = step_deadline
        self._deadline = None
        if step_deadline is not None:
            if compression is not None:
                raise ValueError(
                    "step_deadline and compression do not go together: a skipped step would "
                    "leave the public copies different on the two ends of an edge"
                )
            if not self._host_p2p_only:
                raise ValueError("step_deadline needs the gloo backend (CPU tensors)")
            self._deadline = DeadlineExchange(step_deadline, self.timeout)
        self._draining = False
        self._layout_sent = None  # step_deadline: the layout of every exchange

    @property
    def skipped(self) -> list[int]:
        """The last step's neighbours whose exchange was not mixed at it (in flight)."""
        return list(self._deadline.skipped) if self._deadline is not None else []

    @property
    def skipped_total(self) -> int:
        """Neighbours not mixed at their step, summed over steps, counted on this rank."""
        return self._deadline.skipped_total if self._deadline is not None else 0

    @property
    def late_total(self) -> int:
        """Exchanges mixed at a later step than they were posted, counted on this rank."""
        return self._deadline.late_total if self._deadline is not None else 0

    def drain(self) -> bool:
        """``step_deadline``: end every exchange in flight (see
        :meth:`.deadline.DeadlineExchange.drain`; every rank calls it, e.g. through
        ``GossipOptimizer.flush``); returns whether arrived exchanges are left, which the
        next :meth:`mix` mixes without posting new ones. ``False`` without a deadline."""
        if self._deadline is None or self._layout_sent is None:
            return False
        m = self.membership
        me = list(m.members).index(self.rank)
        peers = {
            m.members[k] for s in range(m.graph.period) for k in m.graph.neighbors(me, s)
        }  # fmt: skip
        left = self._deadline.drain(m, sorted(peers), self._layout_sent.nbytes, _DATA_TAG)
        self._draining = left
        return left

    # ------------------------------------------------------------------ exchange

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _post(self, send: Tensor, recv: Tensor, peer: int, step: int):
        """Start sending ``send`` to ``peer`` and receiving its buffer into ``recv``.
        Returns ``(works, device buffer to copy into after the wait, or None)``."""
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
            raise _PeerFailure(
                peer, f"exchange with neighbour rank {peer} failed at step {step}: {exc}"
            ) from exc
        return works, (dest, recv) if dest is not None else None

    def _settle(self, job: Inflight, slot: int, works, staged) -> None:
        peer = job.peers[slot]
        for work in works:
            self._wait(work, peer, f"exchange with neighbour rank {peer}", job.step)
        if staged is not None:
            staged[0].copy_(staged[1])
        job.done.add(slot)

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

    def begin(
        self, ys: list[Tensor], step: int, loss=None, *, overlap: bool = True, state: int = 0
    ) -> Inflight:
        """Pack ``ys`` (and ``loss``) and start the exchange of ``step``; the last ``state``
        of ``ys`` are shared optimizer state, sent in :func:`~.packing.wire_dtype`.

        With ``overlap`` every neighbour's send and receive is posted at once (gloo moves
        the bytes in its own threads) and nothing is waited for: the caller computes, then
        calls :meth:`finish_mix`. Without it the swaps run round by round, each waited for.
        ``ys`` are copied into the send buffer, so they may change afterwards; only one
        exchange may be in flight per communicator.
        """
        layout = self._layout(ys, state)
        if layout not in self._checked:
            self.check_layout(ys, step, state)
        m = self.membership
        graph, members = m.graph, list(m.members)
        me = members.index(self.rank)
        peers = [members[k] for k in graph.neighbors(me, step)]
        loss = None if loss is None else float(torch.as_tensor(loss).detach())
        full = True
        if self._codec is not None and step >= m.resume_at:
            full = self._codec.full(step, m.epoch, graph.period)
            ys = self._codec.encode(ys, full)
            layout = self._layout(ys)
            if layout not in self._checked:
                self.check_layout(ys, step)
        if self._deadline is not None:
            if ys[0].is_cuda:
                raise ValueError("step_deadline works on CPU tensors only")
            if self._layout_sent not in (None, layout):
                raise ValueError(
                    "step_deadline needs the same tensors in every exchange (a late exchange "
                    f"is paired with a later one): step {step} sends {layout.describe()}, an "
                    f"earlier one {self._layout_sent.describe()}"
                )
            self._layout_sent = layout
            send, recvs = self._deadline.buffer(layout.nbytes), []
        else:
            send, recvs = self._buffers_for(layout, ys[0].device, len(peers))
        own_finite = layout.pack(ys, loss, send)
        job = Inflight(step, m.epoch, loss, layout, own_finite, graph, members, peers, recvs)
        job.full = full
        if step < m.resume_at:  # catching up after a failure: local steps only
            return job
        if self._deadline is not None:
            return self._post_all(job, send, me, step)
        try:
            for k in self._schedule(graph, me, step):
                slot = peers.index(members[k])
                works, staged = self._post(send, recvs[slot], members[k], step)
                if overlap:
                    job.pending.append((slot, works, staged))
                else:
                    self._settle(job, slot, works, staged)
        except _PeerFailure as failure:
            job.failure = failure
        return job

    def _post_all(self, job: Inflight, send: Tensor, me: int, step: int) -> Inflight:
        """``step_deadline``: post an exchange to each neighbour with none in flight; the
        waits run in threads (none after :meth:`drain`, until its leftovers are mixed)."""
        m = self.membership
        order = [job.members[k] for k in self._schedule(job.graph, me, step)]
        if self._draining:
            order = []
        failed = self._deadline.post(m.group, m.local, send, order, step, _DATA_TAG)
        if failed is not None:
            peer = failed[0]
            job.failure = _PeerFailure(
                peer, f"exchange with neighbour rank {peer} failed at step {step}: {failed[1]}"
            )
        return job

    def _complete(self, job: Inflight) -> _Exchanged:
        """Wait for what ``job`` still has in flight; after a failure, re-form (keeping what
        arrived) or raise."""
        if self._deadline is not None:
            return self._complete_deadline(job)
        try:
            while job.pending and job.failure is None:
                self._settle(job, *job.pending.pop(0))
        except _PeerFailure as failure:
            job.failure = failure
        if job.epoch != self.membership.epoch:  # posted on a group re-formed since
            job.done.clear()
        elif job.failure is not None:
            self._failed(job.step, job.failure)
        got = sorted(job.done)
        self.bytes_sent = job.layout.nbytes * len(got)
        heads = [job.layout.header(job.recvs[k]).tolist() for k in got]
        return _Exchanged(
            [job.peers[k] for k in got],
            [job.layout.unpack(job.recvs[k]) for k in got],
            [h[0] for h in heads],
            [h[1] == 1.0 for h in heads],
            job.own_finite,
            job.graph,
            job.members,
        )

    def _complete_deadline(self, job: Inflight) -> _Exchanged:
        """``step_deadline``: every exchange that has arrived by the deadline (see
        :mod:`.deadline`), this step's and late ones."""
        arrivals = []
        if job.failure is None and job.epoch == self.membership.epoch:
            try:
                arrivals = self._deadline.settle(job.peers, job.step)
            except _Failed as exc:
                job.failure = _PeerFailure(
                    exc.peer,
                    f"exchange with neighbour rank {exc.peer} failed at step {job.step}: {exc}",
                )
        self._draining = False
        if job.failure is not None:
            self._failed(job.step, job.failure)
            arrivals = []
        if job.epoch != self.membership.epoch:  # posted on a group re-formed since
            arrivals = []
        lay = job.layout
        self.bytes_sent = lay.nbytes * self._deadline.sent_count
        heads = [lay.header(a.recv).tolist() for a in arrivals]
        return _Exchanged(
            [a.peer for a in arrivals],
            [lay.unpack(a.recv) for a in arrivals],
            [h[0] for h in heads],
            [h[1] == 1.0 for h in heads],
            job.own_finite,
            job.graph,
            job.members,
            [a.step for a in arrivals],
            [None if a.sent is None else lay.unpack(a.sent) for a in arrivals],
        )

    def exchange(
        self, ys: list[Tensor], step: int, loss: Tensor | float | None = None
    ) -> tuple[list[int], list[list[Tensor]], list[float], list[bool]]:
        """Swap this rank's tensors (and loss) with its neighbours at ``step``.

        Returns ``(peers, tensors, losses, finite)``, one entry per neighbour reached,
        sorted by rank; ``tensors[k]`` are views into a receive buffer, valid until the next
        call.
        """
        if self._codec is not None:
            raise ValueError("exchange() sends tensors as they are; with compression use mix()")
        ex = self._complete(self.begin(ys, step, loss, overlap=False))
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
        state: int = 0,
    ) -> tuple[list[Tensor], dict]:
        """Exchange with the neighbours and mix this rank's tensors ``ys``.

        Same rules as :meth:`SimulatedCommunicator.mix` (the last ``state`` tensors are
        optimizer state, mixed by :func:`tensor_rules`); ``loss`` is this rank's batch loss
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
        job = self.begin(ys, step, loss, overlap=False, state=state)
        return self.finish_mix(job, ys, rule, theta, cfg, out=out, state=state)

    def finish_mix(
        self,
        job: Inflight,
        ys: list[Tensor],
        rule: str = "metropolis",
        theta: Theta | None = None,
        cfg: NetConfig | None = None,
        *,
        out: list[Tensor] | None = None,
        state: int = 0,
    ) -> tuple[list[Tensor], dict]:
        """Complete the exchange ``job`` (from :meth:`begin`) and mix ``ys`` (the tensors
        it sent, unchanged since) with what came back; same result as :meth:`mix`."""
        check_rule(rule, theta, cfg)
        rules = tensor_rules(rule, len(ys), state)
        ex, step = self._complete(job), job.step
        own_loss = job.loss
        if not ex.own_finite:
            raise GossipError(
                f"rank {self.rank}: its own tensors hold NaN or Inf at step {step} (after its "
                "local step); its neighbours leave them out. Lower the learning rate, or check "
                "this rank's data and loss"
            )
        keep = [k for k in range(len(ex.peers)) if ex.finite[k]]
        for k in keep if ex.sent is not None else []:
            if ex.sent[k] is not None:  # a late exchange: mix the difference it carries
                for got, y, sent in zip(ex.tensors[k], ys, ex.sent[k]):
                    got.add_(y).sub_(sent)
        dist = None
        if self._clip is not None and keep:
            keep, dist = self._verified(ys, ex, keep)
        excluded = [ex.peers[k] for k in range(len(ex.peers)) if k not in keep]
        self.nonfinite_excluded += len(excluded)
        if self._codec is not None:  # mix the public copies, see compression
            mixed, weights = self._mix_copies(job, ex, ys, keep, own_loss, rules, theta, cfg, out)
        else:
            weights = [
                self._weights(ys, t, ex, own_loss, keep, step, rules[t], theta, cfg)
                for t in range(len(ys))
            ]
            neighbours = [[ex.tensors[k][t] for k in keep] for t in range(len(ys))]
            if dist is not None and keep:  # all clipped before any is mixed in place
                weights = robust_weight_lists(ys, neighbours, weights, self._clip, dist)
            targets = out if out is not None else [None] * len(ys)
            mixed = [mix(y, nb, w, out=o) for y, nb, w, o in zip(ys, neighbours, weights, targets)]
        info = {
            "neighbors": [ex.peers[k] for k in keep],
            "weights": [torch.tensor([float(x) for x in w], dtype=torch.float64) for w in weights],
            "excluded": excluded,
            "bytes_sent": self.bytes_sent,
        }
        return mixed, info

    def _verified(self, ys, ex: _Exchanged, keep: list[int]) -> tuple[list[int], Tensor | None]:
        """Robust mixing trusts no neighbour's finite flag: of ``keep``, the neighbours
        whose tensors are all finite, and (without compression) their distances
        (:func:`~.mixing.distance_lists`, ``[D, T]``, by :attr:`distances`), which this
        check computes anyway: a NaN or Inf makes a distance non-finite. With compression
        the (small) payloads are checked before they reach the public copies."""
        if self._codec is not None:
            ok = [all(bool(torch.isfinite(t).all()) for t in ex.tensors[k]) for k in keep]
            return [k for k, good in zip(keep, ok) if good], None
        dist = self.distances(ys, [[ex.tensors[k][t] for k in keep] for t in range(len(ys))])
        ok = torch.isfinite(dist).all(1)
        return [k for k, good in zip(keep, ok.tolist()) if good], dist[ok]

    def _mix_copies(self, job, ex: _Exchanged, ys, keep, own_loss, rules, theta, cfg, out):
        """Compressed mix: ``y_i += gamma * sum_j w_ij (h_j - h_i)``, with the weights taken
        from the public copies ``h`` (the same on both ends of an edge), and with robust
        mixing each ``h_j - h_i`` clipped (:func:`~.mixing.robust_weight_lists`, the
        distances by :attr:`distances`); ``rules``: one per tensor."""
        codec = self._codec
        peers = [ex.peers[k] for k in keep]
        copies = [codec.decode(p, ex.tensors[k], job.full) for p, k in zip(peers, keep)]
        losses = [ex.losses[k] for k in keep]
        on_copies = _Exchanged(
            peers, copies, losses, [True] * len(peers), True, ex.graph, ex.members
        )
        order = list(range(len(peers)))
        weights = [
            self._weights(codec.own, t, on_copies, own_loss, order, job.step, rules[t], theta, cfg)
            for t in range(len(ys))
        ]
        if self._clip is not None and copies:  # every h_j - h_i clipped, by one distances call
            neighbours = [[c[t] for c in copies] for t in range(len(ys))]
            dist = self.distances(codec.own, neighbours)
            weights = robust_weight_lists(codec.own, neighbours, weights, self._clip, dist)
        mixed = list(out) if out is not None else [y.clone() for y in ys]
        for t, (y, target, w) in enumerate(zip(ys, mixed, weights)):
            if target is not y:
                target.copy_(y)
            codec.mix_(t, target, [c[t] for c in copies], w)
        return mixed, weights

    def _weights(self, ys, t, ex: _Exchanged, own_loss, keep, step, rule, theta, cfg):
        """Weights of tensor ``t`` for the kept neighbours, ordered as ``keep``, on the graph
        the exchange ran on (both ends of an edge use the same graph, so they agree)."""
        graph, index = ex.graph, {r: k for k, r in enumerate(ex.members)}
        me = index[self.rank]
        steps = ex.steps if ex.steps is not None else [step] * len(ex.peers)
        if rule != "learned":
            return [graph.weight(me, index[ex.peers[k]], steps[k], rule) for k in keep]
        out = []
        for k in keep:
            j = ex.peers[k]
            pair = [(self.rank, ys[t], own_loss), (j, ex.tensors[k][t], ex.losses[k])]
            (_, y_a, l_a), (_, y_b, l_b) = sorted(pair, key=lambda e: e[0])
            if l_a is None or l_b is None or l_a != l_a or l_b != l_b:
                l_a = l_b = None  # both ends see the same two losses, so they agree
            deg = max(graph.degree(me, steps[k]), graph.degree(index[j], steps[k]))
            out.append(learned_edge_weight(theta, cfg, y_a, y_b, l_a, l_b, deg, steps[k]))
        return out
