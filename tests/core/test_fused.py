"""The fused layout: one pass per tensor, compiled by torch.compile (``learned_opt._fused``).

Fast tests run its math uncompiled (``fused="eager"``): the same function that is
compiled. Tests that compile are ``slow`` (the first compile takes tens of seconds).
"""

from __future__ import annotations

import logging

import pytest
import torch
from optim_table import perturbed_net, spy_layouts

from learned_opt import LearnedOptimizer, _compiled, _fused, _operands, functional
from learned_opt.features import init_state
from learned_opt.flat import tensor_step
from learned_opt.network import element_layers, element_mlp, element_mlp_rows


def _inputs(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [(0.05 * torch.randn(s, generator=gen)).to(dtype) for s in shapes]
    grads = [(1e-2 * torch.randn(s, generator=gen)).to(dtype) for s in shapes]
    states = []
    for p in params:
        s = init_state(p)
        s["m"].copy_(1e-2 * torch.randn(s["m"].shape, generator=gen))
        s["v"].copy_(1e-4 * torch.rand(s["v"].shape, generator=gen))
        states.append(s)
    return params, grads, states


def _clone(params, states):
    return [p.clone() for p in params], [{k: v.clone() for k, v in s.items()} for s in states]


def test_straight_line_mlp_equals_the_matrix_form():
    net = perturbed_net(16)
    theta, cfg = net.theta(), net.config
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 300, generator=gen)
    scales = torch.rand(1, 11, generator=gen) + 0.5
    bias = torch.randn(1, cfg.width, 1, generator=gen)
    layers = element_layers(theta, cfg, torch.float32, bias, scales)
    layers = ((layers[0][0][0], layers[0][1][0]), *layers[1:])
    d, a = element_mlp(layers, x)
    d2, a2 = element_mlp_rows(layers, list(x))
    torch.testing.assert_close(d2, d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a2, a, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_matches_the_pure_step(dtype):
    """Every dtype, bf16 parameters and gradients with float32 state included."""
    net = perturbed_net()
    params, grads, states = _inputs([(40, 30), (7, 3, 5)], dtype)
    new_p, new_s = _clone(params, states)
    theta = {k: v.to(states[0]["v"].dtype) for k, v in net.theta().items()}
    assert _fused.fused_step_(theta, net.config, new_p, grads, new_s, 7, 0.6, compiled=False) == [
        True,
        True,
    ]
    for p, g, s, p1, s1 in zip(params, grads, states, new_p, new_s):
        ref_p, ref_m, ref_v = tensor_step(theta, net.config, p, g, s["m"], s["v"], 7, 0.6)
        assert p1.dtype == dtype and s1["v"].dtype == states[0]["v"].dtype
        update = (ref_p.double() - p.double()).abs().max()
        tol = 1e-5 * update if dtype != torch.bfloat16 else 0.01 * p.double().abs().max()
        assert (p1.double() - ref_p.double()).abs().max() <= tol
        torch.testing.assert_close(s1["m"], ref_m, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(s1["v"], ref_v, rtol=1e-5, atol=1e-10)


def test_fused_step_is_bitwise_repeatable():
    net = perturbed_net()
    params, grads, states = _inputs([(50, 20), (300,)])
    runs = []
    for _ in range(2):
        p, s = _clone(params, states)
        _fused.fused_step_(net.theta(), net.config, p, grads, s, 3, 1.0, compiled=False)
        runs.append((p, s))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)


def test_cached_operands_follow_the_state_and_are_dropped_with_it():
    """The momentum rows are cached per tensor on the state's memory; a state replaced (as
    ``load_state_dict`` does) gets new rows, and a freed state leaves no entry behind."""
    (p,), (g,), (state,) = _inputs([(6, 5)])
    p_flat, _, m0, m1, m2, v_flat = _operands.operands(p, g, state)
    n = p.numel()
    assert [r.data_ptr() for r in (m0, m1, m2)] == [
        state["m"].data_ptr() + 4 * k * n for k in range(3)
    ]
    assert p_flat.data_ptr() == p.data_ptr() and v_flat.data_ptr() == state["v"].data_ptr()
    m2.fill_(7.0)  # writes reach the state
    assert torch.equal(state["m"][2], torch.full_like(p, 7.0))
    state["m"] = state["m"].clone()
    rows = _operands.operands(p, g, state)[2:5]
    assert rows[0].data_ptr() == state["m"].data_ptr()
    key = id(state["m"])
    assert key in _operands._operand_cache
    del state, rows, m0, m1, m2
    assert key not in _operands._operand_cache


def test_dispatch_fuses_large_tensors_and_packs_small_ones(monkeypatch):
    """Small tensors join the fused step, packed (two or more); a lone one is packed alone."""
    seen = spy_layouts(monkeypatch, ("fused", "packed", "stacked", "chunked"))
    net = perturbed_net()
    params, grads, states = _inputs([(64, 32), (32, 64), (5,), (3, 2)])
    oks = functional.learned_step(
        net.theta(), net.config, params, grads, states, 1, small_tensor_size=100, fused="eager"
    )
    assert oks == [True] * 4
    assert seen == {
        "fused": [[(3, 2), (5,), (32, 64), (64, 32)]],
        "packed": [],
        "stacked": [],
        "chunked": [],
    }
    params, grads, states = _inputs([(64, 32), (5,)])
    functional.learned_step(
        net.theta(), net.config, params, grads, states, 1, small_tensor_size=100, fused="eager"
    )
    assert seen["fused"][1:] == [[(64, 32)]] and seen["packed"] == [[(5,)]]


def _ortho_net(seed: int = 0):
    """The shipped single-worker rule's config (``adapt_init``: orthogonalised matrices,
    adapted step sizes) with a perturbed theta, so every head is non-trivial."""
    from learned_opt import LearnedOptimizerNet, NetConfig

    cfg = NetConfig(
        output="ortho", ortho_min_dim=16, max_log_scale=3.0, lr_adapt_rate=0.3, adam_max_width=256
    )
    net = LearnedOptimizerNet(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return net


def _ortho_inputs(shapes, dtype=torch.float32, seed=0):
    params, grads, states = _inputs(shapes, dtype, seed)
    for k, s in enumerate(states):
        s["log_lr"] = torch.full((), 0.1 * k - 0.2)
    return params, grads, states


def test_ortho_matrices_are_fused_and_other_whole_tensor_outputs_stacked(monkeypatch):
    """ "ortho" matrices take the fused step (direction pass, then Newton-Schulz); a
    non-contiguous one, and the other tensors of a config that normalises whole tensors,
    the stacked path."""
    from learned_opt import LearnedOptimizerNet, NetConfig

    seen = spy_layouts(monkeypatch, ("fused", "packed", "stacked", "chunked"))
    net = LearnedOptimizerNet(NetConfig(output="ortho"))
    params, grads, states = _inputs([(64, 32), (4000, 2, 3), (32, 64)])
    params[2] = params[2].t()  # a (64, 32) view, not contiguous
    grads[2] = grads[2].t()
    states[2] = {k: v.transpose(-1, -2) if v.dim() else v for k, v in states[2].items()}
    functional.learned_step(
        net.theta(), net.config, params, grads, states, 1, small_tensor_size=0, fused="eager"
    )
    assert seen["fused"] == [[(64, 32), (4000, 2, 3)]] and seen["stacked"] == [[(64, 32)]]
    net = LearnedOptimizerNet(NetConfig(output="ortho", normalize=True))
    params, grads, states = _inputs([(64, 32), (4000, 2, 3)])
    functional.learned_step(
        net.theta(), net.config, params, grads, states, 1, small_tensor_size=0, fused="eager"
    )
    # a matrix's direction is orthogonalised whatever ``normalize`` says
    assert seen["fused"][1:] == [[(64, 32)]] and seen["stacked"][1:] == [[(4000, 2, 3)]]
    with pytest.raises(ValueError, match="need their whole tensor"):
        _fused.fused_step_(net.theta(), net.config, params, grads, states, 1, compiled=False)


def test_fused_ortho_step_matches_the_pure_step():
    """Matrices (batched with those of the same or the transposed shape), vectors, a
    kernel: each to 1e-5 of its update, with the adapted step sizes; a matrix with a NaN
    gradient is skipped."""
    net = _ortho_net()
    theta, cfg = net.theta(), net.config
    shapes = [(64, 32), (40, 17), (300,), (7, 3, 5), (32, 64), (20, 16), (16, 16), (64, 32)]
    params, grads, states = _ortho_inputs(shapes)
    grads[5].view(-1)[3] = float("nan")
    new_p, new_s = _clone(params, states)
    flags = _fused.fused_step_(theta, cfg, new_p, grads, new_s, 7, 0.6, compiled=False)
    assert flags == [i != 5 for i in range(len(shapes))]
    for p, g, s, p1, s1 in zip(params, grads, states, new_p, new_s):
        ref_p, ref_m, ref_v, ref_lr = tensor_step(
            theta, cfg, p, g, s["m"], s["v"], 7, 0.6, s["log_lr"]
        )
        update = (ref_p - p).abs().max()
        assert (p1 - ref_p).abs().max() <= 1e-5 * update or update == 0
        torch.testing.assert_close(s1["m"], ref_m, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(s1["v"], ref_v, rtol=1e-5, atol=1e-10)
        torch.testing.assert_close(s1["log_lr"], ref_lr, rtol=1e-6, atol=1e-7)
    assert torch.equal(new_p[5], params[5]) and torch.equal(new_s[5]["m"], states[5]["m"])


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_bad_fused_values_are_refused(bad):
    with pytest.raises(ValueError, match="Invalid fused"):
        LearnedOptimizer([torch.nn.Parameter(torch.zeros(3))], fused=bad)


def test_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("LEARNED_OPT_FUSED", "maybe")
    net = perturbed_net()
    params, grads, states = _inputs([(64, 32)])
    with pytest.raises(ValueError, match="LEARNED_OPT_FUSED"):
        functional.learned_step(
            net.theta(), net.config, params, grads, states, 1, small_tensor_size=0
        )


def test_compiled_pass_hands_its_head_on_as_flat_tensors():
    """What a compiled pass traces: the layers or theta flattened, then rebuilt for the pass
    (no compile here)."""
    seen = []

    def fn(head, x):
        seen.append(head)
        return x + 1, x

    pairs = ((torch.ones(2, 3), torch.zeros(2, 1)), (torch.ones(1, 2), torch.zeros(1, 1)))
    layered = _compiled.CompiledPass(fn, {}, dims=(), head="layers")
    layered.names = (2,)
    out = layered.flat(*[t for pair in pairs for t in pair], torch.zeros(3))
    assert seen[0] == pairs and len(out) == 2 and torch.equal(out[0], torch.ones(3))
    theta = {"a": torch.ones(2), "b": torch.zeros(1)}
    by_name = _compiled.CompiledPass(fn, {}, dims=((None,),), head="theta")
    by_name.names = tuple(theta)
    by_name.flat(*theta.values(), torch.zeros(3))
    assert seen[1] == theta
    assert _compiled._prime_above(32) == 37 and _compiled._prime_above(37) == 41


def test_constants_built_while_a_pass_is_traced_are_not_cached():
    """A compiled pass is traced by make_fx; a constant first built then must not stay in
    the cache as the tracer's placeholder (every eager step after it would read it)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from learned_opt.features import constant

    values = (1.25, -3.5, 7.0)  # in no other test
    cpu = torch.device("cpu")
    make_fx(lambda x: x * constant(values, torch.float32, cpu), tracing_mode="symbolic")(
        torch.ones(3)
    )
    c = constant(values, torch.float32, cpu)
    assert type(c) is torch.Tensor and c.tolist() == list(values)


def test_a_failing_compile_falls_back_to_the_eager_path_with_one_warning(monkeypatch, caplog):
    class InductorError(RuntimeError):  # what inductor raises when no C++ compiler works
        __module__ = "torch._inductor.exc"

    def broken(cfg):
        def fn(*args):
            raise InductorError("no working C++ compiler")

        return _compiled.Passes(*[fn] * len(_compiled.Passes._fields))  # every pass fails

    monkeypatch.setattr(_fused, "_compiled_for", broken)
    monkeypatch.setattr(_fused, "_failure", [])
    monkeypatch.setattr(_fused, "_announced", set())
    net = perturbed_net()
    params, grads, states = _inputs([(64, 32), (40, 50)])
    ref_p, ref_s = _clone(params, states)
    functional.learned_step(
        net.theta(), net.config, ref_p, grads, ref_s, 2, small_tensor_size=0, fused=False
    )
    with caplog.at_level(logging.INFO, logger="learned_opt"):
        for _ in range(2):
            p, s = _clone(params, states)
            oks = functional.learned_step(
                net.theta(), net.config, p, grads, s, 2, small_tensor_size=0, fused=True
            )
            assert oks == [True, True]
            for a, b in zip(p, ref_p):
                assert torch.equal(a, b)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no working C++ compiler" in warnings[0].getMessage()
    assert _fused.compile_failure() is not None


# ------------------------------------------------------------------------- compiled (slow)
def _assert_compiled_runs_agree(runs, params, dtype):
    """``runs``: ``(params, states)`` uncompiled, then compiled twice: the compiled runs
    are bitwise the same, and equal the uncompiled one to 1e-5 of the update (float32)."""
    for a, b, c, p0 in zip(runs[0][0], runs[1][0], runs[2][0], params):
        assert torch.equal(b, c)
        if dtype == torch.float32:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * (a - p0).abs().max())
        else:
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-4)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(b["m"], a["m"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(b["v"], a["v"], rtol=1e-5, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fused_step_matches_eager_without_recompiling(dtype):
    """Compiled once per dtype: new sizes (of tensors, and of packs of small tensors),
    steps and lrs reuse the code; the result equals the uncompiled math to 1e-5 of the
    update and repeats bitwise; a tensor with a NaN gradient, packed or not, is skipped."""
    net = perturbed_net()
    theta = net.theta()
    passes = _compiled.compiled_for(net.config)
    built = {name: len(getattr(passes, name).built) for name in passes._fields}
    cases = [
        [(64, 32), (300,), (5,), (7, 3)],
        [(100, 7), (33, 3, 3), (11,), (2,), (3,), (40,)],
        [(17,), (2, 2), (8, 8), *[(11,)] * 12],
    ]
    for k, shapes in enumerate(cases):
        params, grads, states = _inputs(shapes, dtype, seed=k)
        bad = {1: 2, 2: 1}.get(k)  # a packed tensor, then a tensor of its own
        if bad is not None:
            grads[bad].view(-1)[0] = float("nan")
        runs = []
        for compiled in (False, True, True):
            p, s = _clone(params, states)
            flags = _fused.fused_step_(
                theta, net.config, p, grads, s, 3 + k, 0.5 + k, compiled=compiled,
                small_tensor_size=64,
            )  # fmt: skip
            assert flags == [i != bad for i in range(len(shapes))]
            runs.append((p, s))
        _assert_compiled_runs_agree(runs, params, dtype)
        assert torch.equal(runs[1][0][bad or 0], params[bad or 0]) or bad is None
    # the reduction and update passes, of one tensor and of packed ones: each compiled once
    # (packed ones in the compute dtype: float32 for bf16 parameters too)
    grown = {name: len(getattr(passes, name).built) - n for name, n in built.items()}
    assert grown["sums"] == grown["update"] == 1 and grown["update_threaded"] == 0, grown
    assert grown["sums_packed"] == grown["update_packed"] <= 1, grown


@pytest.mark.slow
def test_threaded_update_pass_is_bitwise_the_single_threaded_one(monkeypatch):
    """Large tensors on a free machine take the OpenMP update pass: same bits."""
    monkeypatch.setattr(_fused, "machine_is_free", lambda threads: True)
    net = perturbed_net()
    params, grads, states = _inputs([(_fused.PARALLEL_SIZE + 5,), (300,)])
    runs = []
    for threads in (1, 2):
        p, s = _clone(params, states)
        _fused.fused_step_(net.theta(), net.config, p, grads, s, 4, 1.0, threads=threads)
        runs.append((p, s))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a["m"], b["m"]) and torch.equal(a["v"], b["v"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ortho_step_matches_eager_and_repeats(dtype, monkeypatch):
    """The compiled direction pass (on one thread and on a team): the same as the
    uncompiled math to 1e-5 of the update, bitwise repeatable, compiled once."""
    monkeypatch.setattr(_fused, "machine_is_free", lambda threads: True)
    net = _ortho_net(1)
    theta, cfg = net.theta(), net.config
    passes = _compiled.compiled_for(cfg)
    shapes = [(64, 32), (40, 17), (300,), (32, 64), (256, 160), (9,)]
    params, grads, states = _ortho_inputs(shapes, dtype)
    runs = []
    for compiled, threads in ((False, 1), (True, 2), (True, 2)):
        p, s = _clone(params, states)
        flags = _fused.fused_step_(theta, cfg, p, grads, s, 5, 0.7, compiled=compiled,
                                   threads=threads, small_tensor_size=64)  # fmt: skip
        assert flags == [True] * len(shapes)
        runs.append((p, s))
    _assert_compiled_runs_agree(runs, params, dtype)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(b["log_lr"], a["log_lr"], rtol=1e-6, atol=1e-7)
    assert len(passes.direction.built) == len(passes.direction_threaded.built) >= 1
