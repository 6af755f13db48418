"""The matrix-factorisation task kind: its two faces, its data and its family."""

import pytest
import torch
from torch.func import grad, vmap

from learned_opt.tasks import Task, TaskSpec, get_family, is_held_out, stack_params
from learned_opt.tasks.datasets import RATINGS, load_dataset

SPEC = TaskSpec("mf", "ratings_synth", (8,), batch_size=32)


def test_ratings_are_id_pairs_with_standardised_targets():
    data = load_dataset("ratings_synth")
    users, items = RATINGS["ratings_synth"]
    assert data.x_train.dtype == torch.int64 and data.x_train.shape[1] == 2
    assert 0 <= int(data.x_train[:, 0].min()) and int(data.x_train[:, 0].max()) < users
    assert 0 <= int(data.x_train[:, 1].min()) and int(data.x_train[:, 1].max()) < items
    assert abs(float(data.y_train.mean())) < 1e-3 and abs(float(data.y_train.std()) - 1) < 1e-3


def test_functional_and_module_faces_agree():
    task = Task(SPEC)
    params = task.init(torch.Generator().manual_seed(1))
    with torch.no_grad():  # non-zero biases, so every term is checked
        for k in ("user_bias.weight", "item_bias.weight", "bias"):
            params[k].normal_()
    module = task.load_params(task.module(), params)
    batch = next(task.batches(seed=2))
    torch.testing.assert_close(task.loss(params, batch), task.module_loss(module, batch))
    task.module_loss(module, batch).backward()
    g = grad(task.loss)(params, batch)
    for k, p in module.named_parameters():
        torch.testing.assert_close(g[k], p.grad, rtol=1e-4, atol=1e-6)
    # a batch reaches a few rows of the user table: the rest get no gradient
    touched = (g["user.weight"] != 0).any(1).float().mean()
    assert 0 < float(touched) <= 32 / RATINGS["ratings_synth"][0]


def test_workers_under_vmap_match_a_loop():
    task = Task(SPEC)
    plist = [task.init(torch.Generator().manual_seed(s)) for s in range(3)]
    wb = task.worker_batches(seed=3, num_workers=3, partition="dirichlet", alpha=0.5)
    xs, ys = wb.get(4)
    got = vmap(task.loss)(stack_params(plist), (xs, ys))
    want = torch.stack([task.loss(p, wb.worker(4, i)) for i, p in enumerate(plist)])
    torch.testing.assert_close(got, want)


def test_adam_fits_the_ratings():
    task = Task(SPEC)
    module = task.module(torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    before = task.evaluate(task.params_of(module), split="train")["loss"]
    for batch, _ in zip(task.batches(seed=0), range(500)):
        opt.zero_grad()
        task.module_loss(module, batch).backward()
        opt.step()
    assert task.evaluate(task.params_of(module), split="train")["loss"] < 0.75 * before


@pytest.mark.parametrize(
    "spec, match",
    [
        (TaskSpec("mf", "digits", (8,)), "does not fit dataset 'digits'"),
        (TaskSpec("mlp", "ratings_synth", (8,)), "valid choices: model='mf'"),
        (TaskSpec("mf", "ratings_synth", (8, 8)), r"hidden=\(dim,\)"),
    ],
)
def test_mismatched_specs_raise(spec, match):
    with pytest.raises(ValueError, match=match):
        Task(spec)


def test_table_family_draws_recommenders_and_the_broad_kinds():
    g = torch.Generator().manual_seed(0)
    specs = [get_family("broad_table_family").sample_spec(g) for _ in range(500)]
    mf = [s for s in specs if s.model == "mf"]
    assert 0.05 < len(mf) / len(specs) < 0.16  # 10% expected
    assert {s.model for s in specs} >= {"mf", "transformer", "gru", "mlp", "cnn", "linear"}
    assert not any(is_held_out(s.name) for s in specs)
    for s in mf:
        assert s.dataset == "ratings_synth" and s.hidden[0] in (8, 16, 32)
        assert Task(s).describe() == s.describe()
