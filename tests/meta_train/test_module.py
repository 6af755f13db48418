"""MetaTrainModule: config validation, NaN meta-steps, flat step agreement, seeds."""

from __future__ import annotations

import pytest
import torch

from learned_opt.config import NetConfig
from learned_opt.meta_train.data import step_seeds
from learned_opt.meta_train.evaluation import speedup
from learned_opt.meta_train.module import MetaTrainModule
from learned_opt.network import LearnedOptimizerNet
from learned_opt.segments import FlatLayout
from learned_opt.step import flat_step, init_flat_state, tensor_step

SMALL = dict(
    tasks_per_step=1, unroll_length=3, min_length=6, max_length=6, worker_counts=[2],
    topologies=["ring"], val_tasks=["iris_mlp"], val_horizon=15, val_workers=2,
    baseline_cache=None,
)  # fmt: skip


@pytest.mark.parametrize(
    "field, value",
    [
        ("family", "nope"), ("estimator", "sgd"), ("topologies", ["hypercube"]),
        ("val_tasks", ["nope"]), ("unroll_length", 0), ("val_horizon", 5),
        ("worker_counts", [0]), ("partitions", ["random"]), ("min_length", 100),
        ("decentralized_score", "median"),
    ],
)  # fmt: skip
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MetaTrainModule(**{**SMALL, field: value})


def test_nan_meta_gradient_skips_the_outer_step(monkeypatch):
    module = MetaTrainModule(**SMALL)
    opt = torch.optim.Adam(module.net.parameters(), lr=1e-3)
    monkeypatch.setattr(module, "optimizers", lambda: opt)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    before = {k: v.clone() for k, v in module.net.state_dict().items()}

    def nan_estimate(net, inner, slots, steps, infos=None):
        return torch.tensor(float("nan")), [
            torch.full_like(p, float("nan")) for p in net.parameters()
        ]

    monkeypatch.setattr(module.estimator, "estimate", nan_estimate)
    module.training_step(step_seeds(0, 0, 1), 0)
    assert module.skipped_steps == 1
    for k, v in module.net.state_dict().items():
        assert torch.equal(v, before[k]), k
    monkeypatch.undo()
    monkeypatch.setattr(module, "optimizers", lambda: opt)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    module.training_step(step_seeds(0, 1, 1), 1)
    assert module.skipped_steps == 1
    assert any(not torch.equal(v, before[k]) for k, v in module.net.state_dict().items())


def test_flat_step_equals_tensor_step_per_tensor():
    torch.manual_seed(0)
    net = LearnedOptimizerNet(NetConfig(width=16))
    with torch.no_grad():
        for q in net.parameters():
            q.add_(0.3 * torch.randn_like(q))
    theta = net.theta()
    params = {"w": torch.randn(3, 6, 5), "b": torch.randn(3, 5), "c": torch.randn(3, 2, 2, 3)}
    layout = FlatLayout.of(params, batch_dims=1)
    p = layout.flatten(params)
    g = torch.randn_like(p)
    g[1, :4] = float("nan")  # worker 1, tensor "w": skipped
    state = init_flat_state(p)
    state["m"] += 0.1 * torch.randn_like(state["m"])
    state["v"] += torch.rand_like(state["v"])
    new_p, new_m, new_v = flat_step(theta, net.config, layout, p, g, state["m"], state["v"], 7)
    views = [layout.unflatten(t) for t in (p, g, state["v"], new_p, new_v)]
    m_views = layout.unflatten(state["m"])
    new_m_views = layout.unflatten(new_m)
    for w in range(3):
        for k in layout.names:
            ref_p, ref_m, ref_v = tensor_step(
                theta, net.config, views[0][k][w], views[1][k][w], m_views[k][w], views[2][k][w], 7
            )
            upd = ref_p - views[0][k][w]
            assert torch.allclose(views[3][k][w] - views[0][k][w], upd, atol=1e-7, rtol=1e-5), k
            assert torch.allclose(new_m_views[k][w], ref_m, atol=1e-6), k
            assert torch.allclose(views[4][k][w], ref_v, atol=1e-6), k
    assert torch.equal(new_p[1, :30], p[1, :30])
    assert not torch.equal(new_p[0, :30], p[0, :30])


def test_seeds_are_a_function_of_seed_and_step():
    assert torch.equal(step_seeds(3, 10, 4), step_seeds(3, 10, 4))
    assert not torch.equal(step_seeds(3, 10, 4), step_seeds(3, 11, 4))
    assert not torch.equal(step_seeds(3, 10, 4), step_seeds(4, 10, 4))


def test_speedup_definition():
    base = [1.0 / (t + 1) for t in range(100)]
    fast = [1.0 / (2 * t + 1) for t in range(100)]
    assert speedup(fast, base) > 1.5
    assert speedup(base, fast) < 0.7
    assert abs(speedup(base, base) - 1.0) < 1e-9


def test_decentralized_runs_are_scored_on_another_workers_batch():
    from torch.func import vmap

    from learned_opt.meta_train.inner import inner_step, make_inner_optimizer, new_trajectory
    from learned_opt.tasks import get_task

    task = get_task("iris_mlp")
    traj = new_trajectory(task, 3, "ring", "dirichlet", 0.1, 0, 10)
    params = traj.layout.unflatten(traj.params)
    batch = traj.batches.get(0)
    own = vmap(task.loss)(params, batch)
    rolled = vmap(task.loss)(params, tuple(torch.roll(t, 1, dims=0) for t in batch))
    scored, _ = inner_step(traj, make_inner_optimizer("adam", lr=1e-3))
    assert torch.allclose(scored, rolled) and not torch.allclose(scored, own)
    assert abs(traj.history[-1] - float(rolled.mean())) < 1e-6


def test_decentralized_runs_can_be_scored_on_the_averaged_model():
    from torch.func import vmap

    from learned_opt.meta_train.inner import inner_step, make_inner_optimizer, new_trajectory
    from learned_opt.tasks import get_task

    task = get_task("iris_mlp")
    traj = new_trajectory(task, 3, "ring", "dirichlet", 0.1, 0, 10, score="average")
    opt = make_inner_optimizer("adam", lr=1e-2)
    inner_step(traj, opt)  # the workers now differ
    params = traj.layout.unflatten(traj.params)
    average = {k: v.mean(0) for k, v in params.items()}
    batch = traj.batches.get(1)
    expected = vmap(task.loss, in_dims=(None, 0))(average, batch)
    rolled = vmap(task.loss)(params, tuple(torch.roll(t, 1, dims=0) for t in batch))
    scored, _ = inner_step(traj, opt)
    assert torch.allclose(scored, expected) and not torch.allclose(scored, rolled)
    with pytest.raises(ValueError, match="score"):
        new_trajectory(task, 3, "ring", "dirichlet", 0.1, 0, 10, score="median")


def test_saved_slots_keep_their_score():
    from learned_opt.meta_train.estimators import make_estimator
    from learned_opt.meta_train.inner import new_trajectory
    from learned_opt.meta_train.slots import restore_slots, serialise_slots
    from learned_opt.tasks import get_task

    traj = new_trajectory(get_task("iris_mlp"), 2, "ring", "iid", 1.0, 0, 10, score="average")
    saved = serialise_slots([[traj]])
    (restored,) = restore_slots(saved, make_estimator("tbptt"))
    assert restored[0].score == "average"
    del saved[0][0]["score"]  # slots saved before scores existed
    (restored,) = restore_slots(saved, make_estimator("tbptt"))
    assert restored[0].score == "next_worker"


def test_config_that_samples_held_out_work_fails(monkeypatch):
    with pytest.raises(ValueError, match="val_tasks.*held out"):
        MetaTrainModule(**{**SMALL, "val_tasks": ["iris_mlp", "heldout_autoencoder"]})
    from learned_opt.tasks import get_family

    monkeypatch.setattr(get_family("mlp_family"), "held_out", True)
    with pytest.raises(ValueError, match="family.*held out"):
        MetaTrainModule(**{**SMALL, "family": "mlp_family"})


def test_init_config_replaces_fields_and_keeps_the_parameters():
    from learned_opt.checkpoint import load_checkpoint

    start, _ = load_checkpoint("adapt_init_2x")
    module = MetaTrainModule(
        **{**SMALL, "worker_counts": [1]}, init_checkpoint="adapt_init_2x",
        init_config={"lr_adapt_min": -7.5, "lr_adapt_max_gossip": 4.0},
    )  # fmt: skip
    assert module.net.config.lr_adapt_min == -7.5
    assert module.net.mixing.lr_adapt_max_gossip == 4.0  # a MixingConfig field
    assert module.net.config.width == start.config.width
    for (name, a), (_, b) in zip(module.net.named_parameters(), start.named_parameters()):
        assert torch.equal(a, b), name
    saved = {}
    module.on_save_checkpoint(saved)
    assert NetConfig.from_dict(saved["meta_state"]["net_config"]).lr_adapt_min == -7.5
    assert saved["meta_state"]["net_mixing"]["lr_adapt_max_gossip"] == 4.0


@pytest.mark.parametrize(
    "fields, message",
    [({"no_such_field": 1.0}, "unknown config fields"), ({"width": 16}, "init_config")],
)
def test_bad_init_config_is_a_one_line_error(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        MetaTrainModule(**SMALL, init_checkpoint="adapt_init_2x", init_config=fields)
    assert "init_config" in str(info.value) and "\n" not in str(info.value)
