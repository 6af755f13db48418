"""Splitting a training set across workers: IID shards or Dirichlet label skew.

Guarantees, for any ``1 <= num_workers <= len(labels)``: every worker gets a non-empty
shard, and the shards together contain every index exactly once.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PARTITION_SCHEMES", "partition_indices", "label_skew"]

PARTITION_SCHEMES = ("iid", "dirichlet")


def _check(num_examples: int, num_workers: int, scheme: str, alpha: float) -> None:
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; valid choices: {PARTITION_SCHEMES}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if num_workers > num_examples:
        raise ValueError(
            f"cannot split {num_examples} examples across {num_workers} workers; "
            f"valid choices: num_workers in [1, {num_examples}]"
        )
    if scheme == "dirichlet" and not (alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"dirichlet alpha must be a finite float > 0, got {alpha!r}")


def partition_indices(
    labels: torch.Tensor,
    num_workers: int,
    scheme: str = "iid",
    alpha: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Split ``range(len(labels))`` into ``num_workers`` disjoint, covering, non-empty shards.

    ``scheme="iid"`` shuffles and cuts into near-equal shards. ``scheme="dirichlet"``
    draws, for each label, the share of its examples each worker receives from
    Dirichlet(alpha); small alpha gives strong label skew. Workers left empty are then
    given one example each from the largest shard. Each shard is a sorted LongTensor.

    Raises ``ValueError`` for an unknown scheme, ``alpha <= 0``, or more workers than
    examples.
    """
    labels = torch.as_tensor(labels).reshape(-1).cpu()
    n = int(labels.numel())
    _check(n, num_workers, scheme, float(alpha))
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    rng = np.random.default_rng(seed)

    if scheme == "iid":
        perm = rng.permutation(n)
        shards = [np.sort(s) for s in np.array_split(perm, num_workers)]
    else:
        lab = labels.numpy()
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_workers)]
        for c in np.unique(lab):
            idx = rng.permutation(np.flatnonzero(lab == c))
            share = rng.dirichlet(np.full(num_workers, float(alpha)))
            if not np.all(np.isfinite(share)) or share.sum() <= 0:  # tiny alpha underflow
                share = np.zeros(num_workers)
                share[rng.integers(num_workers)] = 1.0
            cuts = (np.cumsum(share)[:-1] * len(idx)).round().astype(np.int64)
            for w, part in enumerate(np.split(idx, cuts)):
                buckets[w].append(part)
        shards = [np.concatenate(b) if b else np.zeros(0, np.int64) for b in buckets]
        # Repair: give each empty worker one example from the currently largest shard.
        for w in range(num_workers):
            if len(shards[w]) == 0:
                big = int(np.argmax([len(s) for s in shards]))
                take = rng.integers(len(shards[big]))
                shards[w] = shards[big][take : take + 1]
                shards[big] = np.delete(shards[big], take)
        shards = [np.sort(s) for s in shards]
    return [torch.from_numpy(s.astype(np.int64)) for s in shards]


def label_skew(labels: torch.Tensor, shards: list[torch.Tensor]) -> float:
    """Mean total-variation distance between each shard's label histogram and the global one.

    0 means every worker sees the global label mix; values near 1 mean each worker
    sees labels the others rarely do. Shards are weighted by their size.
    """
    labels = torch.as_tensor(labels).reshape(-1).cpu()
    k = int(labels.max()) + 1
    glob = torch.bincount(labels, minlength=k).double()
    glob /= glob.sum()
    total, dist = 0, 0.0
    for s in shards:
        h = torch.bincount(labels[s], minlength=k).double()
        dist += 0.5 * float((h / h.sum() - glob).abs().sum()) * len(s)
        total += len(s)
    return dist / total
