"""Families: seeded, reproducible from the description, valid tasks."""

import math

import pytest
import torch
from torch.func import grad, vmap

from learned_opt.tasks import (
    Task,
    from_description,
    get_family,
    is_held_out,
    list_families,
    load_dataset,
    stack_params,
)


def test_at_least_two_families():
    assert {"mlp_family", "regression_family"} <= set(list_families())


@pytest.mark.parametrize("name", list_families())
def test_family_reproducible_and_describable(name):
    family = get_family(name)
    seen = set()
    for seed in range(6):
        a = family.sample(torch.Generator().manual_seed(seed))
        b = family.sample(torch.Generator().manual_seed(seed))
        assert a.spec == b.spec
        line = a.describe()
        c = from_description(line)
        assert c.spec == a.spec and family.from_description(line).spec == a.spec
        pa, pc = a.init(torch.Generator().manual_seed(1)), c.init(torch.Generator().manual_seed(1))
        batch = c.worker_batches(seed=0).get(0)
        assert torch.equal(a.worker_batches(seed=0).get(0)[0], batch[0])
        torch.testing.assert_close(
            a.loss(pa, (batch[0][0], batch[1][0])), c.loss(pc, (batch[0][0], batch[1][0]))
        )
        seen.add(line)
    assert len(seen) > 1  # different seeds give different tasks


@pytest.mark.parametrize("name", ["mlp_family", "regression_family", "cnn_family"])
def test_family_samples_train_under_vmap(name):
    family = get_family(name)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        task = family.sample(g)
        if name != "cnn_family":
            assert 1 <= len(task.spec.hidden) <= 4 or task.spec.model == "linear"
            assert all(8 <= h <= 256 for h in task.spec.hidden)
        params = stack_params([task.init(g) for _ in range(2)])
        wb = task.worker_batches(seed=1, num_workers=2, partition="dirichlet", alpha=0.5)
        losses = vmap(task.loss)(params, wb.get(0))
        grads = vmap(grad(task.loss))(params, wb.get(0))
        assert torch.isfinite(losses).all()
        assert all(torch.isfinite(v).all() for v in grads.values())


def test_family_sample_variety():
    family = get_family("mlp_family")
    g = torch.Generator().manual_seed(0)
    specs = [family.sample_spec(g) for _ in range(40)]
    assert len({s.dataset for s in specs}) >= 4
    assert len({s.activation for s in specs}) >= 3
    assert len({len(s.hidden) for s in specs}) >= 3
    assert len({s.batch_size for s in specs}) >= 3
    assert any(s.label_noise > 0 for s in specs) and any(s.label_noise == 0 for s in specs)


def test_unknown_family():
    with pytest.raises(ValueError, match="mlp_family"):
        get_family("cnn_familyy")


# ----------------------------------------------------------------------------- broad_family
BROAD_KINDS = ("mlp", "mlp_bn", "regression", "autoencoder", "l2_linear", "cnn", "cnn_bn", "lm")


def _broad_specs(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [get_family("broad_family").sample_spec(g) for _ in range(n)]


def _kind(spec):
    """The sampler branch a broad_family spec came from."""
    if spec.model in ("transformer", "gru"):
        return "lm"
    if spec.model == "linear" and spec.l2 > 0:
        return "l2_linear"
    if spec.model != "autoencoder" and load_dataset(spec.dataset).kind != "classification":
        return "regression"
    return spec.model + ("_bn" if spec.norm == "batch" else "")


def test_broad_family_samples_are_valid_and_cover_every_kind():
    specs = _broad_specs()
    assert specs == _broad_specs()  # a pure function of the generator
    assert specs != _broad_specs(seed=1)
    kinds = {_kind(s) for s in specs}
    assert kinds == set(BROAD_KINDS)
    for s in specs:
        task = Task(s)  # valid
        assert not is_held_out(s.name) and s.name.startswith("broad_family:")
        assert from_description(task.describe()).spec == s
        if s.model == "autoencoder":
            assert s.dataset != "digits"  # the held-out autoencoder's data
            d = load_dataset(s.dataset).num_features
            b = min(s.hidden)
            assert b < d and all(h > b for h in s.hidden if h != b)
            assert len(s.hidden) in (1, 3) and s.label_noise == 0.0
        if s.l2 > 0:
            assert s.model == "linear" and s.dataset != "breast_cancer"  # the held-out L2 model's
            assert 1e-4 <= s.l2 <= 1e-1
            assert 1 <= s.batch_size <= task.data.num_train
        if s.norm == "batch":
            assert s.model in ("mlp", "cnn")
        if s.model in ("mlp", "autoencoder"):
            assert max(s.hidden) <= 64  # narrow, to keep meta-training fast
    assert any(s.l2 > 0 and s.batch_size == load_dataset(s.dataset).num_train for s in specs)


def test_broad_seq_family_draws_more_sequence_models():
    g = torch.Generator().manual_seed(0)
    specs = [get_family("broad_seq_family").sample_spec(g) for _ in range(400)]
    lm = [s for s in specs if _kind(s) == "lm"]
    assert 0.2 < len(lm) / len(specs) < 0.4  # 0.25 + 0.75 * 0.05 expected
    assert {s.model for s in lm} == {"transformer", "gru"}
    assert {_kind(s) for s in specs} == set(BROAD_KINDS)  # the broad kinds stay
    assert not any(is_held_out(s.name) for s in specs)


def test_broad_family_kinds_train_with_sgd():
    """A few plain SGD steps on one sample of each kind lower the loss on a fixed batch,
    at one of a few learning rates (sampled init scales and widths need different ones)."""
    picked = {}
    for s in _broad_specs(120):
        picked.setdefault(_kind(s), s)
    assert set(picked) == set(BROAD_KINDS)

    def train(task, lr):
        params = task.init(torch.Generator().manual_seed(0))
        for _, batch in zip(range(10), task.batches(seed=0)):
            g = grad(task.loss)(params, batch)
            params = {k: p - lr * g[k] for k, p in params.items()}
        return params

    for kind, spec in sorted(picked.items()):
        task = Task(spec)
        fixed = next(task.batches(seed=99))
        before = float(task.loss(task.init(torch.Generator().manual_seed(0)), fixed))
        after = [float(task.loss(train(task, lr), fixed)) for lr in (0.3, 0.03, 0.003)]
        assert min(a for a in after if math.isfinite(a)) < before, (kind, spec.describe(), after)
