"""Held-out evaluation tasks: sizes, both faces, full batch, and the held-out mark."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import grad, vmap

from learned_opt.tasks import (
    ModuleTask,
    check_not_held_out,
    get_family,
    get_task,
    is_held_out,
    list_heldout_tasks,
    list_tasks,
    load_dataset,
    stack_params,
)

HELDOUT = list_heldout_tasks()
#: name -> (min params, max params): the sizes the evaluation suite promises.
SIZES = {
    "heldout_char_lm": (400_000, 500_000),
    "heldout_autoencoder": (4_000, 6_000),
    "heldout_logreg_l2": (31, 62),
    "heldout_convnet_bn": (80_000, 120_000),
    "heldout_wide_mlp": (900_000, 1_200_000),
}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_registry_marks_heldout_tasks_apart():
    assert set(HELDOUT) == set(SIZES)
    assert not set(HELDOUT) & set(list_tasks())
    assert all(is_held_out(n) for n in HELDOUT)
    assert not any(is_held_out(n) for n in list_tasks())
    assert not is_held_out("meta_family") and not is_held_out("no_such_name")


@pytest.mark.parametrize("name", HELDOUT)
def test_size_and_both_faces_agree(name):
    task = get_task(name)
    lo, hi = SIZES[name]
    assert lo <= task.num_params <= hi
    assert get_task(task.describe()) is task
    params = task.init(gen(1))
    assert sum(p.numel() for p in params.values()) == task.num_params
    module = task.load_params(task.module(), params)
    batch = next(task.batches(seed=3))
    torch.testing.assert_close(task.loss(params, batch), task.module_loss(module, batch))
    g = grad(task.loss)(params, batch)
    task.module_loss(module, batch).backward()
    for k, p in module.named_parameters():
        torch.testing.assert_close(g[k], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in HELDOUT if n != "heldout_char_lm"])
def test_stacked_workers_under_vmap(name):
    task = get_task(name)
    a, b = task.init(gen(0)), task.init(gen(1))
    wb = task.worker_batches(seed=0, num_workers=2, partition="dirichlet", alpha=0.3)
    inputs, targets = wb.get(0)
    losses = vmap(task.loss)(stack_params([a, b]), (inputs, targets))
    for i, p in enumerate((a, b)):
        torch.testing.assert_close(losses[i], task.loss(p, (inputs[i], targets[i])))


def test_workload_is_a_plain_training_job():
    task = get_task("heldout_autoencoder")
    model, loss_fn, batches = task.workload(seed=5)
    model2, _, batches2 = task.workload(seed=5)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    first = next(batches)
    assert all(torch.equal(x, y) for x, y in zip(first, next(batches2)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = float(loss_fn(first).detach())
    for _, batch in zip(range(150), batches):
        opt.zero_grad()
        loss_fn(batch).backward()
        opt.step()
    assert float(loss_fn(first).detach()) < 0.8 * start


def test_init_is_seeded_and_leaves_global_rng_alone():
    task = get_task("heldout_convnet_bn")
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a, b, c = task.init(gen(1)), task.init(gen(1)), task.init(gen(2))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.1.weight"], c["head.1.weight"])


def test_full_batch_and_its_worker_shares():
    task = get_task("heldout_logreg_l2")
    n = task.data.num_train
    batches = task.batches(seed=0)
    for _ in range(3):
        x, y = next(batches)
        assert torch.equal(x, task.data.x_train) and torch.equal(y, task.data.y_train)
    wb = task.worker_batches(seed=0, num_workers=4, partition="dirichlet", alpha=0.5)
    inputs, _ = wb.get(0)
    assert inputs.shape[:2] == (4, n // 4)


def test_l2_penalty_is_in_the_loss():
    task = get_task("heldout_logreg_l2")
    params = task.init(gen(0))
    batch = next(task.batches(seed=0))
    plain = torch.nn.functional.cross_entropy(task.apply(params, batch[0]), batch[1])
    expected = plain + 0.5 * task.l2 * (params["weight"] ** 2).sum()
    torch.testing.assert_close(task.loss(params, batch), expected)
    assert task.evaluate(params, "train")["loss"] == pytest.approx(float(expected), rel=1e-5)


def _data():
    return load_dataset("iris")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="bad name"), "whitespace"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=10**6), "batch_size"),
        (dict(l2=-1.0), "l2"),
        (dict(l2=float("nan")), "l2"),
        (dict(factory=lambda: nn.BatchNorm1d(4)), "buffers"),
    ],
)
def test_bad_module_task_arguments(kwargs, match):
    args = dict(name="t", factory=lambda: nn.Linear(4, 3), data=_data(), batch_size=8)
    with pytest.raises(ValueError, match=match):
        ModuleTask(**{**args, **kwargs})


def test_module_task_rejects_init_scale():
    task = ModuleTask("t", lambda: nn.Linear(4, 3), _data(), batch_size=8)
    with pytest.raises(ValueError, match="init_scale"):
        task.model.init(gen(0), init_scale=2.0)


def test_check_not_held_out(monkeypatch):
    check_not_held_out(["digits_mlp", "meta_family"])
    with pytest.raises(ValueError, match="heldout_char_lm"):
        check_not_held_out(["digits_mlp", "heldout_char_lm"])
    monkeypatch.setattr(get_family("cnn_family"), "held_out", True)
    with pytest.raises(ValueError, match="cnn_family"):
        check_not_held_out("cnn_family")
