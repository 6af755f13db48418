"""``SimulatedCommunicator``: N gossip workers stacked in one process.

Worker ``i``'s copy of a parameter tensor is row ``i`` of a stacked tensor ``[N, *shape]``.
Mixing calls the same :func:`~learned_opt.distributed.mixing.mix` as the real workers,
once per neighbour slot with one weight per stacked worker, in the same neighbour order
(sorted by rank), so a simulated run and a real multi-process run agree up to rounding.
Everything is out of place and differentiable in the stacked tensors and theta, which is
what meta-training needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from learned_opt.config import NetConfig
from learned_opt.network import Theta

from .mixing import (
    check_rule,
    learned_edge_weight,
    mix,
    parse_robust,
    robust_weights,
    tensor_rules,
)
from .packing import as_received
from .topology import Edge, Topology


@dataclass(frozen=True)
class _Plan:
    """Index tensors of one step's graph, padded to the largest degree."""

    edges: list[Edge]
    a: Tensor  # [E] lower rank of each edge
    b: Tensor  # [E] higher rank of each edge
    max_degree: Tensor  # [E] max(deg_a, deg_b), float64
    neighbor: Tensor  # [N, D] neighbour rank per slot (self where the slot is empty)
    edge_id: Tensor  # [N, D] edge index per slot (0 where empty)
    valid: Tensor  # [N, D] bool


class SimulatedCommunicator:
    """Mixes stacked worker tensors over a :class:`Topology` in a single process.

    ``robust``: ``None`` (plain mixing) or ``"clip"`` / ``"clip:C"``, every worker clipping
    what its neighbours send as :func:`~learned_opt.distributed.mixing.mix` does on a real
    worker (see :mod:`.mixing`).
    """

    def __init__(self, topology: Topology, robust: str | None = None):
        self._clip = parse_robust(robust)
        self.robust = robust
        self.topology = topology
        self.world_size = topology.world_size
        self._plans: dict[int, _Plan] = {}

    def _plan(self, step: int) -> _Plan:
        key = step % self.topology.period
        if key not in self._plans:
            topo, n = self.topology, self.world_size
            edges = topo.edges(key)
            slots = max([topo.degree(i, key) for i in range(n)] + [0])
            neighbor = torch.arange(n).unsqueeze(1).repeat(1, slots)
            edge_id = torch.zeros(n, slots, dtype=torch.long)
            valid = torch.zeros(n, slots, dtype=torch.bool)
            index = {e: k for k, e in enumerate(edges)}
            for i in range(n):
                for s, j in enumerate(topo.neighbors(i, key)):
                    neighbor[i, s] = j
                    edge_id[i, s] = index[(min(i, j), max(i, j))]
                    valid[i, s] = True
            a = torch.tensor([e[0] for e in edges], dtype=torch.long)
            b = torch.tensor([e[1] for e in edges], dtype=torch.long)
            max_degree = torch.tensor(
                [max(topo.degree(i, key), topo.degree(j, key)) for i, j in edges],
                dtype=torch.float64,
            )
            self._plans[key] = _Plan(edges, a, b, max_degree, neighbor, edge_id, valid)
        return self._plans[key]

    def _static_weights(self, plan: _Plan, step: int, rule: str, like: Tensor) -> Tensor:
        w = [self.topology.weight(i, j, step, rule) for i, j in plan.edges]
        return torch.tensor(w, dtype=like.dtype, device=like.device)

    def edge_weights(
        self,
        y: Tensor,
        step: int,
        rule: str = "metropolis",
        theta: Theta | None = None,
        cfg: NetConfig | None = None,
        losses: Tensor | None = None,
    ) -> Tensor:
        """Weights ``[E]`` of one stacked tensor ``y`` (``[N, *shape]``) on the step's edges."""
        check_rule(rule, theta, cfg)
        plan = self._plan(step)
        if rule != "learned" or not plan.edges:
            return self._static_weights(plan, step, rule, y)
        dev = y.device
        a, b = plan.a.to(dev), plan.b.to(dev)
        deg = plan.max_degree.to(device=dev, dtype=y.dtype)
        fn = partial(learned_edge_weight, theta, cfg)
        if losses is None:
            batched = torch.func.vmap(lambda ya, yb, d: fn(ya, yb, None, None, d, step))
            return batched(y[a], y[b], deg)
        batched = torch.func.vmap(lambda ya, yb, la, lb, d: fn(ya, yb, la, lb, d, step))
        return batched(y[a], y[b], losses[a], losses[b], deg)

    def mix(
        self,
        ys: list[Tensor],
        step: int,
        rule: str = "metropolis",
        theta: Theta | None = None,
        cfg: NetConfig | None = None,
        loss: Tensor | None = None,
        *,
        out: list[Tensor] | None = None,
        state: int = 0,
    ) -> tuple[list[Tensor], dict]:
        """Mix every stacked tensor in ``ys`` (each ``[N, *shape]``) over the step's edges
        (the :class:`~.exchange.Communicator` protocol).

        ``rule`` is ``metropolis``, ``uniform`` or ``learned`` (needs ``theta`` and ``cfg``).
        ``loss`` (``[N]`` batch losses) feeds the learned rule's loss features; ``None``
        marks them absent. The last ``state`` tensors are optimizer state, mixed by
        :func:`tensor_rules`. Returns the mixed tensors and ``{"weights": [E] per tensor,
        "edges": the edge list}``. Differentiable in ``ys``, ``theta`` and ``loss``, unless
        ``out`` is given: then the results are also copied into ``out`` (in place, as a
        real worker mixes) and returned as ``out``.
        """
        mixed, info = self._mix(ys, step, rule, theta, cfg, loss, state)
        if out is None:
            return mixed, info
        if len(out) != len(ys):
            raise ValueError(f"out holds {len(out)} tensors for {len(ys)} mixed ones")
        for o, y in zip(out, mixed):
            if o is not y:
                o.copy_(y)
        return list(out), info

    def _mix(self, ys, step, rule, theta, cfg, losses, state) -> tuple[list[Tensor], dict]:
        check_rule(rule, theta, cfg)
        rules = tensor_rules(rule, len(ys), state)
        plan = self._plan(step)
        for y in ys:
            if y.shape[0] != self.world_size:
                raise ValueError(
                    f"stacked tensor has {y.shape[0]} workers, topology has {self.world_size}"
                )
        mixed, weights = [], []
        for y, rule_y in zip(ys, rules):
            weights.append(self.edge_weights(y, step, rule_y, theta, cfg, losses))
        if not plan.edges:
            return list(ys), {"weights": weights, "edges": plan.edges}
        dev = ys[0].device
        valid, edge_id = plan.valid.to(dev), plan.edge_id.to(dev)
        neighbor_t = plan.neighbor.to(dev).T  # [D, N]: slot s of every worker
        neighbor_ys = [y[neighbor_t] for y in ys]  # [D, N, *shape] each
        first_state = len(ys) - state  # shared state arrives rounded, as real workers send it
        neighbor_ys = [
            nb if k < first_state else as_received(nb) for k, nb in enumerate(neighbor_ys)
        ]
        slot_ws = [  # [D, N] each
            torch.where(valid, w[edge_id], torch.zeros((), dtype=w.dtype, device=dev)).T
            for w in weights
        ]
        if self._clip is not None:
            slot_ws = robust_weights(ys, neighbor_ys, slot_ws, self._clip, batch_dims=1)
        for y, nb, slot_w in zip(ys, neighbor_ys, slot_ws):
            view = (self.world_size,) + (1,) * (y.dim() - 1)
            mixed.append(mix(y, list(nb), [w_s.view(view) for w_s in slot_w]))
        return mixed, {"weights": weights, "edges": plan.edges}

    def consensus_distance(self, ys: list[Tensor], step: int = 0) -> Tensor:
        """``(1/N) sum_i ||x_i - x_bar||^2`` summed over all stacked tensors (0-d); ``step``
        is unused (the protocol's: a real communicator names the exchange it waits on)."""
        total = sum((y - y.mean(dim=0, keepdim=True)).square().sum() for y in ys)
        return torch.as_tensor(total) / self.world_size
