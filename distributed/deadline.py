"""A per-step deadline for slow neighbours (stragglers), over gloo: late exchanges are
mixed when they arrive.

With ``step_deadline=s`` a rank waits at most ``s`` seconds in a step for its neighbours'
tensors. Each edge has at most one *exchange* in flight: a send of this rank's tensors and
a receive of the neighbour's, posted together. A step posts a new exchange to every
neighbour whose last one is done, waits until the deadline for those just posted, then
mixes every exchange that has arrived, whether it was posted this step or earlier. An
exchange that missed the deadline stays in flight, and no new one is posted on its edge
until it arrives; so a neighbour that stays slow (a rank several times slower than the
rest) is mixed with at its own pace, once per exchange it makes, and it mixes the fast
ranks' tensors at every step of its own. Its fast neighbours do not wait for it again
until an exchange with it arrives within the deadline: they poll the edge.

A late exchange is mixed with the *difference* it carries. Exchange ``k`` on the edge
``(i, j)`` pairs the tensors ``s_i`` that ``i`` sent with the ``s_j`` that ``j`` sent,
posted at different steps. Rank ``i``, now at ``y_i``, mixes the neighbour value
``y_i + (s_j - s_i)``, which is ``s_j`` when the exchange is on time; so every exchange
moves ``i`` by ``w_ij (s_j - s_i)`` and ``j`` by ``w_ij (s_i - s_j)``, and the network
average is exact once both ends have mixed it (each end mixes it once, at its own step).

Why not a shorter gloo wait: a gloo wait that times out closes every connection of the
rank, and a gloo send or receive never reports itself complete to ``is_completed``. So
each wait runs (with the full ``timeout``) in a helper thread, one per neighbour, and the
step waits on those threads. gloo pairs the sends and receives of two ranks in posting
order; both ends post exchange ``k`` of their edge only after exchange ``k - 1`` arrived,
so the ``k``-th posts of the two ends always meet.

At the end (:meth:`DeadlineExchange.drain`, from ``GossipOptimizer.flush``) the two ends of
each edge compare through the rendezvous store how many exchanges they posted; the one
that is one behind posts an empty exchange to match, and every exchange still in flight
completes, so no send or receive is left pending. A neighbour silent for the whole
``timeout`` is a failure (dead or frozen, handled by :mod:`.membership`).

Limits: CPU tensors on gloo only; every exchange must have the same layout (not with
``share_state_every`` > 1); not with ``compression`` (the public copies of the two ends
would differ) nor with ``overlap``.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor

_MAX_FREE = 16  # free buffers kept per size


@dataclass
class _Edge:
    """The exchange in flight with one neighbour."""

    sent: Tensor  # the send buffer: this end's tensors as they were posted
    recv: Tensor  # the neighbour's tensors land here
    future: cf.Future  # the receive's wait, in the neighbour's helper thread
    step: int  # the step that posted it
    posted: float  # monotonic clock
    done_at: float | None = None  # when the receive completed


@dataclass(frozen=True)
class Arrival:
    """An exchange to mix now: the neighbour's buffer and, when it was posted at an earlier
    step than this one, this end's buffer as it was sent then (else ``None``)."""

    peer: int
    recv: Tensor
    sent: Tensor | None
    step: int


class DeadlineExchange:
    """Posts the exchanges of a step, waits for them until the deadline and returns every
    exchange that has arrived."""

    def __init__(self, deadline: float, timeout: timedelta):
        if not deadline > 0:
            raise ValueError(f"step_deadline must be > 0 seconds, got {deadline}")
        if deadline >= timeout.total_seconds():
            raise ValueError(
                f"step_deadline ({deadline:g} s) must be shorter than timeout "
                f"({timeout.total_seconds():g} s), which marks a neighbour as failed"
            )
        self.deadline = float(deadline)
        self.timeout = timeout
        self._waiters: dict[int, cf.ThreadPoolExecutor] = {}  # one thread per neighbour
        self._busy: list[tuple[Tensor, list[cf.Future]]] = []  # buffers gloo may still use
        self._free: dict[int, list[Tensor]] = {}  # by size in bytes
        self._edges: dict[int, _Edge] = {}  # neighbour rank -> exchange in flight
        self._late: set[int] = set()  # neighbours whose last exchange missed the deadline
        self._posted: dict[int, int] = {}  # exchanges posted per neighbour (this epoch)
        self._drains = 0
        self.skipped_total = 0  # neighbours of a step not mixed at it, summed over steps
        self.late_total = 0  # exchanges mixed at a later step than they were posted
        self.skipped: list[int] = []  # this step's neighbours not mixed at it
        self.sent_count = 0  # exchanges posted by the last post()

    def buffer(self, nbytes: int) -> Tensor:
        """A byte buffer that no pending send or receive, nor an exchange not yet mixed,
        uses."""
        held = {id(t) for e in self._edges.values() for t in (e.sent, e.recv)}
        busy = []
        for buf, futures in self._busy:
            if all(f.done() for f in futures) and id(buf) not in held:
                free = self._free.setdefault(buf.numel(), [])
                if len(free) < _MAX_FREE:
                    free.append(buf)
            else:
                busy.append((buf, futures))
        self._busy = busy
        free = self._free.get(nbytes)
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8)

    def watch(self, buf: Tensor, works: list, peers: list[int]) -> list[cf.Future]:
        """Wait for ``works`` (on ``buf``; ``works[k]`` with neighbour ``peers[k]``) in that
        neighbour's helper thread; ``buf`` is reused after them."""
        futures = [self._waiter(p).submit(w.wait, self.timeout) for w, p in zip(works, peers)]
        self._busy.append((buf, futures))
        return futures

    def in_flight(self, peer: int) -> bool:
        """Whether an exchange with ``peer`` is posted and not yet mixed."""
        return peer in self._edges

    def post(self, group, local, send: Tensor, peers: list[int], step: int, tag: int):
        """Post an exchange of ``send`` to each of ``peers`` (global ranks, in round order;
        ``local`` maps one to ``group``'s rank) that has none in flight. Returns ``None``,
        or ``(peer, error)`` when posting to a neighbour failed."""
        sent_to, sends, failed = [], [], None
        try:
            for peer in peers:
                if peer in self._edges:
                    continue
                recv_buf = self.buffer(send.numel())
                sends.append(group.send([send], local(peer), tag))
                sent_to.append(peer)
                recv = group.recv([recv_buf], local(peer), tag)
                future = self.watch(recv_buf, [recv], [peer])[0]
                self._edges[peer] = edge = _Edge(send, recv_buf, future, step, time.monotonic())
                self._posted[peer] = self._posted.get(peer, 0) + 1
                future.add_done_callback(lambda _, e=edge: setattr(e, "done_at", time.monotonic()))
        except Exception as exc:  # the pair is closed: a failed neighbour
            failed = (peer, exc)
        self.watch(send, sends, sent_to)
        self.sent_count = len(sent_to)
        return failed

    def settle(self, neighbours: list[int], step: int) -> list[Arrival]:
        """Wait until the deadline for the exchanges posted at ``step`` (except to
        neighbours whose last exchange was late: those are polled), then take every
        exchange that has arrived, sorted by neighbour. ``neighbours`` are this step's.
        Raises :class:`_Failed` for a wait that failed (a dead or frozen neighbour)."""
        fresh = [
            e for p, e in self._edges.items() if e.step == step and p not in self._late
        ]  # fmt: skip
        if fresh:
            left = max(0.0, min(e.posted for e in fresh) + self.deadline - time.monotonic())
            cf.wait([e.future for e in fresh], timeout=left)
        arrivals = []
        for peer in sorted(self._edges):
            edge = self._edges[peer]
            if not edge.future.done():
                if edge.step == step:
                    self._late.add(peer)
                continue
            if edge.future.exception() is not None:
                raise _Failed(peer, edge.future.exception())
            del self._edges[peer]
            if edge.done_at is not None and edge.done_at - edge.posted <= self.deadline:
                self._late.discard(peer)
            else:
                self._late.add(peer)
            stale = edge.step != step
            self.late_total += stale
            arrivals.append(Arrival(peer, edge.recv, edge.sent if stale else None, edge.step))
        got = {a.peer for a in arrivals}
        self.skipped = [p for p in neighbours if p not in got]
        self.skipped_total += len(self.skipped)
        return arrivals

    def drain(self, membership, peers: list[int], nbytes: int, tag: int) -> bool:
        """End every exchange in flight with ``peers`` (every neighbour this rank can
        have), so that no send or receive is left pending: agree with each on the number
        of exchanges posted; where the two ends differ by one, the end behind posts an
        empty exchange to match, and neither end mixes that pair. Waits for all (up to the
        timeout). Returns whether exchanges that arrived are left to mix (:meth:`settle`).
        A neighbour that does not drain within the timeout is left as it is."""
        store, me, group = membership.store, membership.rank, membership.group
        key = f"deadline/e{membership.epoch}/drain{self._drains}"
        self._drains += 1
        for peer in peers:
            store.set(f"{key}/{me}-{peer}", str(self._posted.get(peer, 0)))
        matched = []
        for peer in peers:
            theirs = f"{key}/{peer}-{me}"
            try:
                store.wait([theirs], self.timeout)
                ahead = int(store.get(theirs)) - self._posted.get(peer, 0)
            except Exception:  # the neighbour is gone or did not drain: nothing to match
                continue
            if ahead < 0 and peer in self._edges:  # matched by the neighbour's empty one
                matched.append(self._edges.pop(peer).future)
            elif ahead > 0:  # this end is behind: match the neighbour's last exchange
                if peer in self._edges:
                    cf.wait([self._edges[peer].future], self.timeout.total_seconds())
                empty, scratch = self.buffer(nbytes).zero_(), self.buffer(nbytes)
                local = membership.local(peer)
                works = [group.send([empty], local, tag), group.recv([scratch], local, tag)]
                matched += self.watch(empty, works[:1], [peer])
                matched += self.watch(scratch, works[1:], [peer])
                self._posted[peer] = self._posted.get(peer, 0) + 1
        futures = matched + [e.future for e in self._edges.values()]
        cf.wait(futures, timeout=self.timeout.total_seconds())
        return any(e.future.done() for e in self._edges.values())

    def reset(self) -> None:
        """Forget pending work (the group it was posted on is gone)."""
        self._busy.clear()
        self._free.clear()
        self._edges.clear()
        self._late.clear()
        self._posted.clear()

    def _waiter(self, peer: int) -> cf.ThreadPoolExecutor:
        if peer not in self._waiters:
            self._waiters[peer] = cf.ThreadPoolExecutor(1, thread_name_prefix=f"gossip-wait{peer}")
        return self._waiters[peer]

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.shutdown(wait=False, cancel_futures=True)


class _Failed(Exception):
    """A wait of the exchange failed (the caller turns it into a peer failure)."""

    def __init__(self, peer: int, cause: BaseException):
        super().__init__(str(cause))
        self.peer = peer
        self.cause = cause
