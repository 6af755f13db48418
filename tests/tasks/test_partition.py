"""Partition properties: coverage, disjointness, non-empty shards, skew grows as alpha falls."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learned_opt.tasks import label_skew, load_dataset, partition_indices


def check_partition(shards, n, num_workers):
    assert len(shards) == num_workers
    assert all(len(s) > 0 for s in shards)
    allidx = torch.cat(shards)
    assert allidx.dtype == torch.long
    assert len(allidx) == n
    assert torch.equal(allidx.sort().values, torch.arange(n))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    num_classes=st.integers(1, 12),
    num_workers=st.integers(1, 64),
    scheme=st.sampled_from(["iid", "dirichlet"]),
    alpha=st.floats(1e-3, 100.0),
    seed=st.integers(0, 2**31),
)
def test_partition_covers_exactly_once(n, num_classes, num_workers, scheme, alpha, seed):
    num_workers = min(num_workers, n)
    labels = torch.randint(0, num_classes, (n,), generator=torch.Generator().manual_seed(seed))
    shards = partition_indices(
        labels, num_workers, scheme, alpha, torch.Generator().manual_seed(seed)
    )
    check_partition(shards, n, num_workers)


@pytest.mark.parametrize("dataset", ["digits", "iris", "diabetes", "chars"])
@pytest.mark.parametrize("num_workers", [1, 2, 7, 64])
def test_real_datasets_partition(dataset, num_workers):
    labels = load_dataset(dataset).partition_labels
    for scheme in ("iid", "dirichlet"):
        shards = partition_indices(
            labels, num_workers, scheme, 0.05, torch.Generator().manual_seed(1)
        )
        check_partition(shards, len(labels), num_workers)


def test_skew_grows_as_alpha_falls():
    labels = load_dataset("digits").partition_labels
    skews = []
    for alpha in (100.0, 1.0, 0.1, 0.01):
        vals = [
            label_skew(
                labels,
                partition_indices(labels, 8, "dirichlet", alpha, torch.Generator().manual_seed(s)),
            )
            for s in range(5)
        ]
        skews.append(sum(vals) / len(vals))
    assert all(a < b for a, b in zip(skews, skews[1:])), skews
    iid = label_skew(
        labels, partition_indices(labels, 8, "iid", generator=torch.Generator().manual_seed(0))
    )
    assert iid < 0.1 and skews[-1] > 0.6


def test_partition_deterministic():
    labels = load_dataset("wine").partition_labels
    a = partition_indices(labels, 5, "dirichlet", 0.2, torch.Generator().manual_seed(3))
    b = partition_indices(labels, 5, "dirichlet", 0.2, torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_iid_is_balanced():
    shards = partition_indices(torch.zeros(100, dtype=torch.long), 7, "iid")
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
