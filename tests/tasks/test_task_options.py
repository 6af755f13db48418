"""The spec options that mimic the held-out suite: autoencoders, the L2 penalty, batch norm."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from learned_opt.tasks import Task, TaskSpec, from_description, get_task, stack_params
from learned_opt.tasks.models import batch_norm

#: One spec per new option (and a mix), each checked on both faces and under vmap.
SPECS = {
    "autoencoder": TaskSpec("autoencoder", "wine", (16, 4, 16), "tanh", batch_size=32),
    "autoencoder_narrow": TaskSpec("autoencoder", "spirals", (1,), "relu", batch_size=16),
    "l2_linear": TaskSpec("linear", "iris", batch_size=32, l2=0.05),
    "l2_mlp_bn": TaskSpec("mlp", "wine", (16, 8), "gelu", batch_size=32, l2=0.01, norm="batch"),
    "bn_mlp": TaskSpec("mlp", "digits", (32, 16), "relu", batch_size=32, norm="batch"),
    "bn_mlp_regression": TaskSpec("mlp", "diabetes", (16,), "silu", batch_size=16, norm="batch"),
    "bn_cnn": TaskSpec("cnn", "digits", (4, 8), "relu", batch_size=16, norm="batch"),
}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- descriptions
def test_describe_roundtrips_new_fields_and_omits_their_defaults():
    for spec in SPECS.values():
        line = Task(spec).describe()
        assert from_description(line).spec == spec
        assert ("l2=" in line) == (spec.l2 != 0.0) and ("norm=" in line) == (spec.norm != "none")
    again = from_description("model=linear dataset=wine l2=0.0123 norm=none").spec
    assert again.l2 == 0.0123 and isinstance(again.l2, float) and again.norm == "none"


def test_old_descriptions_parse_to_the_defaults_and_print_unchanged():
    old = (
        "model=mlp dataset=digits hidden=64x64 activation=relu init_scale=1.0 batch_size=64 "
        "label_noise=0.0 context=32 name=digits_mlp"
    )
    spec = from_description(old).spec
    assert (spec.l2, spec.norm) == (0.0, "none")
    assert spec == get_task("digits_mlp").spec
    assert spec.describe() == old  # caches keyed on descriptions stay valid


# ----------------------------------------------------------------------------- both faces
@pytest.mark.parametrize("key", SPECS)
def test_functional_equals_module(key):
    task = Task(SPECS[key])
    params = task.init(gen(1))
    assert sum(p.numel() for p in params.values()) == task.num_params
    module = task.load_params(task.module(), params)
    assert not list(module.buffers())  # no running statistics
    batch = next(task.batches(seed=2))
    f, m = task.loss(params, batch), task.module_loss(module, batch)
    torch.testing.assert_close(f, m, rtol=1e-5, atol=1e-5)
    gf = grad(task.loss)(params, batch)
    m.backward()
    for k, p in module.named_parameters():
        torch.testing.assert_close(gf[k], p.grad, rtol=1e-4, atol=1e-5)
    module.eval()  # batch statistics in eval mode too: the same function
    with torch.no_grad():
        out = module(batch[0])
    torch.testing.assert_close(task.apply(params, batch[0]), out, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("key", SPECS)
def test_vmap_matches_loop(key):
    task = Task(SPECS[key])
    plist = [task.init(gen(s)) for s in range(3)]
    wb = task.worker_batches(seed=3, num_workers=3, partition="dirichlet", alpha=0.5)
    xs, ys = wb.get(1)
    loss_v = vmap(task.loss)(stack_params(plist), (xs, ys))
    loss_l = torch.stack([task.loss(p, (xs[i], ys[i])) for i, p in enumerate(plist)])
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=1e-6)
    g_v = vmap(grad(task.loss))(stack_params(plist), (xs, ys))
    g_2 = grad(task.loss)(plist[2], (xs[2], ys[2]))
    for k in g_2:
        torch.testing.assert_close(g_v[k][2], g_2[k], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- autoencoder
def test_autoencoder_reconstructs_its_inputs():
    task = Task(SPECS["autoencoder"])
    assert task.kind == "reconstruction"
    assert task.num_params == (13 * 16 + 16) + (16 * 4 + 4) + (4 * 16 + 16) + (16 * 13 + 13)
    params = task.init(gen(0))
    x, y = next(task.batches(seed=0))
    out = task.apply(params, x)
    assert out.shape == x.shape
    expected = ((out - x) ** 2).mean()
    torch.testing.assert_close(task.loss(params, (x, y)), expected)
    unlabelled = (x, torch.zeros_like(y))  # the labels go unused
    torch.testing.assert_close(task.loss(params, unlabelled), expected)
    ev = task.evaluate(params, "train")
    assert set(ev) == {"loss"}
    full = task.data.x_train
    assert ev["loss"] == pytest.approx(float(((task.apply(params, full) - full) ** 2).mean()))


def test_autoencoder_partitions_by_the_labels():
    ae = Task(SPECS["autoencoder"])
    clf = Task(TaskSpec("mlp", "wine", (8,), batch_size=32))
    a = ae.worker_batches(seed=4, num_workers=3, partition="dirichlet", alpha=0.1)
    b = clf.worker_batches(seed=4, num_workers=3, partition="dirichlet", alpha=0.1)
    assert all(torch.equal(s, t) for s, t in zip(a.shards, b.shards))


# ----------------------------------------------------------------------------- l2
def test_l2_penalty_matches_a_hand_computation():
    task = Task(SPECS["l2_mlp_bn"])
    params = task.init(gen(0))
    params = {k: v + 0.1 for k, v in params.items()}  # biases and norm shifts non-zero
    batch = next(task.batches(seed=0))
    plain = F.cross_entropy(task.apply(params, batch[0]), batch[1])
    weights = ["layers.0.weight", "layers.1.weight", "layers.2.weight"]
    hand = 0.5 * 0.01 * sum(float((params[k] ** 2).sum()) for k in weights)
    assert float(task.penalty(params)) == pytest.approx(hand, rel=1e-6)
    torch.testing.assert_close(task.loss(params, batch), plain + hand)
    ev = task.evaluate(params, "train")["loss"]
    x, y = task.data.x_train, task.data.y_train
    assert ev == pytest.approx(float(F.cross_entropy(task.apply(params, x), y)) + hand, rel=1e-5)
    no_l2 = Task(dataclasses.replace(task.spec, l2=0.0))
    assert no_l2.penalty(params) == 0.0


# ----------------------------------------------------------------------------- batch norm
@pytest.mark.parametrize("shape", [(64, 5), (16, 3, 4, 4)])
def test_batch_norm_normalises_per_feature(shape):
    x = torch.randn(shape, generator=gen(0)) * 3.0 + 2.0
    c = shape[1]
    y = batch_norm(x, torch.ones(c), torch.zeros(c))
    dims = [d for d in range(x.dim()) if d != 1]
    torch.testing.assert_close(y.mean(dims), torch.zeros(c), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(dims, correction=0), torch.ones(c), atol=1e-3, rtol=0)
    w, b = torch.rand(c, generator=gen(1)) + 0.5, torch.randn(c, generator=gen(2))
    ref = F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    torch.testing.assert_close(batch_norm(x, w, b), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key, first", [("bn_mlp", "layers.0"), ("bn_cnn", "conv1")])
def test_batch_norm_model_ignores_the_scale_and_shift_before_it(key, first):
    task = Task(SPECS[key])
    params = task.init(gen(0))
    names = {"bn_mlp": ("norms.0", "norms.1"), "bn_cnn": ("bn1", "bn2")}[key]
    for n in names:
        assert torch.equal(params[f"{n}.weight"], torch.ones_like(params[f"{n}.weight"]))
        assert torch.equal(params[f"{n}.bias"], torch.zeros_like(params[f"{n}.bias"]))
    x = next(task.batches(seed=0))[0]
    scaled = dict(params)
    scaled[f"{first}.weight"] = params[f"{first}.weight"] * 7.0
    scaled[f"{first}.bias"] = params[f"{first}.bias"] * 7.0 + 3.0  # per-feature shift
    torch.testing.assert_close(task.apply(scaled, x), task.apply(params, x), atol=1e-4, rtol=1e-4)
    plain = Task(dataclasses.replace(task.spec, norm="none"))
    assert task.num_params - plain.num_params == 2 * sum(
        params[f"{n}.weight"].numel() for n in names
    )


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2=-1.0), "l2 must be a finite number >= 0"),
        (dict(l2=float("nan")), "l2 must be a finite number >= 0"),
        (dict(l2=float("inf")), "l2 must be a finite number >= 0"),
        (dict(l2="0.1"), "l2 must be a finite number >= 0"),
        (dict(norm="layer"), r"valid choices: \('none', 'batch'\)"),
        (dict(model="linear", hidden=(), norm="batch"), "norm='none'"),
        (dict(model="autoencoder", norm="batch"), "norm='none'"),
        (dict(model="transformer", dataset="chars", hidden=(16, 2), norm="batch"), "norm='none'"),
        (dict(model="gru", dataset="chars", hidden=(16, 16), norm="batch"), "norm='none'"),
        (dict(model="autoencoder", hidden=()), "autoencoder needs hidden"),
        (dict(model="autoencoder", dataset="chars"), "feature vectors.*'wine'"),
        (dict(model="transformer", dataset="wine", hidden=(16, 2)), "mlp, cnn, autoencoder"),
        (dict(model="autoencoder", label_noise=0.1), "label_noise=0.0"),
        (dict(norm="batch", batch_size=1), "batch_size >= 2"),
    ],
)
def test_bad_options_refused(kwargs, match):
    base = dict(model="mlp", dataset="wine", hidden=(8,), batch_size=16)
    with pytest.raises(ValueError, match=match):
        Task(TaskSpec(**{**base, **kwargs}))


@pytest.mark.parametrize(
    "line, match",
    [
        ("model=linear dataset=wine l2=-0.5", "l2"),
        ("model=linear dataset=wine l2=nan", "l2"),
        ("model=mlp dataset=wine hidden=8 norm=group", "valid choices"),
        ("model=linear dataset=wine norm=batch", "norm='none'"),
    ],
)
def test_bad_descriptions_refused(line, match):
    with pytest.raises(ValueError, match=match):
        from_description(line)
