"""Communication topologies: plain data with a registry and per-step edges.

A :class:`Topology` is a list of undirected edge sets, one per step of its period
(static graphs have period 1). It answers who talks to whom at a step and builds the
hand-designed mixing matrices. Nothing here starts a process, so every topology is
testable on its own::

    topo = get_topology("ring", 8)
    topo.neighbors(3)            # [2, 4]
    topo.mixing_matrix()         # 8 x 8, doubly stochastic (Metropolis-Hastings)
    topo.spectral_gap()          # 0.195...
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence

import torch

from .mixing import metropolis_weight

Edge = tuple[int, int]

#: Hand-designed weight rules that :meth:`Topology.weight` understands.
STATIC_RULES = ("metropolis", "uniform")


def _normalise_edges(world_size: int, edges: Iterable[Sequence[int]]) -> list[Edge]:
    """Validate an undirected edge list and return it as sorted ``(i, j)`` pairs, ``i < j``."""
    out = set()
    for e in edges:
        if len(e) != 2:
            raise ValueError(f"an edge must be a pair of ranks, got {e!r}")
        i, j = int(e[0]), int(e[1])
        if i == j:
            raise ValueError(f"self loop ({i}, {j}) is not allowed")
        if not (0 <= i < world_size and 0 <= j < world_size):
            raise ValueError(f"edge ({i}, {j}) has a rank outside [0, {world_size})")
        out.add((min(i, j), max(i, j)))
    return sorted(out)


def _components(world_size: int, edges: Iterable[Edge]) -> list[list[int]]:
    """Connected components of the graph, each sorted, ordered by their lowest rank."""
    parent = list(range(world_size))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i, j in edges:
        parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(world_size):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values())


def _is_connected(world_size: int, edges: Iterable[Edge]) -> bool:
    return len(_components(world_size, edges)) <= 1


class Topology:
    """An undirected, possibly time-varying communication graph over ``world_size`` ranks.

    Args:
        name: registry name (or ``"custom"``).
        world_size: number of workers.
        edge_sets: one edge list per step of the period; step ``t`` uses
            ``edge_sets[t % period]``. Edges are undirected pairs of distinct ranks.

    Raises ``ValueError`` for self loops, out-of-range ranks, or a graph whose union over
    the period is not connected.
    """

    def __init__(self, name: str, world_size: int, edge_sets: Sequence[Iterable[Sequence[int]]]):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if len(edge_sets) == 0:
            raise ValueError("a topology needs at least one edge set (its period)")
        self.name = name
        self.world_size = world_size
        self._edge_sets = [_normalise_edges(world_size, es) for es in edge_sets]
        self.period = len(self._edge_sets)
        self._neighbors = [
            [sorted({j for e in es if i in e for j in e if j != i}) for i in range(world_size)]
            for es in self._edge_sets
        ]
        union = {e for es in self._edge_sets for e in es}
        if not _is_connected(world_size, union):
            raise ValueError(
                f"topology {name!r} with world_size {world_size} is not connected over its "
                f"period of {self.period} step(s)"
            )

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, world_size={self.world_size}, period={self.period})"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")

    def edges(self, step: int = 0) -> list[Edge]:
        """Undirected edges ``(i, j)`` with ``i < j``, sorted, in use at ``step``."""
        return list(self._edge_sets[step % self.period])

    def neighbors(self, rank: int, step: int = 0) -> list[int]:
        """Sorted neighbours of ``rank`` at ``step``."""
        self._check_rank(rank)
        return list(self._neighbors[step % self.period][rank])

    def degree(self, rank: int, step: int = 0) -> int:
        """Number of neighbours of ``rank`` at ``step``."""
        self._check_rank(rank)
        return len(self._neighbors[step % self.period][rank])

    def rounds(self, step: int = 0) -> list[list[Edge]]:
        """The step's edges split into matchings (a greedy edge colouring).

        In each round every rank has at most one peer, so exchanging round by round, each
        pair at once in both directions, can never deadlock, whatever the backend.
        """
        colour_of: dict[Edge, int] = {}
        used: list[set[int]] = [set() for _ in range(self.world_size)]
        for i, j in self.edges(step):
            c = next(c for c in range(2 * self.world_size) if c not in used[i] | used[j])
            colour_of[(i, j)] = c
            used[i].add(c)
            used[j].add(c)
        out: list[list[Edge]] = [[] for _ in range(max(colour_of.values(), default=-1) + 1)]
        for e, c in colour_of.items():
            out[c].append(e)
        return out

    def max_degree(self, step: int = 0) -> int:
        """Largest degree over all ranks at ``step``."""
        return max(len(n) for n in self._neighbors[step % self.period])

    def weight(self, a: int, b: int, step: int = 0, rule: str = "metropolis") -> float:
        """Hand-designed weight of edge ``(a, b)`` at ``step``.

        ``metropolis``: ``1 / (1 + max(deg_a, deg_b))``. ``uniform``: ``1 / (1 + d_max)``
        with ``d_max`` the largest degree in the graph at that step, so every edge carries
        the same weight (equal to Metropolis on regular graphs). Both are symmetric, so the
        mixing matrix is doubly stochastic.
        """
        if rule == "metropolis":
            return metropolis_weight(self.degree(a, step), self.degree(b, step))
        if rule == "uniform":
            d = self.max_degree(step)
            return metropolis_weight(d, d)
        raise ValueError(f"unknown mixing rule {rule!r}; hand-designed rules are {STATIC_RULES}")

    def restricted_to(self, members: Sequence[int]) -> Topology:
        """The graph among ``members`` only (the survivors of a failure), relabelled.

        Member ``members[k]`` becomes rank ``k``; edges to the other ranks are dropped,
        per step of the period. Where that leaves the union over the period disconnected,
        the components are chained by one edge between their lowest members, so every
        survivor still mixes towards one common average. Deterministic: every survivor
        computes the same graph from the same ``members``.
        """
        members = list(members)
        if not members or len(set(members)) != len(members):
            raise ValueError(f"members must be distinct ranks, got {members!r}")
        for r in members:
            self._check_rank(r)
        index = {r: k for k, r in enumerate(members)}
        edge_sets = [
            [(index[i], index[j]) for i, j in es if i in index and j in index]
            for es in self._edge_sets
        ]
        parts = _components(len(members), [e for es in edge_sets for e in es])
        edge_sets[0] += [(a[0], b[0]) for a, b in zip(parts, parts[1:])]
        gone = sorted(set(range(self.world_size)) - set(members))
        name = self.name if not gone else f"{self.name} without {gone}"
        return Topology(name, len(members), edge_sets)

    def mixing_matrix(self, step: int = 0, rule: str = "metropolis") -> torch.Tensor:
        """The ``[n, n]`` float64 mixing matrix at ``step``: symmetric and doubly stochastic."""
        n = self.world_size
        w = torch.zeros(n, n, dtype=torch.float64)
        for i, j in self.edges(step):
            w[i, j] = w[j, i] = self.weight(i, j, step, rule)
        w += torch.diag(1.0 - w.sum(dim=1))
        return w

    def spectral_gap(self, rule: str = "metropolis") -> float:
        """``1 - |lambda_2|`` per step of the mixing matrices' product over one period.

        ``|lambda_2|`` is the spectral radius of ``prod_t W_t - 11^T/n`` taken to the power
        ``1/period``, so static and time-varying graphs compare per step. 1 means exact
        averaging; 0 means no mixing.
        """
        n = self.world_size
        prod = torch.eye(n, dtype=torch.float64)
        for t in range(self.period):
            prod = self.mixing_matrix(t, rule) @ prod
        dev = prod - torch.full((n, n), 1.0 / n, dtype=torch.float64)
        radius = torch.linalg.eigvals(dev).abs().max().item() if n > 1 else 0.0
        return 1.0 - radius ** (1.0 / self.period)


# ----------------------------------------------------------------------------- registry


def _ring(n: int) -> list[list[Edge]]:
    return [[(i, (i + 1) % n) for i in range(n)] if n > 1 else []]


def _factor_grid(n: int) -> tuple[int, int]:
    rows = max((r for r in range(2, math.isqrt(n) + 1) if n % r == 0), default=0)
    if rows == 0:
        raise ValueError(
            f"torus needs a world_size that factors as rows x cols with rows, cols >= 2; "
            f"{n} does not (pass rows= explicitly, or use ring)"
        )
    return rows, n // rows


def _torus(n: int, rows: int | None = None) -> list[list[Edge]]:
    if rows is None:
        rows, cols = _factor_grid(n)
    elif rows < 2 or n % rows != 0 or n // rows < 2:
        raise ValueError(f"torus rows={rows} must divide world_size={n} with both sides >= 2")
    else:
        cols = n // rows
    edges = []
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            edges.append((i, r * cols + (c + 1) % cols))
            edges.append((i, ((r + 1) % rows) * cols + c))
    return [edges]


def _exponential(n: int) -> list[list[Edge]]:
    hops = [1 << k for k in range(max(n - 1, 1).bit_length()) if (1 << k) < n]
    return [[(i, (i + h) % n) for i in range(n) for h in hops if (i + h) % n != i]]


def _one_peer_exponential(n: int) -> list[list[Edge]]:
    if n & (n - 1):
        raise ValueError(
            f"one_peer_exponential needs a power-of-two world_size (it pairs rank i with "
            f"i XOR 2^k), got {n}"
        )
    if n == 1:
        return [[]]
    return [
        [(i, i ^ (1 << k)) for i in range(n) if i < i ^ (1 << k)] for k in range(n.bit_length() - 1)
    ]


def _one_peer_ring(n: int) -> list[list[Edge]]:
    if n % 2:
        raise ValueError(
            f"one_peer_ring needs an even world_size (it pairs each even rank with its right "
            f"neighbour, then with its left one), got {n}"
        )
    if n == 2:
        return [[(0, 1)]]
    return [[(i, i + 1) for i in range(0, n, 2)], [(i, (i - 1) % n) for i in range(0, n, 2)]]


def _complete(n: int) -> list[list[Edge]]:
    return [[(i, j) for i in range(n) for j in range(i + 1, n)]]


def _random_regular(n: int, degree: int | None = None, seed: int = 0) -> list[list[Edge]]:
    if n == 1:
        return [[]]
    if degree is None:
        degree = min(4, n - 1)  # n * degree is even: 4 is even, and n - 1 is odd only for even n
    if not 0 < degree < n or (n * degree) % 2:
        raise ValueError(
            f"random_regular needs 0 < degree < world_size and degree * world_size even; "
            f"got degree={degree}, world_size={n}"
        )
    rng = random.Random(seed)
    for _ in range(1000):  # pairing model with restarts; succeeds quickly for small degrees
        stubs = [i for i in range(n) for _ in range(degree)]
        rng.shuffle(stubs)
        pairs = {(min(a, b), max(a, b)) for a, b in zip(stubs[::2], stubs[1::2])}
        if len(pairs) == n * degree // 2 and all(a != b for a, b in pairs):
            if _is_connected(n, pairs):
                return [sorted(pairs)]
    raise ValueError(f"could not draw a connected {degree}-regular graph on {n} nodes")


def _custom(n: int, edges: Iterable[Sequence[int]] | None = None) -> list[list[Edge]]:
    if edges is None:
        raise ValueError("the custom topology needs edges=[(i, j), ...]")
    return [list(edges)]


_REGISTRY: dict[str, Callable[..., list[list[Edge]]]] = {
    "ring": _ring,
    "torus": _torus,
    "exponential": _exponential,
    "one_peer_exponential": _one_peer_exponential,
    "one_peer_ring": _one_peer_ring,
    "complete": _complete,
    "random_regular": _random_regular,
    "custom": _custom,
}


def list_topologies() -> list[str]:
    """Names accepted by :func:`get_topology`."""
    return list(_REGISTRY)


def get_topology(name: str, world_size: int, **kwargs) -> Topology:
    """Build a registered topology.

    Names: ``ring``, ``torus`` (``rows=`` optional), ``exponential`` (static, hops 2^k),
    ``one_peer_exponential`` (time-varying, one peer per step, power-of-two sizes),
    ``one_peer_ring`` (time-varying ring, right then left neighbour, even sizes; the ring
    Decent-DP uses),
    ``complete``, ``random_regular`` (``degree=``, ``seed=``) and ``custom`` (``edges=``).
    Impossible sizes raise ``ValueError``.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown topology {name!r}; available: {list_topologies()}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return Topology(name, world_size, _REGISTRY[name](world_size, **kwargs))
