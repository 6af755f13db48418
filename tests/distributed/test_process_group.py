"""Multi-process gloo tests: a few spawns of 4 local workers, several checks each.

Every time limit derives from ``dist_workers.COLLECTIVE_TIMEOUT`` and ``STARTUP`` (see
there): generous, so that the tests pass on a loaded machine."""

import dist_workers as w  # noqa: E402  (tests/distributed is on sys.path under pytest)
import pytest
import torch

from learned_opt.distributed import (
    LaunchError,
    RankFailure,
    SimulatedCommunicator,
    get_topology,
    launch_local,
)

N = 4


@pytest.fixture(scope="module")
def exchange_results():
    return launch_local(w.exchange_suite, N, timeout=w.launch_timeout(), pg_timeout=w.STARTUP)


@pytest.mark.timeout(w.test_timeout())
@pytest.mark.parametrize("name", ["ring", "one_peer_exponential"])
def test_exact_neighbour_exchange(exchange_results, name):
    topo = get_topology(name, N)
    for rank, res in enumerate(exchange_results):
        checks = res[name]
        expected_peers = [p for t in range(topo.period + 1) for p in topo.neighbors(rank, t)]
        assert [c[0] for c in checks] == expected_peers
        assert all(exact and loss_ok and finite for _, exact, loss_ok, finite in checks)


def test_startup_validation(exchange_results):
    for res in exchange_results:
        assert "built for 5 workers but the process group has 4" in res["world_size_error"]
        assert "parameter layout differs across ranks" in res["layout_error"]
        assert "rank 2: 2 tensors, 7 elements" in res["layout_error"]


def test_nan_neighbour_is_excluded(exchange_results):
    for rank in (0, 2):  # the neighbours of rank 1 on the ring
        excluded, count, mixed = exchange_results[rank]["nan"]
        assert excluded == [1] and count == 1
        other = 3  # the one finite neighbour; rank 1's weight stays with self
        expect = rank + (other - rank) / 3
        assert mixed[0] == pytest.approx([expect] * 4, rel=1e-6)
        assert mixed[1] == pytest.approx([2 * expect] * 2, rel=1e-12)
    excluded, count, _ = exchange_results[3]["nan"]
    assert excluded == [] and count == 0


def test_consensus_shrinks_with_mixing_alone(exchange_results):
    before, series = exchange_results[0]["consensus"]
    assert len(series) == 10 and series[-1] < 0.2 * before
    assert all(b <= a * (1 + 1e-9) for a, b in zip(series, series[1:]))
    for res in exchange_results:
        assert (
            res["consensus"] == exchange_results[0]["consensus"]
        )  # one all_reduce, same everywhere
        assert res["mean_change"] < 1e-5  # mixing keeps the network average
        assert res["bytes_sent"] > 2 * 4 * 22


def test_gradient_tracking_matches_dense_reference(exchange_results):
    # x <- W x - lr y;  y <- W y + g_new - g_old, for f_i(x) = |x - i|^2 / 2
    mixing = get_topology("ring", N).mixing_matrix()
    target = torch.arange(N, dtype=torch.float64)
    x = torch.zeros(N, dtype=torch.float64)
    g = x - target
    y = g.clone()
    for _ in range(150):
        x = mixing @ x - 0.2 * y
        g_new = x - target
        y, g = mixing @ y + g_new - g, g_new
    assert x.tolist() == pytest.approx([1.5] * N, abs=1e-3)  # heterogeneous optima, no bias
    for rank, res in enumerate(exchange_results):
        assert res["dsgt"] == pytest.approx([float(x[rank])] * 3, abs=1e-5)


def _simulate(kind, seed):
    topo = get_topology(w.KINDS[kind], N)
    sim = SimulatedCommunicator(topo)
    params = [w.init_params(i, seed) for i in range(N)]
    opts = [w.make_local(kind, params[i], seed) for i in range(N)]
    rule = "learned" if kind == "learned" else "metropolis"
    net = opts[0].net if kind == "learned" else None
    theta = {k: v.detach() for k, v in net.named_parameters()} if net else None
    for step in range(w.STEPS):
        losses = []
        for i in range(N):
            opts[i].zero_grad()
            loss = w.loss_fn(params[i], w.batch(i, step, seed))
            loss.backward()
            if kind == "learned":
                opts[i].step(loss=loss.detach())
            else:
                opts[i].step()
            losses.append(loss.detach())
        with torch.no_grad():
            ys = [torch.stack([params[i][t] for i in range(N)]) for t in range(len(params[0]))]
            mixed, _ = sim.mix(
                ys, step, rule, theta, net.config if net else None, torch.stack(losses)
            )
            for t, m in enumerate(mixed):
                for i in range(N):
                    params[i][t].copy_(m[i])
    return params


@pytest.mark.timeout(w.test_timeout())
def test_real_run_equals_simulator():
    seed = 3
    real = launch_local(
        w.equivalence_run, N, seed, timeout=w.launch_timeout(), pg_timeout=w.STARTUP
    )
    for kind in w.KINDS:
        sim = _simulate(kind, seed)
        init = [w.init_params(i, seed) for i in range(N)]
        for rank in range(N):
            for a, b, p0 in zip(real[rank][kind], sim[rank], init[rank]):
                assert not torch.allclose(a, p0)  # it moved
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.timeout(w.test_timeout())
def test_killed_rank_gives_clear_error_and_no_hang():
    res = launch_local(
        w.killed_rank,
        N,
        timeout=w.launch_timeout(),
        pg_timeout=w.STARTUP,
        raise_on_error=False,
    )
    assert all(isinstance(r, RankFailure) for r in res)
    assert not any("still running" in r.message for r in res), "a survivor hung"
    assert "exited with code 1" in res[3].message
    for rank in (0, 2):
        msg = res[rank].message
        assert f"rank {rank}: exchange with neighbour rank 3 failed at step 5" in msg
    assert "failed at step 5" in res[1].message
    with pytest.raises(LaunchError, match="rank 3"):
        raise LaunchError([r for r in res])
