"""A per-step deadline for slow neighbours (stragglers), over gloo.

With ``step_deadline=s`` a rank waits at most ``s`` seconds for a neighbour's tensors in a
step. An edge whose data did not arrive in time on *either* end is skipped for that step
by *both* ends, so the mixing matrix stays symmetric and the network average stays exact;
the neighbour is not dropped, and it is mixed with again from the next step it is on time.
Only a neighbour that stays silent for the whole ``timeout`` is a failure (dead or frozen,
handled by :mod:`.membership`).

Why it takes more than a shorter wait: a gloo wait that times out closes every connection
of the rank, and a gloo send or receive never reports itself complete to ``is_completed``.
So every send and receive is posted at once and waited for (with the full ``timeout``) by
a helper thread, one per neighbour: the waits on one neighbour end in posting order anyway,
and a late neighbour's pile of waits then never holds up another neighbour's (with one pool
shared by all neighbours, the waits on a rank that stays slow took every thread, and the
data of neighbours on time was counted late). The step waits on those threads until the
deadline. A receive that missed
it stays posted, into a buffer of its own, and completes when the late neighbour sends:
gloo pairs the sends and receives of two ranks in posting order, so the steps of a late
rank still meet the right steps of its neighbours.

The two ends of an edge can see different things (one got the data in time, the other did
not), so they agree through the rendezvous store: each writes its verdict for the edge and
step with ``compare_set``, the first verdict wins, and both read it. An end that must mix
data still in flight waits for it (the other end sent it before it voted). Costs per step:
one ``compare_set`` and one ``add`` on the store per edge, and a thread hand-off per wait;
one helper thread per neighbour.

Limits: CPU tensors on gloo only; not with ``compression`` (a skipped step would leave the
public copies different on the two ends) nor with ``overlap``.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from datetime import timedelta

import torch
from torch import Tensor

_MAX_FREE = 16  # free buffers kept per size


class DeadlineExchange:
    """Posts a step's exchange, waits for it until the deadline and settles each edge."""

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
        self.skipped_total = 0  # edges skipped so far (counted on each end)
        self.skipped: list[int] = []  # neighbours skipped in the last step

    def buffer(self, nbytes: int) -> Tensor:
        """A byte buffer that no pending send or receive uses."""
        busy = []
        for buf, futures in self._busy:
            if all(f.done() for f in futures):
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

    def post(self, membership, job, send: Tensor, order: list[int], tag: int):
        """Post the sends of ``send`` and the receives into ``job.recvs`` to ``job.peers``,
        slot by slot in ``order``; their waits go to helper threads. Returns ``None``, or
        ``(slot, error)`` when posting to a neighbour failed."""
        sends, to, futures, failed = [], [], {}, None
        try:
            for slot in order:
                peer = membership.local(job.peers[slot])
                sends.append(membership.group.send([send], peer, tag))
                to.append(job.peers[slot])
                recv = membership.group.recv([job.recvs[slot]], peer, tag)
                futures[slot] = self.watch(job.recvs[slot], [recv], [job.peers[slot]])[0]
        except Exception as exc:  # the pair is closed: a failed neighbour
            failed = (slot, exc)
        self.watch(send, sends, to)
        job.pending = [(slot, futures[slot]) for slot in sorted(futures)]
        job.posted = time.monotonic()
        return failed

    def settle(self, membership, job) -> list[int]:
        """Wait until the deadline, then agree with each neighbour on its edge; returns the
        slots (indices into ``job.peers``) to mix this step. Raises :class:`_Failed` for a
        wait that failed (a dead or frozen neighbour)."""
        store, me, peers = membership.store, membership.rank, job.peers
        key = f"deadline/e{job.epoch}/s{job.step}"
        recvs = [fut for _, fut in job.pending]
        job.pending = []
        left = max(0.0, job.posted + self.deadline - time.monotonic())
        cf.wait(recvs, timeout=left)
        for slot, fut in enumerate(recvs):
            if fut.done() and fut.exception() is not None:
                raise _Failed(slot, fut.exception())
        keep, self.skipped = [], []
        for slot, (peer, fut) in enumerate(zip(peers, recvs)):
            a, b = sorted((me, peer))
            edge = f"{key}/{a}-{b}"
            vote = "1" if fut.done() else "0"
            verdict = store.compare_set(edge, "", vote).decode()
            if store.add(edge + "/n", 1) >= 2:  # both ends have read it: tidy the store
                store.delete_key(edge)
                store.delete_key(edge + "/n")
            if verdict == "1":
                try:
                    fut.result()  # sent before the other end voted; at most the timeout
                except Exception as exc:
                    raise _Failed(slot, exc) from exc
                keep.append(slot)
            else:
                self.skipped.append(peer)
        self.skipped_total += len(self.skipped)
        return keep

    def reset(self) -> None:
        """Forget pending work (the group it was posted on is gone)."""
        self._busy.clear()
        self._free.clear()

    def _waiter(self, peer: int) -> cf.ThreadPoolExecutor:
        if peer not in self._waiters:
            self._waiters[peer] = cf.ThreadPoolExecutor(1, thread_name_prefix=f"gossip-wait{peer}")
        return self._waiters[peer]

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.shutdown(wait=False, cancel_futures=True)


class _Failed(Exception):
    """A wait of the exchange failed (the caller turns it into a peer failure)."""

    def __init__(self, slot: int, cause: BaseException):
        super().__init__(str(cause))
        self.slot = slot
        self.cause = cause
