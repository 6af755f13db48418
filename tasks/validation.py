"""Validation tasks: where every choice about the rule is made, apart from meta-training
and from the held-out suite.

A bound, a base step, a feature or the rule that runs under gossip is chosen on this
family, and the held-out suite (:mod:`learned_opt.tasks.heldout`) is run once afterwards
to confirm it. The tasks are registered with the validation mark, so a meta-training
config that names one fails before training (:func:`learned_opt.tasks.check_not_held_out`),
and none equals a registry or held-out task: the data, the architecture or both differ.
Every task is a plain ``nn.Module`` (PyTorch's default initialisation unless said) on
offline data (scikit-learn generators, ``pydoc_data.topics``, synthetic sequences).

=====================  ==========================================================  =======
name                   what                                                          params
=====================  ==========================================================  =======
val_synth40_mlp        40-64-64-4 ReLU MLP, synthetic 40-feature classification       ~7k
val_friedman_mlp       10-64-64-1 tanh MLP, Friedman #1 regression                     ~5k
val_moons_mlp          2-32-32-2 ReLU MLP, two moons                                   ~1k
val_blobs_softmax      softmax regression, 12-feature blobs, 6 classes                  78
val_logreg_l2          L2 logistic regression, 60 synthetic features, noisy labels     122
val_gru_majority       GRU on token sequences: the most frequent token                 ~8k
val_lstm_lm            character LSTM language model, pydoc topics, context 48        ~60k
val_resmlp_ln          4 pre-LayerNorm residual blocks, width 96, 8 classes           ~80k
val_attn_copy          2-layer causal transformer, Markov-then-copy sequences         ~60k
val_mf_recsys          matrix factorisation, 4000 users x 300 items, dim 16           ~69k
val_wide256_mlp        64-256-256-256-10 ReLU MLP, synthetic 10-class data           ~150k
val_lstm192_lm         character LSTM language model, hidden 192, context 32          ~190k
=====================  ==========================================================  =======

:data:`SINGLE_PROBLEMS` pairs tasks with horizons (200 to 3000 steps) and
:data:`DECENTRALIZED_PROBLEMS` lists the simulated gossip settings (4-16 ranks; IID,
Dirichlet and "sampled" data; ring, torus and exponential graphs). ``partition="sampled"``
is what a validation task adds to the partitions of every task: each rank independently
draws its own class mix from Dirichlet(``alpha``) and a sample of ``num_train // ranks``
examples with that mix, with replacement, so ranks overlap and some examples belong to no
rank (:class:`SampledBatches`).
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch
from torch import nn

from .base import WorkerBatches
from .datasets import VOCAB_SIZE, Dataset, _quantile_bins, _split, _standardise, load_dataset
from .heldout import CharTransformerLM, _mlp
from .models import MatrixFactorisationModule
from .module_task import ModuleTask

__all__ = [
    "DECENTRALIZED_PROBLEMS",
    "SINGLE_PROBLEMS",
    "VALIDATION_BUILDERS",
    "SampledBatches",
    "ValidationTask",
]

_SEED = 3407  # the family's data seed; none of the registry's or the held-out suite's


# ----------------------------------------------------------------------------- data
def _table(name: str, x: np.ndarray, y: np.ndarray, kind: str, standardise: bool = True):
    """A train/test split of ``(x, y)``; regression targets standardised, and label skew
    following classes or, for regression, quantile bins of the target."""
    train, test = _split(len(x), _SEED + zlib.crc32(name.encode()) % 1000)
    x_tr, x_te = x[train], x[test]
    if standardise:
        x_tr, x_te = _standardise(x_tr, x_te)
    as_x = (lambda a: torch.from_numpy(a).float()) if standardise else torch.from_numpy
    if kind == "classification":
        y_tr, y_te = torch.from_numpy(y[train]).long(), torch.from_numpy(y[test]).long()
        return Dataset(name, kind, as_x(x_tr), y_tr, as_x(x_te), y_te, int(y.max()) + 1,
                       y_tr.clone())  # fmt: skip
    mu, sd = y[train].mean(), y[train].std()
    y_tr, y_te = (y[train] - mu) / sd, (y[test] - mu) / sd
    part = torch.from_numpy(_quantile_bins(y_tr).astype(np.int64))
    return Dataset(name, kind, as_x(x_tr), torch.from_numpy(y_tr).float(), as_x(x_te),
                   torch.from_numpy(y_te).float(), 1, part)  # fmt: skip


@functools.cache
def _sklearn_table(name: str) -> Dataset:
    from sklearn import datasets as skd

    if name == "synth40":
        x, y = skd.make_classification(3000, 40, n_informative=12, n_redundant=8, n_classes=4,
                                       random_state=_SEED)  # fmt: skip
    elif name == "friedman":
        x, y = skd.make_friedman1(3000, n_features=10, noise=0.5, random_state=_SEED)
        return _table(name, x, y, "regression")
    elif name == "moons":
        x, y = skd.make_moons(2000, noise=0.25, random_state=_SEED)
    elif name == "blobs":
        x, y = skd.make_blobs(3000, n_features=12, centers=6, cluster_std=5.0,
                              random_state=_SEED)  # fmt: skip
    elif name == "logreg60":
        x, y = skd.make_classification(4000, 60, n_informative=20, flip_y=0.05,
                                       random_state=_SEED + 1)  # fmt: skip
    elif name == "wide64":
        x, y = skd.make_classification(6000, 64, n_informative=24, n_classes=10,
                                       n_clusters_per_class=2, random_state=_SEED + 3)  # fmt: skip
    else:  # resmlp
        x, y = skd.make_classification(6000, 32, n_informative=16, n_classes=8,
                                       n_clusters_per_class=2, random_state=_SEED + 2)  # fmt: skip
    return _table(name, x, y, "classification")


@functools.cache
def _majority(n: int = 4000, length: int = 20, vocab: int = 6) -> Dataset:
    """Token sequences labelled by their most frequent token (ties: the lowest id)."""
    rng = np.random.default_rng(_SEED)
    x = rng.integers(0, vocab, (n, length))
    y = np.stack([np.bincount(r, minlength=vocab) for r in x]).argmax(1)
    return _table("majority", x, y, "classification", standardise=False)


@functools.cache
def _markov_copy(n: int = 4000, half: int = 16, vocab: int = 16) -> Dataset:
    """LM windows of a sparse Markov chain (4 successors per token) whose second half
    repeats the first: bigram statistics early, copying (induction) later."""
    rng = np.random.default_rng(_SEED)
    succ = np.stack([rng.choice(vocab, 4, replace=False) for _ in range(vocab)])
    seqs = np.zeros((n, half), np.int64)
    seqs[:, 0] = rng.integers(0, vocab, n)
    for t in range(1, half):
        seqs[:, t] = succ[seqs[:, t - 1], rng.integers(0, 4, n)]
    full = np.concatenate([seqs, seqs, seqs[:, :1]], axis=1)  # length 2 * half + 1
    train, test = _split(n, _SEED)
    w = torch.from_numpy(full)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    return Dataset("markov_copy", "lm", x[train], y[train], x[test], y[test], vocab,
                   torch.from_numpy(full[train, 0]))  # fmt: skip


@functools.cache
def _ratings(users: int = 4000, items: int = 300, per_user: int = 10, rank: int = 8) -> Dataset:
    """Synthetic ratings: a low-rank user-item matrix plus biases and noise; inputs are
    ``(user, item)`` id pairs; label skew follows quantile bins of the rating."""
    rng = np.random.default_rng(_SEED)
    u = rng.standard_normal((users, rank)) / rank**0.25
    v = rng.standard_normal((items, rank)) / rank**0.25
    who = np.repeat(np.arange(users), per_user)
    what = rng.integers(0, items, len(who))
    r = (u[who] * v[what]).sum(1) + 0.5 * rng.standard_normal(items)[what]
    r += 0.3 * rng.standard_normal(len(r))
    return _table("ratings", np.stack([who, what], 1), r, "regression", standardise=False)


# ----------------------------------------------------------------------------- models
class ResidualMLP(nn.Module):
    """Input projection, pre-LayerNorm residual blocks (Linear-GELU-Linear), a head."""

    def __init__(self, d_in: int, width: int, blocks: int, d_out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)
            )  # fmt: skip
            for _ in range(blocks)
        )
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class SequenceClassifier(nn.Module):
    """Token embedding, a one-layer GRU, and a linear head on the last hidden state."""

    def __init__(self, vocab: int, dim: int, hidden: int, classes: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(x))
        return self.head(out[:, -1])


class LSTMLM(nn.Module):
    """A character LM: embedding, a one-layer LSTM, a linear head at every position."""

    def __init__(self, vocab: int, dim: int, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(x))
        return self.head(out)


# ----------------------------------------------------------------------------- sampled ranks
class SampledBatches(WorkerBatches):
    """Batches of ranks that each drew their own skewed sample (see the module docstring).

    Each rank's class mix is a fresh Dirichlet(``alpha``) draw and its sample
    ``num_train // num_workers`` examples drawn with replacement with that mix; the
    draws follow ``seed``. Batches then sample each rank's own examples as for every
    partition.
    """

    def __init__(self, task, seed: int, num_workers: int, alpha: float, device=None):
        if not (alpha > 0 and np.isfinite(alpha)):
            raise ValueError(f"sampled alpha must be a finite float > 0, got {alpha!r}")
        super().__init__(task, seed, num_workers, "iid", 1.0, device)
        labels = task.data.partition_labels.numpy()
        by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        rng = np.random.default_rng(zlib.crc32(f"sampled:{int(seed)}".encode()))
        size = max(1, len(labels) // num_workers)
        shards = []
        for _ in range(num_workers):
            counts = rng.multinomial(size, rng.dirichlet(np.full(len(by_class), float(alpha))))
            parts = [rng.choice(pool, n) for pool, n in zip(by_class, counts) if n]
            shards.append(torch.from_numpy(np.sort(np.concatenate(parts)).astype(np.int64)))
        # the same fields WorkerBatches derives from its shards
        self.shards = shards
        self.sizes = torch.tensor([len(s) for s in shards])
        self._offsets = torch.cumsum(self.sizes, 0) - self.sizes
        self._flat = torch.cat(shards)


class ValidationTask(ModuleTask):
    """A :class:`ModuleTask` whose ranks can also draw independent skewed samples
    (``partition="sampled"``, :class:`SampledBatches`)."""

    def worker_batches(self, seed=0, num_workers=1, partition="iid", alpha=1.0, device=None):
        if partition == "sampled":
            return SampledBatches(self, seed, num_workers, alpha, device)
        return super().worker_batches(seed, num_workers, partition, alpha, device)


# ----------------------------------------------------------------------------- the tasks
def _task(name: str, factory, data, batch_size: int, doc: str, l2: float = 0.0):
    """``(name, builder)``: the builder makes the task on ``data()`` (built on first use)."""
    return name, lambda: ValidationTask(name, factory, data(), batch_size, l2=l2, doc=doc)


def _table_of(name: str):
    return functools.partial(_sklearn_table, name)


_BUILT = [
    _task("val_synth40_mlp", lambda: _mlp(40, 64, 64, 4), _table_of("synth40"), 64,
          "40-64-64-4 ReLU MLP on a synthetic 40-feature, 4-class classification"),
    _task("val_friedman_mlp",
          lambda: nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                nn.Linear(64, 1)),
          _table_of("friedman"), 64, "10-64-64-1 tanh MLP on Friedman #1 regression"),
    _task("val_moons_mlp", lambda: _mlp(2, 32, 32, 2), _table_of("moons"), 32,
          "2-32-32-2 ReLU MLP on two moons (noise 0.25)"),
    _task("val_blobs_softmax", lambda: nn.Linear(12, 6), _table_of("blobs"), 64,
          "softmax regression on 12-feature Gaussian blobs, 6 classes"),
    _task("val_logreg_l2", lambda: nn.Linear(60, 2), _table_of("logreg60"), 128,
          "logistic regression, 60 synthetic features, 5% flipped labels, L2 1e-3", l2=1e-3),
    _task("val_gru_majority", lambda: SequenceClassifier(6, 16, 48, 6), _majority, 64,
          "GRU (16 -> 48) naming the most frequent token of 20"),
    _task("val_lstm_lm", lambda: LSTMLM(VOCAB_SIZE, 32, 96),
          functools.partial(load_dataset, "chars", context=48), 16,
          "character LSTM LM (embedding 32, hidden 96) on pydoc topics, context 48"),
    _task("val_resmlp_ln", lambda: ResidualMLP(32, 96, 4, 8), _table_of("resmlp"), 128,
          "4 pre-LayerNorm residual blocks (width 96) on 32-feature, 8-class data"),
    _task("val_attn_copy", lambda: CharTransformerLM(16, 32, dim=48, heads=4, layers=2),
          _markov_copy, 32, "2-layer causal transformer (dim 48) on Markov-then-copy sequences"),
    _task("val_mf_recsys", lambda: MatrixFactorisationModule(4000, 300, 16), _ratings, 64,
          "matrix factorisation recommender, 4000 users x 300 items, 64 ratings a step "
          "(<= 1.6% of user rows get a gradient)"),
    _task("val_wide256_mlp", lambda: _mlp(64, 256, 256, 256, 10), _table_of("wide64"), 64,
          "64-256-256-256-10 ReLU MLP on a synthetic 64-feature, 10-class classification: "
          "the family's only matrices wider than 128 in both dimensions (256 x 256)"),
    _task("val_lstm192_lm", lambda: LSTMLM(VOCAB_SIZE, 32, 192),
          functools.partial(load_dataset, "chars", context=32), 16,
          "character LSTM LM (embedding 32, hidden 192: a 768 x 192 recurrent matrix) on "
          "pydoc topics, context 32"),
]  # fmt: skip


#: The validation tasks by name, each built on first use.
VALIDATION_BUILDERS = dict(_BUILT)

#: Single-worker problems: ``(task, horizon in steps, kind)``.
SINGLE_PROBLEMS = [
    ("val_synth40_mlp", 200, "tabular"),
    ("val_friedman_mlp", 200, "tabular"),
    ("val_moons_mlp", 200, "tabular"),
    ("val_blobs_softmax", 200, "tabular convex"),
    ("val_gru_majority", 500, "recurrent"),
    ("val_logreg_l2", 1000, "convex"),
    ("val_lstm_lm", 1000, "recurrent"),
    ("val_mf_recsys", 1000, "sparse embeddings"),
    ("val_attn_copy", 1500, "attention"),
    ("val_friedman_mlp", 2000, "tabular, long"),
    ("val_resmlp_ln", 3000, "residual + LayerNorm"),
    ("val_wide256_mlp", 1000, "256-wide MLP"),
    ("val_lstm192_lm", 1000, "recurrent, 192 wide"),
]


def _dec(task, workers, topology, partition, alpha, horizon=200, every=1) -> dict:
    return dict(task=task, workers=workers, topology=topology, partition=partition,
                alpha=alpha, horizon=horizon, every=every, seed=0)  # fmt: skip


#: Decentralized problems, the settings of :func:`benchmarks.heldout_decentralized.run_averaged`
#: (``alpha`` is unused under "iid").
DECENTRALIZED_PROBLEMS = [
    _dec("val_synth40_mlp", 4, "ring", "sampled", 0.3),
    _dec("val_synth40_mlp", 8, "ring", "dirichlet", 0.3),
    _dec("val_moons_mlp", 16, "torus", "dirichlet", 0.1),
    _dec("val_blobs_softmax", 4, "exponential", "iid", 1.0),
    _dec("val_friedman_mlp", 8, "exponential", "dirichlet", 1.0),
    _dec("val_blobs_softmax", 8, "torus", "sampled", 0.1),
    _dec("val_logreg_l2", 16, "exponential", "dirichlet", 0.3),
]
