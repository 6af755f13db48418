"""Meta-training options for what carries over: train_parts, the mean_log meta-objective
and task augmentation."""

from __future__ import annotations

import math

import pytest
import torch

from learned_opt.checkpoint import load_checkpoint
from learned_opt.config import NetConfig
from learned_opt.meta_train.cli import export
from learned_opt.meta_train.data import step_seeds
from learned_opt.meta_train.estimators import PES, TBPTT, make_estimator, truncation_meta_loss
from learned_opt.meta_train.inner import inner_step, make_inner_optimizer, new_trajectory
from learned_opt.meta_train.module import MetaTrainModule, trainable_names
from learned_opt.meta_train.settings import PART_MODULES, validate_settings
from learned_opt.meta_train.slots import AugmentedTask, SlotSampler, restore_slots, serialise_slots
from learned_opt.network import LearnedOptimizerNet
from learned_opt.segments import FlatLayout
from learned_opt.step import Parts, active_parts
from learned_opt.tasks import get_family, get_task

TENSOR_ONLY = dict(
    init_checkpoint="adapt_init_2x", train_parts=["tensor"], estimator="pes", pes_pairs=1,
    tasks_per_step=1, unroll_length=3, min_length=6, max_length=6, worker_counts=[1],
    topologies=["ring"], val_tasks=["iris_mlp"], val_horizon=15, val_workers=2,
    baseline_cache=None, outer_lr=1e-2,
)  # fmt: skip


def _curve(*ratios):
    return [torch.tensor([r]) for r in ratios]


def test_mean_log_is_the_mean_of_the_clipped_log_ratios():
    losses = [torch.tensor([2.0, 0.0]), torch.tensor([float("nan"), 1.0])]
    value = truncation_meta_loss(losses, loss0=2.0, loss_clip=4.0, objective="mean_log")
    ratios = (1.0, 0.0, 4.0, 0.5)
    expected = sum(math.log(r + 1e-6) for r in ratios) / 4
    assert abs(float(value) - expected) < 1e-6


def test_mean_log_prefers_a_low_loss_reached_early_and_kept():
    early = _curve(1.0, 0.01, 0.01, 0.01)  # down at once, stays down
    flat = _curve(0.2, 0.2, 0.2, 0.2)  # a lower mean, never low
    dip = _curve(1.0, 0.01, 0.01, 1.0)  # down, then back up

    def score(curve, objective):
        return float(truncation_meta_loss(curve, 1.0, 4.0, objective))

    assert score(flat, "log_mean") < score(early, "log_mean")  # the default's ranking
    assert score(early, "mean_log") < score(flat, "mean_log")
    assert score(early, "mean_log") < score(dip, "mean_log")
    with pytest.raises(ValueError, match="meta-objective"):
        truncation_meta_loss(early, 1.0, 4.0, "median")


def test_tail_log_weighs_a_truncation_by_where_it_lies_in_its_trajectory():
    curve = _curve(0.5, 0.25)
    mean_log = float(truncation_meta_loss(curve, 1.0, 4.0, "mean_log"))
    for position in (0.05, 0.5, 0.95):
        value = float(truncation_meta_loss(curve, 1.0, 4.0, "tail_log", position))
        assert abs(value - 2 * position * mean_log) < 1e-6
    # over a trajectory's truncations the weights average one: the same curve everywhere
    # scores as mean_log does, and a rule that ends lower beats one that starts lower
    positions = [(k + 0.5) / 4 for k in range(4)]
    total = sum(float(truncation_meta_loss(curve, 1.0, 4.0, "tail_log", q)) for q in positions)
    assert abs(total / 4 - mean_log) < 1e-6
    fast_then_flat = [_curve(0.1, 0.1), _curve(0.1, 0.1), _curve(0.1, 0.1), _curve(0.1, 0.1)]
    slow_then_low = [_curve(0.5, 0.5), _curve(0.2, 0.2), _curve(0.05, 0.05), _curve(0.02, 0.02)]

    def run_score(truncations, objective):
        return sum(
            float(truncation_meta_loss(c, 1.0, 4.0, objective, q))
            for c, q in zip(truncations, positions)
        )

    assert run_score(fast_then_flat, "mean_log") < run_score(slow_then_low, "mean_log")
    assert run_score(slow_then_low, "tail_log") < run_score(fast_then_flat, "tail_log")


def test_the_unroll_tells_the_objective_where_its_truncation_lies(one_param_task):
    from learned_opt.meta_train import estimators

    seen = []
    real = estimators.truncation_meta_loss
    estimators.truncation_meta_loss = lambda *a: seen.append(a[-1]) or real(*a)
    try:
        traj = new_trajectory(one_param_task, 1, "ring", "iid", 1.0, 0, 8)
        opt = make_inner_optimizer("adam", lr=0.1)
        for _ in range(2):
            estimators.unroll(traj, opt, 4, 4.0, objective="tail_log")
    finally:
        estimators.truncation_meta_loss = real
    assert seen == [0.25, 0.75]


def test_estimators_touch_only_the_trainable_parameters(one_param_task):
    torch.manual_seed(0)
    net = LearnedOptimizerNet(NetConfig(width=8)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))  # every head non-zero
    names = [n for n, _ in net.named_parameters()]
    wanted = trainable_names(net, ["tensor"])
    assert wanted == {n for n in names if n.startswith("tensor_")}
    opt = make_inner_optimizer("learned", lr=30.0, net=net)

    def run(est):
        traj = new_trajectory(one_param_task, 1, "ring", "iid", 1.0, 0, 100)
        return dict(zip(names, est.estimate(net, opt, [est.particles(traj)], 6)[1]))

    full, part = run(TBPTT()), run(TBPTT(trainable=wanted))
    pes = run(PES(pes_sigma=1e-3, pes_pairs=2, trainable=wanted))
    for n in names:
        if n in wanted:
            assert torch.allclose(part[n], full[n]), n
            assert pes[n].abs().sum() > 0, n
        else:
            assert not part[n].any() and not pes[n].any(), n
    assert any(full[n].any() for n in names if n not in wanted)


@pytest.mark.parametrize(
    "field, value",
    [
        ("train_parts", ["tensor", "mixing"]), ("train_parts", []), ("train_parts", "tensor"),
        ("train_parts", ["tensor", "tensor"]), ("meta_objective", "median"),
        ("augment_loss_scale", 0.5), ("augment_init_scale", "2"),
        ("scheduled_fraction", 1.5), ("scheduled_fraction", "half"),
    ],
)  # fmt: skip
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"field {field!r}"):
        MetaTrainModule(**{**TENSOR_ONLY, field: value})


def test_defaults_train_every_part_with_the_old_objective():
    module = MetaTrainModule(**{**TENSOR_ONLY, "train_parts": list(PART_MODULES)})
    assert module.trainable == {n for n, _ in module.net.named_parameters()}
    assert module.estimator.trainable is None
    defaults = MetaTrainModule(tasks_per_step=1, baseline_cache=None, val_tasks=["iris_mlp"])
    assert defaults.settings.train_parts == list(PART_MODULES)
    assert defaults.settings.meta_objective == "log_mean"
    assert defaults.estimator.objective == "log_mean"


def test_tensor_only_run_keeps_the_element_head_zero_and_exports_the_cheap_path(
    monkeypatch, tmp_path
):
    module = MetaTrainModule(**TENSOR_ONLY)
    start = {k: v.clone() for k, v in module.net.state_dict().items()}
    assert module.unroll_parts() == Parts(tensor_net=True, element_net=False)
    outer = module.configure_optimizers()
    monkeypatch.setattr(module, "optimizers", lambda: outer)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    for step in range(3):
        module.training_step(step_seeds(0, step, 1), step)
    assert module.skipped_steps == 0
    for name, value in module.net.state_dict().items():
        moved = not torch.equal(value, start[name])
        assert moved == name.startswith("tensor_"), name
    ckpt = {"state_dict": {f"net.{k}": v for k, v in module.net.state_dict().items()}}
    module.on_save_checkpoint(ckpt)
    ckpt["hyper_parameters"] = dict(module.hparams)
    torch.save(ckpt, tmp_path / "last.ckpt")
    net, _ = load_checkpoint(export(str(tmp_path / "last.ckpt"), tmp_path / "t.pt", False))
    assert active_parts(net.theta()) == Parts(tensor_net=True, element_net=False)
    assert not net.elem_out.weight.any() and not net.elem_out.bias.any()


def _settings(**extra):
    module = MetaTrainModule(**{**TENSOR_ONLY, **extra})
    return validate_settings(dict(module.hparams))


def test_augmented_task_scales_the_loss_and_each_initial_tensor():
    task = get_task("iris_mlp")
    aug = AugmentedTask(task, loss_scale=7.0, init_scale=2.0, init_seed=3)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    base, scaled = task.init(gen()), aug.init(gen())
    factors = {k: float(scaled[k].norm() / base[k].norm()) for k in base if base[k].any()}
    assert all(0.5 - 1e-6 <= f <= 2.0 + 1e-6 for f in factors.values())
    assert len({round(f, 6) for f in factors.values()}) > 1  # one factor per tensor
    for k in base:
        assert torch.allclose(scaled[k], base[k] * factors.get(k, 1.0))
    assert all(torch.equal(aug.init(gen())[k], scaled[k]) for k in base)  # seeded
    batch = task.worker_batches(0, 1, "iid", 1.0).get(0)
    one = tuple(t[0] for t in batch)
    assert torch.allclose(aug.loss(base, one), 7.0 * task.loss(base, one))
    assert aug.name == task.name and aug.describe() == task.describe()


def test_sampler_augments_tasks_and_slots_keep_their_augmentation():
    family = get_family("mlp_family")
    plain = SlotSampler(family, _settings()).sample(5)
    assert not isinstance(plain.task, AugmentedTask)
    bounds = dict(augment_loss_scale=100.0, augment_init_scale=2.0)
    trajs = [SlotSampler(family, _settings(**bounds)).sample(seed) for seed in (5, 6, 7)]
    first = trajs[0]
    assert isinstance(first.task, AugmentedTask)
    assert first.task.describe() == plain.task.describe() and first.length == plain.length
    scales = [t.task.loss_scale for t in trajs]
    assert all(0.01 <= s <= 100.0 for s in scales) and len(set(scales)) == 3
    (restored,) = restore_slots(serialise_slots([[first]]), make_estimator("pes"))
    assert restored[0].task.augmentation() == first.task.augmentation()
    batch = first.batches.get(0)
    params = first.layout.unflatten(first.params)
    one = (tuple(t[0] for t in batch), {k: v[0] for k, v in params.items()})
    assert torch.allclose(restored[0].task.loss(one[1], one[0]), first.task.loss(one[1], one[0]))


def test_a_scheduled_trajectory_steps_as_a_deployed_optimizer_under_wsd_schedule():
    """A scheduled trajectory's multiplier is held, then decays linearly to 0 over the
    last half of its length: its unrolled steps equal the shipped rule's under
    ``wsd_schedule`` of that length (the adaptation's bounds follow the multiplier
    there too), and they differ from a held multiplier's once the decay begins."""
    from learned_opt import LearnedOptimizer, wsd_schedule

    net, _ = load_checkpoint("adapt_init_2x")
    task, length = get_task("iris_mlp"), 8
    runs = {}
    for scheduled in (False, True):
        traj = new_trajectory(task, 1, "ring", "iid", 1.0, 0, length, scheduled=scheduled)
        opt = make_inner_optimizer("learned", net=net, mixing="none")
        with torch.no_grad():
            for _ in range(length - 1):
                inner_step(traj, opt)
        runs[scheduled] = traj
    module = task.load_params(task.module(), task.init(torch.Generator().manual_seed(0)))
    deployed = LearnedOptimizer(module.parameters(), net=net, compile=False)
    schedule = wsd_schedule(deployed, length)
    for step in range(length - 1):
        deployed.zero_grad()
        task.module_loss(module, runs[True].batches.worker(step, 0)).backward()
        deployed.step()
        schedule.step()
    got = runs[True].layout.unflatten(runs[True].params[0])
    for name, p in module.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-6)
    assert (runs[False].params - runs[True].params).abs().max() > 1e-4


def test_the_sampler_schedules_its_share_of_trajectories_and_slots_keep_the_mark():
    family = get_family("mlp_family")
    plain = [SlotSampler(family, _settings()).sample(seed) for seed in range(8)]
    assert not any(t.scheduled for t in plain)
    mixed = [SlotSampler(family, _settings(scheduled_fraction=0.5)).sample(s) for s in range(8)]
    assert 0 < sum(t.scheduled for t in mixed) < 8
    assert [t.task.describe() for t in mixed] == [t.task.describe() for t in plain]
    assert [t.length for t in mixed] == [t.length for t in plain]  # the other draws unchanged
    marked = next(t for t in mixed if t.scheduled)
    (restored,) = restore_slots(serialise_slots([[marked]]), make_estimator("pes"))
    assert restored[0].scheduled
    old = serialise_slots([[marked]])
    del old[0][0]["scheduled"]  # slots saved before schedules
    assert not restore_slots(old, make_estimator("pes"))[0][0].scheduled


def test_inner_state_keeps_the_momenta_its_parts_read():
    """A fresh inner state holds the momenta the step reads (``moment_rows``), as a deployed
    optimizer's does: one for a rule that evaluates no network (so that under gossip the
    shared state mixed is the deployed one), all three when a network is evaluated."""
    net, _ = load_checkpoint("adapt_init_2x")
    layout = FlatLayout(("w", "b"), ((4, 3), (4,)))
    p = torch.randn(2, 16)
    lean = make_inner_optimizer("learned", net=net, parts=Parts(False, False))
    assert lean.init(p, layout)["m"].shape == (2, 1, 16)
    assert make_inner_optimizer("learned", net=net).init(p, layout)["m"].shape == (2, 3, 16)
    sparse = FlatLayout(("emb",), ((8, 2),), (True,))
    assert lean.init(p, sparse)["m"].shape == (2, 2, 16)  # a table reads the 0.99 momentum too
    new_p, new = lean.update(layout, p, torch.randn(2, 16), lean.init(p, layout), 1, gossip=True)
    assert new["m"].shape == (2, 1, 16) and not torch.equal(new_p, p)


def test_inner_step_without_networks_keeps_the_momenta_it_does_not_read():
    """An inner learned step that evaluates no network, handed a state with all three
    momenta (one carried over from a rule that read them), updates the 0.9 momentum and
    hands the other two rows back unchanged, so the unroll's state keeps its shape."""
    net, _ = load_checkpoint("adapt_init_2x")
    inner = make_inner_optimizer("learned", net=net, parts=Parts(False, False))
    layout = FlatLayout(("w", "b"), ((4, 3), (4,)))
    p = torch.randn(2, 16)
    state = make_inner_optimizer("learned", net=net).init(p, layout)
    state["m"][:, 1:] = 0.5
    new_p, new = inner.update(layout, p, torch.randn(2, 16), state, 1)
    assert new["m"].shape == state["m"].shape
    assert torch.equal(new["m"][:, 1:], state["m"][:, 1:]) and new["m"][:, 0].abs().max() > 0
    assert not torch.equal(new_p, p)


def test_evaluation_inner_optimizer_evaluates_only_nonzero_networks_with_the_same_values():
    """``make_inner_optimizer(parts=None)`` (the benchmarks' evaluation runs) evaluates the
    networks whose heads are not zero, as a deployed optimizer does, and steps exactly as
    the optimizer that evaluates every part."""
    net, _ = load_checkpoint("adapt_init_2x")
    lean = make_inner_optimizer("learned", net=net, mixing="learned", parts=None)
    full = make_inner_optimizer("learned", net=net, mixing="learned")
    assert lean.parts == Parts(False, False) and full.parts == Parts(True, True)
    layout = FlatLayout(("w", "b"), ((24, 20), (24,)))
    torch.manual_seed(0)
    p = torch.randn(3, 504)
    states = [opt.init(p, layout) for opt in (lean, full)]
    for step in (1, 2, 3):
        g = torch.randn(3, 504)
        (p_lean, states[0]), (p_full, states[1]) = (
            opt.update(layout, p, g, state, step, gossip=True)
            for opt, state in zip((lean, full), states)
        )
        assert torch.equal(p_lean, p_full)
        assert torch.equal(states[0]["m"][:, 0], states[1]["m"][:, 0])
        p = p_lean
    trained = LearnedOptimizerNet(net.config)
    with torch.no_grad():
        trained.elem_out.bias.fill_(0.1)
    assert make_inner_optimizer("learned", net=trained, parts=None).parts.element_net


def test_simulated_workers_keep_gram_polynomials_as_a_deployed_optimizer_does(one_thread):
    """Under ``NetConfig.ns_every`` each simulated worker keeps its matrices' Gram
    polynomials (``q``, flat, in segment order) and steps as a ``LearnedOptimizer`` of the
    same rule, row by row (the 64 x 72 matrix keeps one; the 8 x 72 one and the vector
    do not). At one thread: with more, a stacked product and a single one may split their
    work differently, and the polynomial of a near-singular Gram matrix amplifies that
    rounding (1.5e-3 relative on some entries of ``q`` at two threads on a loaded machine,
    the parameters still within 1e-5)."""
    from learned_opt import LearnedOptimizer

    net, _ = load_checkpoint("adapt_init_2x")
    assert net.config.ns_every == 2 and net.config.ns_reuse_min_dim == 64
    inner = make_inner_optimizer("learned", net=net, parts=None)
    shapes = ((64, 72), (8, 72), (72,))
    layout = FlatLayout(("w", "v", "b"), shapes)
    gen = torch.Generator().manual_seed(0)
    p = 0.1 * torch.randn(2, layout.size, generator=gen)
    state = inner.init(p, layout)
    assert state["q"].shape == (2, 64 * 64)
    params = [torch.nn.Parameter(t.reshape(s).clone()) for t, s in
              zip(p[1].split(layout.numels), shapes)]  # fmt: skip
    deployed = LearnedOptimizer(params, net=net, compile=False)
    for step in range(1, 5):
        g = torch.randn(2, layout.size, generator=gen)
        p, state = inner.update(layout, p, g, state, step)
        for t, gt in zip(params, g[1].split(layout.numels)):
            t.grad = gt.reshape(t.shape).clone()
        deployed.step()
        flat = torch.cat([t.detach().reshape(-1) for t in params])
        torch.testing.assert_close(p[1], flat, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["q"][1].reshape(64, 64), deployed.state[params[0]]["q"])


def test_embedding_tables_take_the_step_a_deployed_optimizer_gives_them():
    """A trajectory marks its tensors ``sparse_rows`` as ``LearnedOptimizer`` does on their
    first gradient, so the unrolled rule steps a recommender's tables as deployed."""
    from learned_opt import LearnedOptimizer
    from learned_opt.tasks import Task, TaskSpec

    task = Task(TaskSpec("mf", "ratings_synth", (16,), batch_size=64))
    net, _ = load_checkpoint("adapt_init_2x")
    traj = new_trajectory(task, 1, "ring", "iid", 1.0, 0, 10)
    marks = dict(zip(traj.layout.names, traj.layout.sparse_rows))
    assert marks == {"user.weight": True, "item.weight": True, "user_bias.weight": True,
                     "item_bias.weight": True, "bias": False}  # fmt: skip
    unmarked = new_trajectory(task, 1, "ring", "iid", 1.0, 0, 10)
    unmarked.layout = FlatLayout(unmarked.layout.names, unmarked.layout.shapes)
    module = task.load_params(task.module(), task.init(torch.Generator().manual_seed(0)))
    deployed = LearnedOptimizer(module.parameters(), compile=False)
    opt = make_inner_optimizer("learned", net=net, parts=None)
    for step in range(3):
        with torch.no_grad():
            inner_step(traj, opt)
            inner_step(unmarked, opt)
        deployed.zero_grad()
        task.module_loss(module, traj.batches.worker(step, 0)).backward()
        deployed.step()
    got = traj.layout.unflatten(traj.params[0])
    for name, p in module.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-6)
    table = unmarked.layout.unflatten(unmarked.params[0])["user.weight"]
    assert (table - got["user.weight"]).abs().max() > 1e-3  # orthogonalised otherwise
