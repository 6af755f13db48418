"""Per-tensor step-size adaptation (``NetConfig.lr_adapt_rate``): the formula, every layout
against the differentiable path, the NaN contract, old state and meta-training."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from learned_opt import LearnedOptimizer, LearnedOptimizerNet, MixingConfig, NetConfig
from learned_opt.config import split_config
from learned_opt.features import adapt_ceiling, adapt_log_lr, init_state
from learned_opt.meta_train.inner import InnerOptimizer
from learned_opt.orthogonal import GRAM_RATIO, is_matrix
from learned_opt.segments import FlatLayout
from learned_opt.step import flat_step, init_flat_state, momentum_snr, tensor_step

ADAPT = NetConfig(output="ortho", ortho_min_dim=16, lr_adapt_rate=0.3)
MIXING = MixingConfig()  # the gossip bounds: ceiling e^2, floor e^-2
SHAPES = [(64, 32), (64, 32), (300, 70), (5,), (3, 2), (16, 8, 3, 3), ()]


def _net(cfg: NetConfig = ADAPT, noise: float = 0.05) -> LearnedOptimizerNet:
    """A network of ``cfg`` with every entry of theta perturbed (non-trivial heads)."""
    net = LearnedOptimizerNet(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return net


def _adapt(cos_terms, g_ms=1.0, v_hat=1.0, log_lr=0.0, step=1000, cfg=ADAPT, lr=1.0):
    dot, g2, m2 = (torch.tensor(float(x)) for x in cos_terms)
    n = torch.tensor(1.0)
    v_mean = torch.tensor(v_hat * (1 - 0.999**step))
    g2 = g2 * g_ms  # g_ms scales the gradient's mean square, keeping the cosine
    dot = dot * g_ms**0.5
    return float(adapt_log_lr(torch.tensor(log_lr), dot, g2, m2, v_mean, n, step, cfg, lr))


def test_formula_moves_by_rate_times_cosine_and_clamps():
    rate = ADAPT.lr_adapt_rate
    assert _adapt((2.0, 1.0, 4.0)) == pytest.approx(rate)  # aligned: cos 1
    assert _adapt((-2.0, 1.0, 4.0)) == pytest.approx(-rate)  # opposite: cos -1
    assert _adapt((0.0, 1.0, 0.0)) == 0.0  # zero momentum (first step): no move
    assert _adapt((1.0, 1.0, 1.0), log_lr=ADAPT.lr_adapt_max) == ADAPT.lr_adapt_max
    assert _adapt((-1.0, 1.0, 1.0), log_lr=ADAPT.lr_adapt_min) == ADAPT.lr_adapt_min


@pytest.mark.parametrize("lr", [0.3, 3.0, 1e-3, 1e4])
def test_bounds_hold_the_whole_multiplier_and_contain_the_users(lr):
    lo = min(ADAPT.lr_adapt_min - math.log(lr), 0.0)
    hi = max(ADAPT.lr_adapt_max - math.log(lr), 0.0)
    up = _adapt((1.0, 1.0, 1.0), log_lr=hi + 5, lr=lr)
    down = _adapt((-1.0, 1.0, 1.0), log_lr=lo - 5, lr=lr)
    assert up == pytest.approx(hi, abs=1e-5) and down == pytest.approx(lo, abs=1e-5)
    if 1e-2 < lr < 1e2:  # within the bounds: lr * exp(log_lr) reaches them exactly
        assert lr * math.exp(up) == pytest.approx(math.exp(ADAPT.lr_adapt_max), rel=1e-5)
        assert lr * math.exp(down) == pytest.approx(math.exp(ADAPT.lr_adapt_min), rel=1e-5)
    else:  # outside: the user's own multiplier stays reachable (log_lr = 0)
        assert (lo, hi) == ((0.0, hi) if lr < 1 else (lo, 0.0))
    # a tensor multiplier (the in-place layouts pass one) gives the same bounds
    assert _adapt((1.0, 1.0, 1.0), log_lr=hi + 5, lr=torch.tensor(lr)) == pytest.approx(up)


def test_brake_slows_growth_only_when_gradients_shrink():
    rate = ADAPT.lr_adapt_rate
    brake = ADAPT.lr_adapt_brake
    # gradients at a quarter of the brake's threshold of their running RMS: a quarter
    assert _adapt((1.0, 1.0, 1.0), g_ms=(brake / 4) ** 2) == pytest.approx(rate / 4, rel=1e-4)
    # above the threshold, full rate; larger gradients than their RMS do not speed it up
    assert _adapt((1.0, 1.0, 1.0), g_ms=(2 * brake) ** 2) == pytest.approx(rate, rel=1e-4)
    assert _adapt((1.0, 1.0, 1.0), g_ms=9.0) == pytest.approx(rate, rel=1e-4)
    # and a shrinking step is never braked
    assert _adapt((-1.0, 1.0, 1.0), g_ms=(brake / 4) ** 2) == pytest.approx(-rate, rel=1e-4)


@pytest.mark.parametrize(
    "lr, variant",
    [(1.0, None), (2.0, None), (1.0, "wide"), (1.0, "ortho_ceiling")],
)
def test_the_optimizer_matches_the_differentiable_path(lr, variant):
    # at lr 2 the ceiling lr_adapt_max = 1 leaves log_lr at most 1 - log 2: reached by step
    # 3, so every layout's shifted bounds are compared. "wide": the 300 x 70 matrix takes
    # the Adam form at 40 / 70 of its step (NetConfig.adam_max_width). "ortho_ceiling":
    # the three orthogonalised matrices stop at 0.5, the other tensors grow past it
    cfg = ADAPT if lr == 1.0 else replace(ADAPT, lr_adapt_max=1.0)
    if variant == "wide":
        cfg = replace(cfg, ortho_max_dim=60, adam_max_width=40)
    if variant == "ortho_ceiling":
        cfg = replace(cfg, lr_adapt_max_ortho=0.5)
    net = _net(cfg)
    theta = {k: v.detach() for k, v in net.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in SHAPES]
    ref = [p.detach().clone() for p in params]
    states = [init_state(r) for r in ref]
    opt = LearnedOptimizer(params, net=net, lr=lr)
    for t in range(1, 7):
        grads = [0.5 * torch.randn(s, generator=gen) + 1.0 for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            s = states[i]
            p_new, m, v, log_lr = tensor_step(
                theta, cfg, ref[i], g, s["m"], s["v"], t, lr, log_lr=s["log_lr"]
            )
            ref[i], states[i] = p_new, {"m": m, "v": v, "log_lr": log_lr}
    for p, r, s in zip(params, ref, states):
        scale = float((r - 0).abs().max()) or 1.0
        # the 300 x 70 matrix iterates on its Gram matrix, which on a momentum close to rank
        # one (these biased gradients) orthogonalises the rounding of its input into unit
        # directions (see orthogonal.GRAM_RATIO): packed with the others (sums in another
        # order) it drifts from the one-tensor path by about 1e-5 a step; unbiased, by 3e-8
        shape = tuple(p.shape)
        gram = is_matrix(shape, cfg) and max(shape) >= GRAM_RATIO * min(shape)
        torch.testing.assert_close(p.detach(), r, rtol=0, atol=(1e-3 if gram else 1e-5) * scale)
        torch.testing.assert_close(opt.state[p]["log_lr"], s["log_lr"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["m"], s["m"], rtol=1e-5, atol=1e-7)
    # the gradients were biased (+1): consistent directions, so every step size grew
    assert all(float(opt.state[p]["log_lr"]) > 0 for p in params)
    if lr != 1.0:  # up to the shifted ceiling
        ceiling = cfg.lr_adapt_max - math.log(lr)
        assert max(float(opt.state[p]["log_lr"]) for p in params) == pytest.approx(ceiling)
    if variant == "ortho_ceiling":
        grown = [float(opt.state[p]["log_lr"]) for p in params]
        assert grown[:3] == pytest.approx([0.5] * 3)  # the orthogonalised matrices
        assert min(grown[3:]) > 1.0


def test_adapt_ceiling_lowers_only_orthogonalised_matrices():
    capped = replace(ADAPT, lr_adapt_max_ortho=1.5)
    ceilings = [adapt_ceiling(s, capped) for s in SHAPES]
    assert ceilings == [1.5] * 3 + [ADAPT.lr_adapt_max] * (len(SHAPES) - 3)
    assert [adapt_ceiling(s, ADAPT) for s in SHAPES] == [ADAPT.lr_adapt_max] * len(SHAPES)
    # never above lr_adapt_max, nor above the gossip ceiling under gossip
    assert adapt_ceiling((64, 32), replace(ADAPT, lr_adapt_max_ortho=9.0)) == ADAPT.lr_adapt_max
    gossip = MIXING.under_gossip(capped)
    assert adapt_ceiling((64, 32), gossip) == min(1.5, MIXING.lr_adapt_max_gossip)
    assert adapt_ceiling((5,), gossip) == MIXING.lr_adapt_max_gossip
    # the Adam form ("adam" output) has no orthogonalised matrix to cap
    adam = replace(capped, output="adam")
    assert adapt_ceiling((64, 32), adam) == ADAPT.lr_adapt_max


def _train(
    cfg: NetConfig, grads_fn, steps: int, gossip=False, mixing: MixingConfig = MIXING
) -> tuple[float, torch.Tensor]:
    p = torch.nn.Parameter(torch.zeros(50))
    opt = LearnedOptimizer([p], net=LearnedOptimizerNet(cfg, mixing))
    opt.config_transform = mixing.under_gossip if gossip else None  # as under gossip
    for t in range(steps):
        p.grad = grads_fn(t, p.detach())
        opt.step()
    return float(opt.state[p]["log_lr"]), p.detach()


def test_consistent_slope_grows_the_step_and_oscillation_shrinks_it():
    # a constant slope: the cosine stays 1, the step grows to its ceiling
    log_lr, p = _train(ADAPT, lambda t, p: torch.ones(50), 60)
    assert log_lr == pytest.approx(ADAPT.lr_adapt_max)
    adam_only, p0 = _train(NetConfig(output="ortho"), lambda t, p: torch.ones(50), 60)
    assert adam_only == 0.0  # off by default: the state stays at 0
    assert float(-p.mean()) > 20 * float(-p0.mean())  # it moved much further than Adam
    # a gradient that flips sign every step: the step shrinks to its floor
    log_lr, _ = _train(ADAPT, lambda t, p: torch.ones(50) * (-1) ** t, 60)
    assert log_lr == pytest.approx(ADAPT.lr_adapt_min)


def test_under_gossip_the_step_size_stays_within_the_gossip_bounds():
    ceiling = MIXING.lr_adapt_max_gossip
    assert 0 < ceiling < ADAPT.lr_adapt_max
    log_lr, p = _train(ADAPT, lambda t, p: torch.ones(50), 60, gossip=True)
    assert log_lr == pytest.approx(ceiling)
    alone, p_alone = _train(ADAPT, lambda t, p: torch.ones(50), 60)
    assert alone == pytest.approx(ADAPT.lr_adapt_max)
    assert float(-p_alone.mean()) > 2 * float(-p.mean())
    # under gossip the step shrinks to the higher floor
    floor = MIXING.lr_adapt_min_gossip
    assert ADAPT.lr_adapt_min < floor < 0
    log_lr, _ = _train(ADAPT, lambda t, p: torch.ones(50) * (-1) ** t, 60, gossip=True)
    assert log_lr == pytest.approx(floor)
    no_floor = MixingConfig(lr_adapt_min_gossip=ADAPT.lr_adapt_min)
    log_lr, _ = _train(
        ADAPT, lambda t, p: torch.ones(50) * (-1) ** t, 60, gossip=True, mixing=no_floor
    )
    assert log_lr == pytest.approx(ADAPT.lr_adapt_min)


def test_under_gossip_config():
    gossip = MIXING.under_gossip(ADAPT)
    assert gossip.lr_adapt_max == MIXING.lr_adapt_max_gossip
    assert gossip.lr_adapt_min == MIXING.lr_adapt_min_gossip
    assert MIXING.under_gossip(gossip) == gossip  # idempotent
    plain = NetConfig(output="ortho")  # no adaptation: nothing to change
    assert MIXING.under_gossip(plain) is plain
    # the ceiling is already lower and the floor already higher
    narrow = NetConfig(lr_adapt_rate=0.3, lr_adapt_max=1.0, lr_adapt_min=-1.0)
    assert MIXING.under_gossip(narrow) is narrow
    floor_only = NetConfig(lr_adapt_rate=0.3, lr_adapt_max=1.0)
    assert MIXING.under_gossip(floor_only).lr_adapt_max == 1.0
    assert MIXING.under_gossip(floor_only).lr_adapt_min == MIXING.lr_adapt_min_gossip
    # one flat config, as checkpoints held it before the split, without the gossip fields
    # that came later still
    old = {**ADAPT.to_dict(), **MIXING.to_dict()}
    del old["lr_adapt_max_gossip"], old["lr_adapt_min_gossip"], old["lr_adapt_rate_gossip"]
    assert split_config(old) == (ADAPT, MIXING)
    with pytest.raises(ValueError, match="unknown config fields"):
        split_config({**old, "colour": 1})
    assert gossip.lr_adapt_rate == ADAPT.lr_adapt_rate  # no gossip rate: the same rate


def test_under_gossip_the_adaptation_moves_at_its_gossip_rate():
    """``lr_adapt_rate_gossip`` sets the rate a worker adapts at under gossip and nowhere
    else: with consistent gradients the log multiplier climbs 0.1 per step alone and 0.3
    per step under gossip (the same until the ceilings)."""
    cfg, mixing = replace(ADAPT, lr_adapt_rate=0.1), MixingConfig(lr_adapt_rate_gossip=0.3)
    assert mixing.under_gossip(cfg).lr_adapt_rate == 0.3
    assert mixing.under_gossip(mixing.under_gossip(cfg)) == mixing.under_gossip(cfg)
    alone, _ = _train(cfg, lambda t, p: torch.ones(50), 6, mixing=mixing)
    mixed, _ = _train(cfg, lambda t, p: torch.ones(50), 6, gossip=True, mixing=mixing)
    base, _ = _train(replace(ADAPT, lr_adapt_rate=0.3), lambda t, p: torch.ones(50), 6, gossip=True)
    assert 0 < alone < mixed
    assert mixed == pytest.approx(base)


def test_the_momentum_snr_is_one_for_steady_gradients_and_small_for_noise():
    layout = FlatLayout(("steady", "noise"), ((64, 64), (64, 64)))
    gen = torch.Generator().manual_seed(0)
    m = torch.zeros(1, 2 * 4096, dtype=torch.float64)
    v = torch.zeros_like(m)
    steady = torch.randn(4096, generator=gen, dtype=torch.float64)
    for t in range(1, 201):
        g = torch.cat([steady, torch.randn(4096, generator=gen, dtype=torch.float64)])[None]
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        v_mean = torch.stack([v[:, :4096].mean(-1), v[:, 4096:].mean(-1)], -1)
        snr = momentum_snr(m, v_mean, t, layout)
        if t == 1:  # bias-corrected: the first step's momentum is the gradient itself
            assert snr[0].tolist() == pytest.approx([1.0, 1.0])
    assert snr[0, 0] == pytest.approx(1.0)
    assert snr[0, 1] == pytest.approx(math.sqrt(0.1 / 1.9), rel=0.1)


def test_under_gossip_matrices_step_by_their_momentum_snr():
    """``ortho_snr_gossip`` scales an orthogonalised matrix's step under gossip only: on a
    pure-noise gradient its steps shrink to about a quarter; alone they do not; a vector
    (the Adam form) is not scaled."""
    cfg, mixing = replace(ADAPT, lr_adapt_rate=0.0), MixingConfig(ortho_snr_gossip=1.0)
    assert mixing.under_gossip(cfg).ortho_snr == 1.0 and cfg.ortho_snr == 0.0
    assert mixing.under_gossip(mixing.under_gossip(cfg)) == mixing.under_gossip(cfg)
    sizes = {}
    for label, config in (("alone", cfg), ("gossip", mixing.under_gossip(cfg))):
        gen = torch.Generator().manual_seed(0)
        p = [torch.zeros(32, 32, requires_grad=True), torch.zeros(32, requires_grad=True)]
        opt = LearnedOptimizer(p, net=LearnedOptimizerNet(config), compile=False)
        for _ in range(60):
            before = [t.detach().clone() for t in p]
            for t in p:
                t.grad = torch.randn(t.shape, generator=gen)
            opt.step()
        sizes[label] = [float((t.detach() - b).square().mean().sqrt()) for t, b in zip(p, before)]
    assert 0.15 < sizes["gossip"][0] / sizes["alone"][0] < 0.4
    assert sizes["gossip"][1] == pytest.approx(sizes["alone"][1])
    with pytest.raises(ValueError, match="ortho_snr_gossip"):
        MixingConfig(ortho_snr_gossip=-1.0)


def test_simulated_workers_step_under_the_gossip_ceiling():
    """Meta-training's simulator steps as GossipOptimizer's workers do: the ceiling applies
    to a mixing run and not to a single worker."""
    from learned_opt.meta_train.inner import inner_step, make_inner_optimizer, new_trajectory
    from learned_opt.tasks import get_task

    cfg = NetConfig(output="ortho", lr_adapt_rate=1.0)
    net = LearnedOptimizerNet(cfg, MixingConfig(lr_adapt_max_gossip=0.5))
    task = get_task("logreg_synth")
    ends = {}
    for workers, mixing in ((1, "none"), (4, "metropolis")):
        opt = make_inner_optimizer("learned", net=net, mixing=mixing)
        traj = new_trajectory(task, workers, "ring", "iid", 1.0, 0, 30)
        for _ in range(30):
            inner_step(traj, opt)
        ends[workers] = float(traj.states["log_lr"].max())
    assert ends[4] == pytest.approx(0.5)
    assert ends[1] > 0.5


def test_nonfinite_gradient_leaves_the_step_size_alone():
    params = [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(7))]
    opt = LearnedOptimizer(params, net=_net())
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    before = [opt.state[p]["log_lr"].clone() for p in params]
    params[0].grad = torch.full_like(params[0], float("nan"))
    params[1].grad = torch.ones_like(params[1])
    opt.step()
    assert torch.equal(opt.state[params[0]]["log_lr"], before[0])
    assert float(opt.state[params[1]]["log_lr"]) > float(before[1])
    assert opt.nonfinite_skips == 1


def test_state_saved_without_step_sizes_still_loads_and_steps():
    p = torch.nn.Parameter(torch.randn(10))
    opt = LearnedOptimizer([p], net=_net())
    p.grad = torch.ones(10)
    opt.step()
    saved = opt.state_dict()
    del saved["state"][0]["log_lr"]  # as written before this state existed
    fresh = LearnedOptimizer([p], net=_net())
    fresh.load_state_dict(saved)
    p.grad = torch.ones(10)
    fresh.step()
    assert float(fresh.state[p]["log_lr"]) > 0


def test_flat_step_asks_for_step_sizes_when_the_config_adapts():
    net = _net()
    layout = FlatLayout(("a",), ((4,),))
    p = torch.zeros(1, 4)
    state = init_flat_state(p)
    theta = {k: v.detach() for k, v in net.named_parameters()}
    with pytest.raises(ValueError, match="needs log_lr"):
        flat_step(theta, ADAPT, layout, p, torch.ones(1, 4), state["m"], state["v"], 1)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"lr_adapt_rate": -0.1}, "lr_adapt_rate"),
        ({"lr_adapt_min": 0.5}, "lr_adapt_min"),
        ({"lr_adapt_max": -1.0}, "lr_adapt_max"),
        ({"lr_adapt_brake": 0.0}, "lr_adapt_brake"),
        ({"lr_adapt_max_gossip": -1.0}, "lr_adapt_max_gossip"),
        ({"lr_adapt_min_gossip": 0.5}, "lr_adapt_min_gossip"),
        ({"lr_adapt_min_gossip": float("nan")}, "lr_adapt_min_gossip"),
        ({"lr_adapt_rate_gossip": 0.0}, "lr_adapt_rate_gossip"),
        ({"lr_adapt_rate_gossip": float("nan")}, "lr_adapt_rate_gossip"),
        ({"lr_adapt_max_ortho": -1.0}, "lr_adapt_max_ortho"),
        ({"lr_adapt_max_ortho": float("nan")}, "lr_adapt_max_ortho"),
    ],
)
def test_bad_adaptation_settings_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        split_config(fields)  # NetConfig's fields and MixingConfig's


def test_meta_training_unrolls_the_adaptation_and_differentiates_through_it():
    net = _net()
    theta = {k: v.detach().requires_grad_() for k, v in net.named_parameters()}
    layout = FlatLayout(("w", "b"), ((20, 16), (16,)))
    opt = InnerOptimizer("learned", theta=theta, cfg=ADAPT)
    assert opt.gossip_cfg == MIXING.under_gossip(ADAPT)  # built without one: the defaults
    p = 0.1 * torch.randn(2, layout.size, generator=torch.Generator().manual_seed(0))
    state = opt.init(p, layout)
    assert state["log_lr"].shape == (2, 2)
    for step in range(1, 4):
        p, state = opt.update(layout, p, torch.ones_like(p) + p, state, step)
    assert state["log_lr"].shape == (2, 2) and bool((state["log_lr"] != 0).all())
    p.square().sum().backward()
    grads = [t.grad for t in theta.values() if t.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)


def test_tensorboard_update_response_handles_an_adapting_config():
    from learned_opt.meta_train.summaries import update_response

    theta = {k: v.detach() for k, v in _net().named_parameters()}
    curves = update_response(theta, ADAPT)
    assert curves and all(
        bool(torch.isfinite(torch.as_tensor(u)).all()) for _, u in curves.values()
    )


def test_the_single_worker_fields_hold_their_chosen_values_under_gossip():
    from learned_opt.config import SINGLE_WORKER_ONLY

    alone = replace(ADAPT, table_step_mult=4.0)
    gossip = MIXING.under_gossip(alone)
    assert {k: getattr(gossip, k) for k in SINGLE_WORKER_ONLY} == SINGLE_WORKER_ONLY
    assert MIXING.under_gossip(gossip) == gossip
