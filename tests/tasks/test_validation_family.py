"""The validation family: marked apart from meta-training, every problem builds and trains,
runs are deterministic, and ranks can draw independent skewed samples."""

from __future__ import annotations

import pytest
import torch

from learned_opt.meta_train.module import MetaTrainModule
from learned_opt.tasks import (
    check_not_held_out,
    get_task,
    is_held_out,
    is_validation,
    label_skew,
    list_heldout_tasks,
    list_tasks,
    list_validation_tasks,
)
from learned_opt.tasks.validation import (
    DECENTRALIZED_PROBLEMS,
    SINGLE_PROBLEMS,
    SampledBatches,
)

NAMES = list_validation_tasks()


def test_family_is_apart_from_registry_and_held_out_suite():
    assert len(NAMES) >= 10 and len(SINGLE_PROBLEMS) >= 10 and len(DECENTRALIZED_PROBLEMS) >= 6
    assert not set(NAMES) & (set(list_tasks()) | set(list_heldout_tasks()))
    assert all(is_validation(n) and not is_held_out(n) for n in NAMES)
    assert {t for t, _, _ in SINGLE_PROBLEMS} == set(NAMES)
    horizons = [h for _, h, _ in SINGLE_PROBLEMS]
    assert min(horizons) == 200 and max(horizons) == 3000
    decs = DECENTRALIZED_PROBLEMS
    assert {d["partition"] for d in decs} == {"iid", "dirichlet", "sampled"}
    assert {d["topology"] for d in decs} == {"ring", "torus", "exponential"}
    assert all(4 <= d["workers"] <= 16 and d["task"] in NAMES for d in decs)


def test_meta_training_refuses_validation_tasks():
    check_not_held_out(["digits_mlp"])
    with pytest.raises(ValueError, match="val_mf_recsys.*choosing the rule"):
        check_not_held_out(["digits_mlp", "val_mf_recsys"])
    small = dict(tasks_per_step=1, unroll_length=3, min_length=6, max_length=6,
                 worker_counts=[2], topologies=["ring"], val_horizon=15, val_workers=2,
                 baseline_cache=None)  # fmt: skip
    with pytest.raises(ValueError, match="val_tasks.*val_moons_mlp"):
        MetaTrainModule(**small, val_tasks=["iris_mlp", "val_moons_mlp"])


def _two_steps(name: str, seed: int) -> list[float]:
    torch.manual_seed(seed)
    model, loss_fn, batches = get_task(name).workload(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for _, batch in zip(range(2), batches):
        loss = loss_fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_task_builds_trains_and_is_deterministic(name):
    first = _two_steps(name, 0)
    assert all(torch.isfinite(torch.tensor(first))) and first == _two_steps(name, 0)
    assert first != _two_steps(name, 1)


def test_recommender_rows_are_sparse():
    task = get_task("val_mf_recsys")
    model, loss_fn, batches = task.workload(0)
    loss_fn(next(batches)).backward()
    rows = (model.user.weight.grad.abs().sum(1) > 0).float().mean()
    assert 0 < float(rows) <= 0.02


def test_sampled_ranks_draw_their_own_skewed_samples():
    task = get_task("val_synth40_mlp")
    wb = task.worker_batches(seed=3, num_workers=4, partition="sampled", alpha=0.1)
    assert isinstance(wb, SampledBatches) and len(wb.shards) == 4
    size = task.data.num_train // 4
    assert all(len(s) == size for s in wb.shards)
    labels = task.data.partition_labels
    iid = task.worker_batches(seed=3, num_workers=4, partition="iid")
    assert label_skew(labels, wb.shards) > 0.4 > 0.05 > label_skew(labels, iid.shards)
    x, _ = wb.get(0)
    assert x.shape == (4, task.batch_size, 40)
    again = task.worker_batches(seed=3, num_workers=4, partition="sampled", alpha=0.1)
    assert all(torch.equal(a, b) for a, b in zip(wb.shards, again.shards))
    with pytest.raises(ValueError, match="alpha"):
        task.worker_batches(num_workers=4, partition="sampled", alpha=0.0)
