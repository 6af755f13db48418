"""Task families: seeded random distributions over tasks.

A family draws architecture widths, depths and activations, the initialisation scale,
the batch size, the dataset and label noise. ``family.sample(generator)`` is a pure
function of the generator's state, and ``task.describe()`` of a sample rebuilds the
identical task through ``from_description``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import torch

from .base import Task, TaskSpec, from_description
from .datasets import load_dataset

__all__ = ["TaskFamily", "get_family", "list_families", "FAMILIES"]

_ACTS = ("relu", "tanh", "gelu", "silu")
_CLASSIFICATION = ("digits", "breast_cancer", "wine", "iris", "spirals", "logreg_synth")
_REGRESSION = ("diabetes", "linreg_synth", "quadratic_ill")
# The broad family's held-out look-alikes avoid the held-out tasks' own datasets: the
# held-out autoencoder reconstructs digits, the held-out L2 logistic regression fits
# breast_cancer.
_AUTOENCODER = ("breast_cancer", "wine", "iris", "spirals", "logreg_synth", "diabetes")
_L2_LINEAR = tuple(d for d in _CLASSIFICATION if d != "breast_cancer")


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _widths(rng: random.Random, depth: int, lo: int = 8, hi: int = 256) -> tuple[int, ...]:
    if rng.random() < 0.5:  # one width for all layers
        return (int(round(_log_uniform(rng, lo, hi))),) * depth
    return tuple(int(round(_log_uniform(rng, lo, hi))) for _ in range(depth))


def _common(rng: random.Random, dataset: str, noise_hi: float) -> dict:
    n_train = load_dataset(dataset).num_train
    return {
        "init_scale": round(_log_uniform(rng, 0.3, 3.0), 4),
        "batch_size": min(rng.choice((16, 32, 64, 128)), n_train),
        "label_noise": 0.0 if rng.random() < 0.5 else round(rng.uniform(0.0, noise_hi), 4),
    }


def _mlp(rng: random.Random, name: str, max_width: int = 256) -> TaskSpec:
    dataset = rng.choice(_CLASSIFICATION)
    depth = rng.randint(1, 4)
    return TaskSpec(
        "mlp",
        dataset,
        _widths(rng, depth, hi=max_width),
        rng.choice(_ACTS),
        name=name,
        **_common(rng, dataset, 0.2),
    )


def _regression(rng: random.Random, name: str, max_width: int = 256) -> TaskSpec:
    dataset = rng.choice(_REGRESSION)
    depth = rng.choice((0, 1, 2, 3))
    model = "linear" if depth == 0 else "mlp"
    common = _common(rng, dataset, 0.3)
    if dataset == "quadratic_ill":
        common["label_noise"] = 0.0  # the targets are not standardised; keep them exact
    widths = _widths(rng, depth, hi=max_width)
    return TaskSpec(model, dataset, widths, rng.choice(_ACTS), name=name, **common)


def _cnn(rng: random.Random, name: str) -> TaskSpec:
    c1 = rng.choice((4, 8, 12, 16))
    c2 = rng.choice((8, 16, 24, 32))
    return TaskSpec(
        "cnn", "digits", (c1, c2), rng.choice(_ACTS), name=name, **_common(rng, "digits", 0.2)
    )


def _lm(rng: random.Random, name: str) -> TaskSpec:
    context = rng.choice((16, 32, 64))
    batch = rng.choice((16, 32, 64))
    scale = round(_log_uniform(rng, 0.5, 2.0), 4)
    if rng.random() < 0.7:
        dim = rng.choice((16, 32, 48, 64))
        hidden, model, act = (
            (dim, rng.choice((1, 2, 4))),
            "transformer",
            rng.choice(("gelu", "relu")),
        )
    else:
        hidden, model, act = (rng.choice((16, 32, 64)), rng.choice((32, 64))), "gru", "tanh"
    return TaskSpec(model, "chars", hidden, act, scale, batch, 0.0, context, name=name)


def _autoencoder(rng: random.Random, name: str) -> TaskSpec:
    """An MLP autoencoder with a bottleneck ``b`` narrower than the input: (h, b, h) or (b,)."""
    dataset = rng.choice(_AUTOENCODER)
    d = load_dataset(dataset).num_features
    b = rng.randint(1, max(1, d // 2))
    h = int(round(_log_uniform(rng, max(8, b + 1), 64)))
    hidden = (h, b, h) if rng.random() < 0.5 else (b,)
    common = _common(rng, dataset, 0.0)  # no label noise: an autoencoder ignores labels
    return TaskSpec("autoencoder", dataset, hidden, rng.choice(_ACTS), name=name, **common)


def _l2_linear(rng: random.Random, name: str) -> TaskSpec:
    """L2-regularised logistic regression, sometimes full batch."""
    dataset = rng.choice(_L2_LINEAR)
    common = _common(rng, dataset, 0.2)
    if rng.random() < 0.3:
        common["batch_size"] = load_dataset(dataset).num_train
    l2 = float(f"{_log_uniform(rng, 1e-4, 1e-1):.3g}")
    return TaskSpec("linear", dataset, name=name, l2=l2, **common)


def _with_batch_norm(spec: TaskSpec, rng: random.Random, p: float) -> TaskSpec:
    return dataclasses.replace(spec, norm="batch") if rng.random() < p else spec


def _broad(rng: random.Random, name: str) -> TaskSpec:
    u = rng.random()
    if u < 0.25:
        return _with_batch_norm(_mlp(rng, name, max_width=64), rng, 0.3)
    if u < 0.40:
        return _regression(rng, name, max_width=64)
    if u < 0.60:
        return _autoencoder(rng, name)
    if u < 0.75:
        return _l2_linear(rng, name)
    if u < 0.95:
        return _with_batch_norm(_cnn(rng, name), rng, 0.5)
    return _lm(rng, name)


#: The share of char LMs that :func:`_broad_seq` draws before falling back to :func:`_broad`.
SEQ_SHARE = 0.25


def _broad_seq(rng: random.Random, name: str) -> TaskSpec:
    if rng.random() < SEQ_SHARE:
        return _lm(rng, name)
    return _broad(rng, name)


def _mf(rng: random.Random, name: str) -> TaskSpec:
    """A matrix-factorisation recommender on synthetic ratings (not the validation
    recommender's data): a batch gives a gradient to a few percent of the user table."""
    dim = rng.choice((8, 16, 32))
    scale = round(_log_uniform(rng, 0.5, 2.0), 4)
    batch = rng.choice((32, 64, 128))
    return TaskSpec("mf", "ratings_synth", (dim,), "relu", scale, batch, name=name)


#: The share of recommenders that :func:`_broad_table` draws before :func:`_broad_seq`.
TABLE_SHARE = 0.1


def _broad_table(rng: random.Random, name: str) -> TaskSpec:
    if rng.random() < TABLE_SHARE:
        return _mf(rng, name)
    return _broad_seq(rng, name)


def _mixed(rng: random.Random, name: str) -> TaskSpec:
    u = rng.random()
    pick = _mlp if u < 0.45 else _regression if u < 0.75 else _cnn if u < 0.93 else _lm
    return pick(rng, name)


def _train(rng: random.Random, name: str) -> TaskSpec:
    u = rng.random()
    if u < 0.55:
        return _mlp(rng, name, max_width=64)
    if u < 0.85:
        return _regression(rng, name, max_width=64)
    return _cnn(rng, name)


class TaskFamily:
    """A named, seeded distribution over tasks.

    ``held_out`` marks a family kept for evaluation: meta-training refuses to sample it
    (see :func:`learned_opt.tasks.check_not_held_out`).
    """

    def __init__(
        self,
        name: str,
        sampler: Callable[[random.Random, str], TaskSpec],
        doc: str,
        held_out: bool = False,
    ):
        self.name, self._sampler, self.doc, self.held_out = name, sampler, doc, held_out

    def __repr__(self) -> str:
        return f"TaskFamily({self.name!r})"

    def sample_spec(self, generator: torch.Generator | None = None) -> TaskSpec:
        """Draw a task spec; consumes exactly one value from ``generator``."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return self._sampler(random.Random(seed), f"{self.name}:{seed % 10**8:08d}")

    def sample(self, generator: torch.Generator | None = None) -> Task:
        """Draw a random task from this family."""
        return Task(self.sample_spec(generator))

    @staticmethod
    def from_description(line: str) -> Task:
        """Rebuild a sampled task from its ``describe()`` line."""
        return from_description(line)


FAMILIES: dict[str, TaskFamily] = {
    f.name: f
    for f in [
        TaskFamily(
            "mlp_family", _mlp, "MLP classifiers: 1-4 layers of width 8-256 on six datasets"
        ),
        TaskFamily(
            "regression_family",
            _regression,
            "linear or MLP regression, incl. ill-conditioned quadratics",
        ),
        TaskFamily("cnn_family", _cnn, "small CNNs on 8x8 digits with sampled channels"),
        TaskFamily("lm_family", _lm, "tiny character transformers and GRUs on pydoc topics"),
        TaskFamily("mixed_family", _mixed, "mlp 45%, regression 30%, cnn 18%, lm 7%"),
        TaskFamily(
            "meta_family",
            _train,
            "the default meta-training mix: mlp 55%, regression 30% (widths 8-64), "
            "cnn 15%; no LMs and no wide nets, to keep meta-training fast",
        ),
        TaskFamily(
            "broad_family",
            _broad,
            "held-out-like tasks in the meta-training family: mlp classifiers 25% (30% with "
            "batch norm), regression 15%, autoencoders 20% (not on digits), L2 logistic "
            "regression 15% (not on breast_cancer), cnns 20% (50% with batch norm), char LMs "
            "5%; widths 8-64",
        ),
        TaskFamily(
            "broad_seq_family",
            _broad_seq,
            "broad_family with more sequence models: char LMs (transformers 70%, GRUs 30%) "
            "drawn first at 25%, then broad_family (about 29% LMs in all)",
        ),
        TaskFamily(
            "broad_table_family",
            _broad_table,
            "broad_seq_family with matrix-factorisation recommenders (embedding tables whose "
            "rows a batch mostly leaves without gradient) drawn first at 10%",
        ),
    ]
}


def list_families() -> list[str]:
    """Names accepted by :func:`get_family`."""
    return list(FAMILIES)


def get_family(name: str) -> TaskFamily:
    """A task family by name; ``ValueError`` naming the valid choices if unknown."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; valid choices: {list_families()}")
    return FAMILIES[name]
