"""Local steps with a compressed outer exchange (DiLoCo / DeMo class), decentralized.

Each rank trains on its own for ``H`` local steps with its inner optimizer, then takes one
*round*: one compressed exchange with its neighbours and an outer step on its anchor. Per
rank ``i`` and parameter tensor (``x_i`` the trained parameters, ``xa_i`` the anchor; every
stream below is gossiped CHOCO-style through :class:`~.compression.ErrorFeedback`: public
copies ``h``, compressed differences, error feedback, pull ``gamma * sum_j w_ij (h_j - h_i)``
with ``w_ij = w_ji``, so every stream's network average is kept exactly)::

    D_i  = xa_i - x_i + H c_i                pseudo-gradient of the H local steps
    y_i += D_i - D_i(last round)             tracker of the network's mean D (y_i = D_i at first)
    send C(xa_i - h_i) and C(y_i - hy_i);    xa_i += pull(xa);  y_i += pull(y)
    c_i  = (D_i - y_i) / H                   added to x_i after every local step
    xa_i = outer(xa_i, grad=y_i)             any torch.optim.Optimizer (Nesterov SGD, learned)
    x_i  = xa_i                              the next H local steps start from the anchor

The tracker (gradient tracking over rounds, as K-GT does) makes the outer rule see an
estimate of the network's mean pseudo-gradient, and the correction ``c_i`` pulls each rank's
local steps towards it: under label skew a rank's own steps drift towards its own shard's
optimum (in exploratory replays on the validation family, plain local steps with exact
mixing of the anchors ended 1.6-10x above per-step gossip at ``H = 8``; tracking brought
the convex one to 0.92x). Since
``sum_i y_i = sum_i D_i`` at every round, the averaged anchor follows the outer rule on the
averaged pseudo-gradient (for a linear rule), whatever ``C`` drops; compression only slows
the ranks' consensus.

``tracking=False`` sends the anchor alone (half the bytes) and steps it by the rank's own
``D_i`` *before* the exchange: ``xa_i = outer(xa_i, grad=D_i)``, then the anchors mix. With
``H = 1``, no compression and outer SGD at ``lr=1`` without momentum that is exactly a plain
local step followed by gossip of the parameters (tested).

The public copies start at the common initial parameters (and the tracker's at zero), so no
round sends anything whole: every rank must start from the same parameters (a seeded
initialisation, as :mod:`.train` and the simulator do). Bytes are counted as sent: each
round's payload (:mod:`.compression`: per top-k entry its bfloat16 value and about
``log2(1 / R) + 2`` bits of index, :mod:`.indices`; float32 whole without compression) once
per neighbour.

Two drivers run the same per-rank object, :class:`LocalSteps`:

- :class:`SimulatedLocalSteps`: N ranks in one process over stacked tensors ``[N, ...]``
  (the held-out decentralized benchmark's simulator; measured by
  ``benchmarks/local_steps.py``);
- ``LocalSteps(..., communicator=ProcessGroupCommunicator(topology))`` on each real rank,
  :meth:`LocalSteps.step` after every inner step (and :meth:`LocalSteps.flush` after the
  last one): it exchanges through the communicator's
  uncompressed ``exchange()`` (this module compresses). On 4 gloo ranks it ends every
  rank where the simulator ends it, to the bit, and counts the same bytes
  (``tests/distributed/test_process_group.py``). A rank that fails is not handled: the
  public copies would disagree, so a neighbour missing from an exchange raises
  ``RuntimeError``.

Topologies must be static (``period == 1``) with compression: a copy ``h_j`` is only kept
for the neighbours a rank always talks to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .compression import ErrorFeedback
from .topology import Topology

#: Builds a rank's outer optimizer over its anchor tensors.
OuterFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


def nesterov(lr: float = 0.7, momentum: float = 0.9) -> OuterFactory:
    """DiLoCo's outer rule: ``torch.optim.SGD(lr, momentum, nesterov=True)`` per rank."""
    if not lr > 0:
        raise ValueError(f"outer lr must be > 0, got {lr}")
    if not 0 < momentum < 1:
        raise ValueError(f"outer momentum must be in (0, 1), got {momentum}")
    return lambda anchors: torch.optim.SGD(anchors, lr=lr, momentum=momentum, nesterov=True)


def _check(local_steps, topology: Topology, rank: int, compression, rule: str) -> None:
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
    if not 0 <= rank < topology.world_size:
        raise ValueError(f"rank {rank} is outside the topology's {topology.world_size} ranks")
    if compression is not None and topology.period != 1:
        raise ValueError(
            f"compressed local steps need a static topology; {topology.name} changes "
            f"every step (period {topology.period})"
        )
    if rule not in ("metropolis", "uniform"):
        raise ValueError(f"unknown mixing rule {rule!r}; choose 'metropolis' or 'uniform'")


class _Channel:
    """One stream of tensors gossiped CHOCO-style (:class:`~.compression.ErrorFeedback`),
    or sent whole and mixed with ``gamma = 1`` (``spec`` None). Public copies start at
    ``start`` on every rank."""

    def __init__(self, spec, gamma, beta, start: list[Tensor], peers: list[int]):
        self.codec = None
        if spec is not None:
            self.codec = ErrorFeedback(spec, gamma, beta)
            self.codec.own = [t.clone() for t in start]
            self.codec.drift = [torch.zeros_like(t) for t in start] if self.codec.beta else []
            self.codec.copies = {j: [t.clone() for t in start] for j in peers}

    def encode(self, tensors: list[Tensor]) -> list[Tensor]:
        if self.codec is None:
            return [t.clone() for t in tensors]
        return self.codec.encode(tensors, False)

    def mix_(self, tensors: list[Tensor], received: dict[int, list[Tensor]], weights) -> None:
        peers = list(received)
        if self.codec is None:
            for t, y in enumerate(tensors):
                y.copy_(y + sum(w * (received[j][t] - y) for j, w in zip(peers, weights)))
            return
        copies = [self.codec.decode(j, received[j], False) for j in peers]
        for t, y in enumerate(tensors):
            self.codec.mix_(t, y, [c[t] for c in copies], weights)


class LocalSteps:
    """One rank's anchor, outer optimizer and compressed exchange (see the module doc).

    Args:
        params: this rank's parameter tensors (trained in place by the inner optimizer;
            a round writes the new anchor into them).
        outer: builds the outer optimizer over the anchor tensors, e.g. :func:`nesterov`
            or ``lambda a: LearnedOptimizer(a, lr=0.1)``; it receives the pseudo-gradient
            as the anchors' ``.grad``.
        local_steps: ``H``, the local steps between rounds, >= 1.
        topology: the graph; its weights ``rule`` ("metropolis" or "uniform") mix.
        rank: this rank in ``topology``.
        compression: ``"topk:R"``, ``"sign"``, ``"int8"`` (:mod:`.compression`) or ``None``
            (sent whole, ``gamma = 1``).
        consensus_step: ``gamma`` (default :func:`~.compression.default_consensus_step`).
        drift_correction: ``beta`` (default :func:`~.compression.default_drift_correction`).
        tracking: track the network's pseudo-gradient and correct the local steps by it
            (see the module doc); doubles the payload. Default True.
        communicator: a :class:`~.process_group.ProcessGroupCommunicator` without
            compression, for :meth:`step` on a real rank; ``None`` in the simulator.

    ``bytes_sent`` counts every byte this rank has sent; ``rounds`` the rounds taken.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        outer: OuterFactory,
        *,
        local_steps: int,
        topology: Topology,
        rank: int,
        compression: str | None = "topk:0.05",
        consensus_step: float | None = None,
        drift_correction: float | None = None,
        tracking: bool = True,
        rule: str = "metropolis",
        communicator=None,
    ):
        _check(local_steps, topology, rank, compression, rule)
        self.params = list(params)
        if not self.params:
            raise ValueError("LocalSteps got no parameters")
        if compression is None and (consensus_step not in (None, 1.0) or drift_correction):
            raise ValueError("consensus_step and drift_correction need compression")
        if communicator is not None and getattr(communicator, "compression", None):
            raise ValueError("the communicator must not compress: LocalSteps compresses itself")
        self.local_steps = local_steps
        self.topology, self.rank, self.rule = topology, rank, rule
        self.compression, self.tracking = compression, bool(tracking)
        self.communicator = communicator
        self.count = 0  # local steps taken (by step())
        self.rounds = 0
        self.bytes_sent = 0
        self.anchors = [p.detach().clone().requires_grad_(True) for p in self.params]
        self.outer = outer(self.anchors)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ValueError(f"outer must build a torch.optim.Optimizer, got {type(self.outer)}")
        start = [a.detach() for a in self.anchors]
        args = (compression, consensus_step, drift_correction)
        self._anchor = _Channel(*args, start, self.neighbors)
        zeros = [torch.zeros_like(a) for a in start]
        self._tracker = _Channel(*args, zeros, self.neighbors) if self.tracking else None
        codec = self._anchor.codec
        self.gamma = codec.gamma if codec else 1.0
        self.beta = codec.beta if codec else 0.0
        self.correction = [torch.zeros_like(a) for a in start]  # c_i, added every local step
        self.tracker: list[Tensor] = []  # y_i
        self._delta: list[Tensor] = []  # D_i of the last round

    @property
    def neighbors(self) -> list[int]:
        return self.topology.neighbors(self.rank, self.rounds)

    def _outer_step(self, grads: list[Tensor]) -> None:
        for a, g in zip(self.anchors, grads):
            a.grad = g.to(a.dtype).clone()
        self.outer.step()
        for a in self.anchors:
            a.grad = None

    @torch.no_grad()
    def correct(self) -> None:
        """Add the correction ``c_i`` to the parameters (after every local step)."""
        if self.tracking and self.rounds:
            for p, c in zip(self.params, self.correction):
                p.add_(c)

    @torch.no_grad()
    def encode(self, steps: int | None = None) -> list[Tensor]:
        """The round's first half: what this rank sends to every neighbour (counted in
        ``bytes_sent``). ``steps``: local steps since the last round (default ``H``)."""
        steps = self.local_steps if steps is None else steps
        anchors = [a.detach() for a in self.anchors]
        own = 1 if self.rounds else 0  # the correction took part in the local steps
        delta = [a - p.detach() + own * steps * c
                 for a, p, c in zip(anchors, self.params, self.correction)]  # fmt: skip
        if not self.tracking:
            self._outer_step(delta)
            payload = self._anchor.encode(anchors)
        else:
            if not self.tracker:
                self.tracker = [d.clone() for d in delta]
            else:
                for y, d, old in zip(self.tracker, delta, self._delta):
                    y.add_(d - old)
            self._delta = delta
            payload = self._anchor.encode(anchors) + self._tracker.encode(self.tracker)
        self.bytes_sent += len(self.neighbors) * sum(t.numel() * t.element_size() for t in payload)
        return payload

    @torch.no_grad()
    def finish(self, received: dict[int, list[Tensor]]) -> None:
        """The round's second half: mix with the neighbours' payloads (``{rank: payload}``),
        take the outer step (with tracking) and restart from the anchor."""
        peers = self.neighbors
        if sorted(received) != peers:
            raise RuntimeError(
                f"rank {self.rank} round {self.rounds}: expected payloads from {peers}, "
                f"got {sorted(received)}"
            )
        weights = [self.topology.weight(self.rank, j, self.rounds, self.rule) for j in peers]
        anchors = [a.detach() for a in self.anchors]
        count = len(anchors)
        self._anchor.mix_(anchors, {j: received[j][: len(received[j]) // (1 + self.tracking)]
                                    for j in peers}, weights)  # fmt: skip
        if self.tracking:
            half = {j: received[j][len(received[j]) // 2 :] for j in peers}
            self._tracker.mix_(self.tracker, half, weights)
            self.correction = [(d - y) / self.local_steps
                               for d, y in zip(self._delta, self.tracker)]  # fmt: skip
            self._outer_step(self.tracker)
        assert len(self.tracker) in (0, count)
        for p, a in zip(self.params, anchors):
            p.copy_(a)
        self.rounds += 1

    def step(self) -> bool:
        """After the inner optimizer's step: add the correction, count the step, and every
        ``H``-th call run a round through the communicator. Returns whether it did."""
        if self.communicator is None:
            raise ValueError("step() needs a communicator; the simulator drives encode/finish")
        self.correct()
        self.count += 1
        if self.count % self.local_steps:
            return False
        self._exchange_round(self.local_steps)
        return True

    def flush(self) -> bool:
        """At the end of a run whose last round was cut short of ``H`` local steps: that
        round now, through the communicator, so that the rank ends on its new anchor, as
        :meth:`SimulatedLocalSteps.round` ends a simulated run. Every rank must call it (it
        exchanges); returns whether there was a round to take."""
        if self.communicator is None:
            raise ValueError("flush() needs a communicator; the simulator drives encode/finish")
        steps = self.count % self.local_steps
        if steps:
            self._exchange_round(steps)
            self.count += self.local_steps - steps  # the next round is a whole one again
        return bool(steps)

    def _exchange_round(self, steps: int) -> None:
        payload = self.encode(steps)
        peers, tensors, _, _ = self.communicator.exchange(payload, self.rounds)
        self.finish({j: [t.clone() for t in ts] for j, ts in zip(peers, tensors)})


class SimulatedLocalSteps:
    """N :class:`LocalSteps` ranks in one process, over stacked tensors ``[N, *shape]``.

    ``params`` are the stacked tensors (rank ``i``'s tensor is row ``i``; a round writes
    into them, so views of a flat buffer work); the keyword arguments are those of ``kind``,
    the per-rank class: :class:`LocalSteps` (the default) or
    :class:`~.outer.OuterStep` (its ``topology`` sets the ranks). Call :meth:`step` after
    every simulated local step of all ranks.
    """

    def __init__(self, params: Sequence[Tensor], outer: OuterFactory, kind=None, **kwargs):
        topology: Topology = kwargs["topology"]
        n = topology.world_size
        for p in params:
            if p.shape[0] != n:
                raise ValueError(f"stacked tensor has {p.shape[0]} workers, topology has {n}")
        kind = kind or LocalSteps
        self.ranks = [kind([p[i] for p in params], outer, rank=i, **kwargs)
                      for i in range(n)]  # fmt: skip
        self.local_steps = self.ranks[0].local_steps
        self.count = 0

    @property
    def bytes_per_rank(self) -> float:
        """Bytes sent so far, averaged over the ranks."""
        return sum(r.bytes_sent for r in self.ranks) / len(self.ranks)

    def round(self, params: Sequence[Tensor] | None = None) -> None:
        """One round of every rank now (also at the end of a run cut short of ``H``).
        ``params``: the stacked tensors anew, when the inner loop replaced them out of place
        since the last call (their rows become the ranks' parameters)."""
        if params is not None:
            for i, r in enumerate(self.ranks):
                r.params = [p[i] for p in params]
        steps = self.count % self.local_steps or self.local_steps
        payloads = [r.encode(steps) for r in self.ranks]
        for r in self.ranks:
            r.finish({j: payloads[j] for j in r.neighbors})

    def step(self, params: Sequence[Tensor] | None = None) -> bool:
        """Count one local step; every ``H``-th call runs a round (on ``params``, see
        :meth:`round`). Returns whether it did."""
        if params is not None:
            for i, r in enumerate(self.ranks):
                r.params = [p[i] for p in params]
        for r in self.ranks:
            r.correct()
        self.count += 1
        if self.count % self.local_steps:
            return False
        self.round()
        return True
