"""Families: seeded, reproducible from the description, valid tasks."""

import pytest
import torch
from torch.func import grad, vmap

from learned_opt.tasks import from_description, get_family, list_families, stack_params


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
