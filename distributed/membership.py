"""Who is still in the gossip group, and how the survivors re-form it after a failure.

gloo gives two kinds of failure. A neighbour that dies closes its connections: only the
pairs with it fail, at once. A neighbour that is frozen or far too slow makes a wait time
out, and a gloo timeout closes *every* connection of the rank that timed out, so its
process group is unusable from then on. Either way the way forward is the same, and it is
what :meth:`Membership.reform` does, through the rendezvous store (the ``TCPStore`` that
``init_process_group`` or torchrun set up):

1. The rank that notices a failure closes its own connections on purpose (a 1 ms wait on
   a receive nobody will send). Its neighbours then fail at once instead of timing out,
   and they re-form too: the failure floods the graph in about one step.
2. Each rank registers for the next epoch in the store, with the step at which it noticed.
3. Registration closes when every member has registered or ``timeout`` seconds after a
   rank registered. The first rank to close it writes the member list with the store's
   ``compare_set``, so every rank reads the same list. The ranks that did not register in
   time died or are frozen: they, and only they, are blamed.
4. The members build a fresh gloo group among themselves (its own store prefix); the
   graph becomes :meth:`Topology.restricted_to` the members. Exchanges resume at the step
   after the latest step at which a member noticed, so every survivor resumes with the
   same graph at the same step; a rank that noticed earlier skips the exchanges in
   between (it takes local steps only). A registered rank left out of the list (it woke up
   too late) raises :class:`GossipError`.

Nothing of this costs anything while no rank fails: the store is touched only on failure.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .topology import Topology

log = logging.getLogger("learned_opt.distributed")

#: What a communicator does when a neighbour dies or times out.
ON_FAILURE = ("exclude", "raise")
_POISON_TAG = 0x6C6F  # a tag no data message uses: a receive on it can only time out
_POLL_S = 0.02
_instances = itertools.count()


class GossipError(RuntimeError):
    """A neighbour died, timed out or disagreed; the message names the rank and the step."""


@dataclass(frozen=True)
class Failure:
    """One rank dropped from the group."""

    rank: int  #: the rank that died or froze (its rank in the original group)
    step: int  #: the step at which the first survivor noticed
    cause: str  #: what the first survivor saw, e.g. its neighbour's connection closing

    def as_dict(self) -> dict:
        return asdict(self)


def default_store() -> dist.Store:
    """The default process group's rendezvous store (torch keeps it, but not publicly)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception as exc:  # a private helper: say plainly what is missing
        raise RuntimeError(
            "surviving failures needs the process group's rendezvous store; pass store= "
            f"to the communicator ({exc})"
        ) from exc


class Membership:
    """The live members of a gossip group, their process group and graph, and the failures.

    Args:
        topology: the graph over the original group (global ranks).
        group: the original process group (``None``: the default group).
        timeout: seconds a rank waits for the others to register after a failure.
        store: the rendezvous store (default: the default group's). Communicators must be
            created in the same order on every rank: the n-th one uses key prefix n.
    """

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None,
        timeout: timedelta,
        store: dist.Store | None = None,
    ):
        self.rank = dist.get_rank(group)
        self.members = list(range(dist.get_world_size(group)))  # ranks of the original group
        self.group = group if group is not None else dist.group.WORLD
        self.graph = topology
        self.epoch = 0
        self.resume_at = 0
        self.failures: list[Failure] = []
        self.timeout = timeout
        self._store = store
        self._prefix = f"learned_opt/gossip/{next(_instances)}"

    def local(self, rank: int) -> int:
        """Rank in the current group of ``rank`` (a rank of the original group)."""
        return self.members.index(rank)

    @property
    def store(self) -> dist.Store:
        if self._store is None:
            self._store = default_store()
        return dist.PrefixStore(self._prefix, self._store)

    def poison(self) -> None:
        """Close every connection of this rank's current gloo group (see the module doc)."""
        for peer in range(len(self.members)):
            if peer == self.local(self.rank):
                continue
            try:
                work = self.group.recv([torch.empty(1)], peer, _POISON_TAG)
                work.wait(timedelta(milliseconds=1))
            except Exception:  # the wait times out (that is the point) or the pair is closed
                pass

    def reform(self, step: int, cause: str) -> list[int]:
        """Agree with the survivors on the new member list; returns the ranks dropped.

        Raises :class:`GossipError` if this rank itself was left out.
        """
        self.poison()
        store, me, old = self.store, self.rank, list(self.members)
        key = f"e{self.epoch + 1}"
        store.compare_set(f"{key}/first", "", f"rank {me} at step {step}: {cause}")
        store.set(f"{key}/joined/{me}", str(step))
        store.add(f"{key}/count", 1)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not store.check([f"{key}/members"]):
            if store.add(f"{key}/count", 0) >= len(old) or time.monotonic() >= deadline:
                joined = [r for r in old if store.check([f"{key}/joined/{r}"])]
                store.compare_set(f"{key}/members", "", json.dumps(joined))
                break
            time.sleep(_POLL_S)
        members = json.loads(store.get(f"{key}/members"))
        first = store.get(f"{key}/first").decode()
        dropped = [r for r in old if r not in members]
        if me not in members:
            raise GossipError(
                f"rank {me} was excluded from the gossip group at step {step}: it did not "
                f"rejoin within {self.timeout.total_seconds():g} s of a failure (frozen or far "
                f"too slow); the survivors {members} went on. First failure seen: {first}"
            )
        self.epoch += 1
        self.members = members
        self.resume_at = 1 + max(int(store.get(f"{key}/joined/{r}")) for r in members)
        self.failures += [Failure(r, step, first) for r in dropped]
        for r in dropped:
            log.warning(
                "rank %d: rank %d left the gossip group (dead or frozen: it did not rejoin "
                "within %g s); %d survivors %s go on from step %d. First failure seen: %s",
                me,
                r,
                self.timeout.total_seconds(),
                len(members),
                members,
                self.resume_at,
                first,
            )
        return dropped

    def regroup(self, topology: Topology) -> None:
        """Build the survivors' gloo group and graph (after :meth:`reform`)."""
        pg_store = dist.PrefixStore(f"e{self.epoch}/pg", self.store)
        self.group = dist.ProcessGroupGloo(
            pg_store, self.local(self.rank), len(self.members), self.timeout
        )
        self.graph = topology.restricted_to(self.members)
