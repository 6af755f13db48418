"""Topologies are plain data: symmetry, doubly-stochastic mixing, spectral gaps."""

import math

import pytest
import torch

from learned_opt.distributed import Topology, get_topology, list_topologies

SIZES = {
    "ring": [1, 2, 3, 5, 8],
    "torus": [4, 6, 9, 12],
    "exponential": [1, 2, 5, 8, 16],
    "one_peer_exponential": [1, 2, 4, 8, 16],
    "one_peer_ring": [2, 4, 6, 8],
    "complete": [1, 2, 7],
    "random_regular": [2, 5, 8, 16],
}


def _cases():
    for name, sizes in SIZES.items():
        for n in sizes:
            yield name, n


@pytest.mark.parametrize("name,n", list(_cases()))
def test_edges_symmetric_and_metropolis_doubly_stochastic(name, n):
    topo = get_topology(name, n)
    assert topo.world_size == n and topo.name == name
    for step in range(topo.period + 1):
        edges = topo.edges(step)
        assert edges == sorted(edges) and all(i < j for i, j in edges)
        for i in range(n):
            nbrs = topo.neighbors(i, step)
            assert i not in nbrs and nbrs == sorted(nbrs)
            assert topo.degree(i, step) == len(nbrs)
            for j in nbrs:
                assert i in topo.neighbors(j, step)
        for rule in ("metropolis", "uniform"):
            w = topo.mixing_matrix(step, rule)
            assert w.dtype == torch.float64 and w.shape == (n, n)
            assert torch.equal(w, w.T)
            assert (w >= 0).all()
            ones = torch.ones(n, dtype=torch.float64)
            torch.testing.assert_close(w.sum(0), ones)
            torch.testing.assert_close(w.sum(1), ones)


def _ring_gap(n):
    lam = max(abs((1 + 2 * math.cos(2 * math.pi * k / n)) / 3) for k in range(1, n))
    return 1 - lam


@pytest.mark.parametrize("n", [4, 5, 8, 16])
def test_ring_gap_closed_form(n):
    assert get_topology("ring", n).spectral_gap() == pytest.approx(_ring_gap(n), abs=1e-9)


def test_ring_8_gap_is_0195():
    assert get_topology("ring", 8).spectral_gap() == pytest.approx(0.195, abs=5e-4)


@pytest.mark.parametrize("rows,cols", [(3, 3), (3, 4), (4, 4)])
def test_torus_gap_closed_form(rows, cols):
    # degree-4 Metropolis weights 1/5: eigenvalues (1 + 2cos(2 pi a/r) + 2cos(2 pi b/c)) / 5
    lam = max(
        abs(1 + 2 * math.cos(2 * math.pi * a / rows) + 2 * math.cos(2 * math.pi * b / cols)) / 5
        for a in range(rows)
        for b in range(cols)
        if (a, b) != (0, 0)
    )
    topo = get_topology("torus", rows * cols, rows=rows)
    assert topo.spectral_gap() == pytest.approx(1 - lam, abs=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_complete_and_one_peer_exponential_average_exactly(n):
    assert get_topology("complete", n).spectral_gap() == pytest.approx(1.0)
    topo = get_topology("one_peer_exponential", n)
    assert topo.period == int(math.log2(n))
    assert all(topo.degree(i, t) == 1 for i in range(n) for t in range(topo.period))
    assert topo.spectral_gap() == pytest.approx(1.0)


def test_random_regular_is_seeded_and_regular():
    a = get_topology("random_regular", 12, degree=3, seed=1)
    b = get_topology("random_regular", 12, degree=3, seed=1)
    assert a.edges() == b.edges()
    assert all(a.degree(i) == 3 for i in range(12))


def test_custom_edges():
    topo = get_topology("custom", 4, edges=[(1, 0), (1, 2), (3, 2)])
    assert topo.edges() == [(0, 1), (1, 2), (2, 3)]
    assert topo.spectral_gap() == pytest.approx(
        get_topology("custom", 4, edges=topo.edges()).spectral_gap()
    )
    assert isinstance(topo, Topology)


@pytest.mark.parametrize(
    "name,n,kwargs",
    [
        ("one_peer_exponential", 6, {}),
        ("one_peer_ring", 5, {}),
        ("torus", 7, {}),
        ("torus", 8, {"rows": 3}),
        ("random_regular", 5, {"degree": 3}),
        ("random_regular", 4, {"degree": 4}),
        ("ring", 0, {}),
        ("nope", 4, {}),
        ("custom", 3, {"edges": [(0, 0)]}),
        ("custom", 3, {"edges": [(0, 3)]}),
        ("custom", 4, {"edges": [(0, 1), (2, 3)]}),
        ("custom", 3, {}),
    ],
)
def test_bad_sizes_raise_value_error(name, n, kwargs):
    with pytest.raises(ValueError):
        get_topology(name, n, **kwargs)


def test_registry_and_errors():
    assert set(SIZES) | {"custom"} == set(list_topologies())
    topo = get_topology("ring", 4)
    with pytest.raises(ValueError):
        topo.neighbors(4)
    with pytest.raises(ValueError):
        topo.mixing_matrix(rule="learned")


def test_one_peer_ring_alternates_right_and_left():
    topo = get_topology("one_peer_ring", 6)
    assert topo.period == 2
    assert topo.neighbors(2, 0) == [3] and topo.neighbors(2, 1) == [1]
    assert topo.neighbors(0, 1) == [5] and topo.mixing_matrix(0)[0, 1] == 0.5


def test_restricted_topology_drops_and_reconnects():
    ring = get_topology("ring", 6)
    sub = ring.restricted_to([0, 1, 3, 4])  # ring minus 2 and 5: two paths, chained
    assert sub.world_size == 4 and sub.name == "ring without [2, 5]"
    assert sub.edges() == [(0, 1), (0, 2), (2, 3)]
    torch.testing.assert_close(sub.mixing_matrix().sum(0), torch.ones(4, dtype=torch.float64))
    assert ring.restricted_to(range(6)).edges() == ring.edges()
    with pytest.raises(ValueError, match="distinct"):
        ring.restricted_to([1, 1])
    with pytest.raises(ValueError, match="outside"):
        ring.restricted_to([0, 9])
