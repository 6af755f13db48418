"""Generic checks run on every registered task, plus the bad-input contract."""

import pytest
import torch
from torch.func import grad, vmap

from learned_opt.tasks import from_description, get_task, list_tasks, stack_params

TASKS = list_tasks()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_registry_size_and_kinds():
    assert len(TASKS) >= 8
    assert "digits_mlp" in TASKS
    kinds = {get_task(n).kind for n in TASKS}
    assert kinds == {"classification", "regression", "quadratic", "lm", "reconstruction"}
    models = {get_task(n).spec.model for n in TASKS}
    assert {"linear", "mlp", "cnn", "autoencoder"} <= models and models & {"transformer", "gru"}
    # held-out look-alikes for validation: an autoencoder, an L2 model, a batch-norm cnn
    assert get_task("wine_autoencoder").kind == "reconstruction"
    assert get_task("logreg_wine_l2").l2 == 1e-2
    assert get_task("digits_cnn_bn").spec.norm == "batch"


@pytest.mark.parametrize("name", TASKS)
def test_functional_equals_module(name):
    task = get_task(name)
    params = task.init(gen(1))
    assert sum(p.numel() for p in params.values()) == task.num_params
    module = task.module()
    task.load_params(module, params)
    assert {k: v.shape for k, v in module.named_parameters()} == {
        k: v.shape for k, v in params.items()
    }
    batch = next(task.batches(gen(2)))
    f = task.loss(params, batch)
    m = task.module_loss(module, batch)
    torch.testing.assert_close(f, m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(task.apply(params, batch[0]), module(batch[0]), rtol=1e-4, atol=1e-5)
    # gradients agree too
    gf = grad(task.loss)(params, batch)
    m.backward()
    for k, p in module.named_parameters():
        torch.testing.assert_close(gf[k], p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", TASKS)
def test_vmap_matches_loop(name):
    task = get_task(name)
    plist = [task.init(gen(s)) for s in range(4)]
    wb = task.worker_batches(seed=3, num_workers=4, partition="dirichlet", alpha=0.5)
    xs, ys = wb.get(5)
    assert xs.shape[:2] == (4, task.batch_size)
    loss_v = vmap(task.loss)(stack_params(plist), (xs, ys))
    loss_l = torch.stack([task.loss(p, wb.worker(5, i)) for i, p in enumerate(plist)])
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=1e-5)
    g_v = vmap(grad(task.loss))(stack_params(plist), (xs, ys))
    g_0 = grad(task.loss)(plist[0], (xs[0], ys[0]))
    for k in g_0:
        torch.testing.assert_close(g_v[k][0], g_0[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", TASKS)
def test_adam_reduces_loss_and_evaluates(name):
    task = get_task(name)
    module = task.module(gen(0))
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    it = task.batches(seed=0)
    fixed = next(task.batches(seed=99))
    with torch.no_grad():
        before = float(task.module_loss(module, fixed))
    for _ in range(15):
        opt.zero_grad()
        task.module_loss(module, next(it)).backward()
        opt.step()
    with torch.no_grad():
        after = float(task.module_loss(module, fixed))
    assert after < before, (before, after)
    ev = task.evaluate(task.params_of(module))
    assert torch.isfinite(torch.tensor(ev["loss"]))
    if task.kind in ("classification", "lm"):
        assert 0.0 <= ev["accuracy"] <= 1.0
    else:
        assert "accuracy" not in ev


def test_describe_roundtrip_fixed():
    for name in TASKS:
        task = get_task(name)
        line = task.describe()
        assert "\n" not in line
        again = from_description(line)
        assert again.spec == task.spec
        assert get_task(line).spec == task.spec


def test_batches_deterministic_and_consistent():
    task = get_task("digits_mlp")
    a = task.batches(gen(5), worker=2, num_workers=4, partition="dirichlet", alpha=0.3)
    b = task.batches(gen(5), worker=2, num_workers=4, partition="dirichlet", alpha=0.3)
    seed = int(torch.randint(0, 2**62, (1,), generator=gen(5)))
    wb = task.worker_batches(seed, 4, "dirichlet", 0.3)
    for step in range(3):
        xa, ya = next(a)
        xb, yb = next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        xs, ys = wb.get(step)
        assert torch.equal(xs[2], xa) and torch.equal(ys[2], ya)
    # batches come from the worker's own shard
    idx = wb.indices(7)
    for w in range(4):
        assert torch.isin(idx[w], wb.shards[w]).all()
    # different steps differ
    assert not torch.equal(wb.get(0)[0], wb.get(1)[0])


def test_init_reproducible():
    task = get_task("digits_cnn")
    p1, p2, p3 = task.init(gen(4)), task.init(gen(4)), task.init(gen(5))
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert not all(torch.equal(p1[k], p3[k]) for k in p1)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: get_task("nope"), "digits_mlp"),
        (lambda: get_task("digits_mlp").worker_batches(0, 10_000), "num_workers"),
        (lambda: get_task("digits_mlp").worker_batches(0, 0), "num_workers"),
        (lambda: get_task("digits_mlp").worker_batches(0, 4, "dirichlet", 0.0), "alpha"),
        (lambda: get_task("digits_mlp").worker_batches(0, 4, "dirichlet", -1.0), "alpha"),
        (lambda: get_task("digits_mlp").worker_batches(0, 4, "shards"), "iid"),
        (lambda: next(get_task("digits_mlp").batches(worker=4, num_workers=4)), "0 to 3"),
        (lambda: from_description("model=mlp dataset=digits batch_size=0"), "valid choices"),
        (lambda: from_description("model=mlp dataset=digits batch_size=100000"), "valid choices"),
        (lambda: from_description("model=mlp dataset=mnist"), "digits"),
        (lambda: from_description("model=rnn dataset=digits"), "mlp"),
        (lambda: from_description("model=cnn dataset=wine hidden=4x8"), "digits"),
        (lambda: from_description("model=mlp dataset=digits activation=swish"), "relu"),
        (lambda: from_description("model=mlp dataset=digits colour=red"), "valid keys"),
        (lambda: from_description("model=transformer dataset=digits hidden=32x2"), "mlp"),
    ],
)
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_datasets_cached_and_standardised():
    from learned_opt.tasks import load_dataset

    a, b = load_dataset("wine"), load_dataset("wine", 0.0, context=64)
    assert a is b
    torch.testing.assert_close(a.x_train.mean(0), torch.zeros(a.num_features), atol=1e-5, rtol=0)
    noisy = load_dataset("wine", 0.3)
    assert torch.equal(noisy.x_train, a.x_train) and not torch.equal(noisy.y_train, a.y_train)
    assert torch.equal(noisy.y_test, a.y_test)  # test labels stay clean


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_batches_on_device():
    task = get_task("digits_mlp")
    params = stack_params([task.init(gen(s), device="cuda") for s in range(2)])
    xs, ys = task.worker_batches(0, 2, device="cuda").get(0)
    assert xs.is_cuda and ys.is_cuda
    assert vmap(task.loss)(params, (xs, ys)).shape == (2,)
    assert task.evaluate({k: v[0] for k, v in params.items()})["loss"] > 0
