"""Multi-process gloo tests: a few spawns of 4 local workers, several checks each.

Every time limit derives from ``dist_workers.COLLECTIVE_TIMEOUT`` and ``STARTUP`` (see
there): generous, so that the tests pass on a loaded machine."""

import dist_workers as w  # noqa: E402  (tests/distributed is on sys.path under pytest)
import pytest
import torch

from learned_opt.distributed import (
    SimulatedCommunicator,
    get_topology,
    launch_local,
    mix,
)
from learned_opt.distributed.local import gossip_local

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
    msg = exchange_results[1]["own_nan_error"]  # the NaN rank itself raises
    assert "rank 1: its own tensors hold NaN or Inf at step 0" in msg


def test_robust_mix_clips_a_bad_neighbour_and_excludes_nan(exchange_results):
    topo = get_topology("ring", N)
    for rank, res in enumerate(exchange_results):
        peers = topo.neighbors(rank, 0)
        expect = mix(
            w.robust_payload(rank),
            [w.robust_payload(j) for j in peers],
            [topo.weight(rank, j, 0, "metropolis") for j in peers],
            robust="clip",
        )  # the single-process function, on the same values
        assert res["robust"]["mixed"] == pytest.approx(expect.tolist(), rel=1e-6)
        assert res["robust"]["in_place"] == res["robust"]["mixed"]
        if rank in (0, 2):  # rank 1's 1e6 all but left out, its NaN left out
            assert max(res["robust"]["mixed"]) < 4 and res["robust"]["excluded"] == [1]
            # a NaN under a forged finite flag is left out too, exact or compressed
            assert res["robust"]["forged"] == [[1], True, [1], True]


def test_a_compressed_robust_mix_clips_the_public_copies(exchange_results):
    """With compression (top-k 100%, gamma 0.5, drift correction beta 0.05) the clip works
    on the public copies: step 0 sends whole (rank 1's 1e6 clipped), step 1 leaves out
    rank 1's forged NaN; each step adds gamma d + beta (d_0 + ... + d_t)."""
    topo = get_topology("ring", N)
    for rank, res in enumerate(exchange_results):
        if rank == 1:
            continue
        own, peers = w.robust_payload(rank), topo.neighbors(rank, 0)
        weights = {j: topo.weight(rank, j, 0, "metropolis") for j in peers}

        def d(kept, own=own, weights=weights):
            nb = [w.robust_payload(j) for j in kept]
            return mix(own, nb, [weights[j] for j in kept], robust="clip") - own

        d0, d1 = d(peers), d([j for j in peers if j != 1])
        # step 1 mixes `own` again (its copy unchanged), the drift holds beta (d0 + d1)
        expect = own + 0.5 * d1 + 0.05 * (d0 + d1)
        assert res["robust"]["topk_mixed"] == pytest.approx(expect.tolist(), rel=1e-6)


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


@pytest.mark.parametrize("spec", ["topk:0.25", "sign", "int8"])
def test_compressed_gossip_keeps_the_average_and_sends_less(exchange_results, spec):
    full = 2 * (16 + 22 * 4)  # two neighbours, header plus 22 float32 values
    for res in exchange_results:
        r = res[spec]
        assert r["mean_change"] < 1e-5  # exact average, whatever the compressor drops
        assert r["consensus"][1] < 0.5 * r["consensus"][0]
        assert r["bytes"] < full


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


def _simulate(kind, seed, overlap):
    """The reference: adapt-then-combine, or (``overlap``) mix x_t, then the local step
    with the gradient taken at x_t, each exchange carrying the previous batch's loss."""
    topo = get_topology(w.KINDS[kind], N)
    sim = SimulatedCommunicator(topo)
    params = [w.init_params(i, seed) for i in range(N)]
    opts = [w.make_local(kind, params[i], seed) for i in range(N)]
    learned = kind in w.LEARNED_KINDS
    locals_ = [gossip_local(opt) for opt in opts]
    for local in locals_ if learned else ():
        local.join_gossip()  # as GossipOptimizer does
    rule = "learned" if learned else "metropolis"
    net = opts[0].net if learned else None
    theta = {k: v.detach() for k, v in net.named_parameters()} if net else None
    previous = None

    every = w.SHARE_STATE_EVERY[kind] or 2  # None: GossipOptimizer's default

    def mix_all(step, losses):
        # a learned optimizer's moments travel with the parameters (share_state), in the
        # exchanges after local steps every, 2 * every, ...
        sharing = learned and (step + 1) % every == 0
        own = [params[i] + (locals_[i].shared_state() if sharing else []) for i in range(N)]
        state = len(own[0]) - len(params[0])
        with torch.no_grad():
            ys = [torch.stack([own[i][t] for i in range(N)]) for t in range(len(own[0]))]
            cfg = net.config if net else None
            mixed, _ = sim.mix(ys, step, rule, theta, cfg, losses, state=state)
            for t, m in enumerate(mixed):
                for i in range(N):
                    own[i][t].copy_(m[i])

    for step in range(w.STEPS):
        losses = []
        for i in range(N):
            opts[i].zero_grad()
            loss = w.loss_fn(params[i], w.batch(i, step, seed))
            loss.backward()
            losses.append(loss.detach())
        if overlap:
            mix_all(step, previous)
        for i in range(N):
            opts[i].step()
        previous = torch.stack(losses)
        if not overlap:
            mix_all(step, previous)
    return params


@pytest.mark.timeout(w.test_timeout())
def test_real_run_equals_simulator():
    seed = 3
    real = launch_local(
        w.equivalence_run, N, seed, timeout=w.launch_timeout(), pg_timeout=w.STARTUP
    )
    for overlap in (False, True):
        for kind in w.KINDS:
            sim = _simulate(kind, seed, overlap)
            init = [w.init_params(i, seed) for i in range(N)]
            for rank in range(N):
                for a, b, p0 in zip(real[rank][kind, overlap], sim[rank], init[rank]):
                    assert not torch.allclose(a, p0)  # it moved
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # sharing the moments less often changes the run (the reference above follows it)
    assert not torch.allclose(real[0]["adapt_every3", False][0], real[0]["adapt", False][0])
    # the two orders differ: the overlapped run is a variant, not the same trajectory
    assert not torch.allclose(real[0]["adam", True][0], real[0]["adam", False][0])


@pytest.mark.timeout(w.test_timeout())
def test_local_steps_on_real_ranks_equal_the_simulator(exchange_results):
    """``LocalSteps`` with a real communicator (compressed rounds, tracking, outer
    Nesterov) ends every rank where the single-process simulator ends it, to the bit, and
    counts the same bytes: the path a torchrun job takes is the one the benchmark measures."""
    from learned_opt.distributed.local_steps import SimulatedLocalSteps, nesterov

    stacked = w.local_start().expand(N, 6, 3).clone()
    targets = w.local_targets(N)
    sim = SimulatedLocalSteps(
        [stacked], nesterov(0.5), local_steps=w.LOCAL_H, topology=get_topology("ring", N),
        compression="topk:0.25",
    )  # fmt: skip
    for _ in range(w.LOCAL_ROUNDS * w.LOCAL_H + w.LOCAL_TAIL):
        for i in range(N):
            stacked[i].sub_(w.LOCAL_LR * (stacked[i] - targets[i]))
        sim.step()
    sim.round()  # the last, shorter round, as flush() takes it on the real ranks
    assert all(res["local_steps"]["rounds"] == w.LOCAL_ROUNDS for res in exchange_results)
    assert all(r["local_steps"]["flushed"] and not r["local_steps"]["flushed_again"]
               for r in exchange_results)  # fmt: skip
    for rank, res in enumerate(exchange_results):
        assert torch.equal(res["local_steps"]["param"], stacked[rank]), rank
        assert res["local_steps"]["bytes_sent"] == sim.ranks[rank].bytes_sent
    alone = w.local_start().expand(N, 6, 3).clone()  # the same local steps without rounds
    for _ in range(w.LOCAL_ROUNDS * w.LOCAL_H + w.LOCAL_TAIL):
        alone.sub_(w.LOCAL_LR * (alone - targets))

    def spread(x):
        return float((x - x.mean(0)).norm())

    assert spread(stacked) < 0.7 * spread(alone)  # the rounds pulled the ranks together
