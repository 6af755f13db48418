"""Offline datasets: scikit-learn toy sets, synthetic problems and a character corpus.

Every dataset is loaded once per process (``functools.lru_cache``), standardised with
training-set statistics and split into train and test with a fixed seed. Nothing is
ever downloaded: the scikit-learn sets ship inside the wheel, the synthetic sets are
generated from fixed seeds and the corpus is the standard library's
``pydoc_data.topics``.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "Dataset",
    "load_dataset",
    "list_datasets",
    "decode",
    "DATASET_KINDS",
    "RATINGS",
    "VOCAB_SIZE",
]

_SPLIT_SEED = 1234
_TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Dataset:
    """A train/test split held in memory as tensors.

    ``kind`` is "classification", "regression", "quadratic" or "lm". For "lm" the
    inputs and targets are token windows of shape ``[n, context]``.
    """

    name: str
    kind: str
    x_train: torch.Tensor  # [n_train, ...] float32 features, long tokens ("lm") or ids (RATINGS)
    y_train: torch.Tensor  # [n_train] long labels, float targets, or [n_train, context] tokens
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int  # classes (classification), vocabulary size (lm), 1 otherwise
    partition_labels: torch.Tensor  # [n_train] long labels used for label-skew partitions

    @property
    def num_features(self) -> int:
        """Width of one input row (context length for "lm")."""
        return int(self.x_train.shape[1])

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])


def _split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(n * _TEST_FRACTION)))
    return perm[n_test:], perm[:n_test]


def _standardise(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = train.mean(axis=0, keepdims=True)
    std = train.std(axis=0, keepdims=True)
    std = np.where(std > 1e-8, std, 1.0)
    return (train - mean) / std, (test - mean) / std


def _quantile_bins(y: np.ndarray, bins: int = 10) -> np.ndarray:
    """Label each target by its quantile bin, so regression data can be label-skewed."""
    edges = np.quantile(y, np.linspace(0, 1, bins + 1)[1:-1])
    return np.searchsorted(edges, y, side="right")


# ----------------------------------------------------------------------------- raw sources
def _sklearn(name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets as skd

    loader = {
        "digits": skd.load_digits,
        "breast_cancer": skd.load_breast_cancer,
        "wine": skd.load_wine,
        "iris": skd.load_iris,
        "diabetes": skd.load_diabetes,
    }[name]
    x, y = loader(return_X_y=True)
    return x.astype(np.float64), y


def _spirals(n: int = 1000, noise: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    y = np.arange(n) % 2
    t = np.sqrt(rng.uniform(0.05, 1.0, n)) * 3.0 * np.pi
    sign = np.where(y == 0, 1.0, -1.0)
    x = np.stack([sign * t * np.cos(t), sign * t * np.sin(t)], axis=1)
    return x + noise * rng.standard_normal(x.shape), y


def _logreg_synth(n: int = 2000, d: int = 20) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, d))
    w = rng.standard_normal(d) / np.sqrt(d) * 3.0
    p = 1.0 / (1.0 + np.exp(-(x @ w)))
    return x, (rng.uniform(size=n) < p).astype(np.int64)


def _linreg_synth(n: int = 2000, d: int = 20) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(13)
    x = rng.standard_normal((n, d))
    w = rng.standard_normal(d) / np.sqrt(d)
    return x, x @ w + 0.1 * rng.standard_normal(n)


def _quadratic_ill(
    n: int = 2048, d: int = 32, condition: float = 1e3
) -> tuple[np.ndarray, np.ndarray]:
    """Least squares whose Hessian E[a a^T] has the given condition number.

    Features are drawn with a log-spaced spectrum in a random rotation and are *not*
    standardised, so the loss is a noisy quadratic in the weights with an
    ill-conditioned Hessian.
    """
    rng = np.random.default_rng(17)
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    scales = np.sqrt(np.logspace(0, -np.log10(condition), d))
    x = (rng.standard_normal((n, d)) * scales) @ q.T
    w = rng.standard_normal(d)
    return x, x @ w + 0.05 * rng.standard_normal(n)


def _ratings_synth(
    users: int = 3000, items: int = 250, ratings: int = 24000, rank: int = 6
) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic ratings of a recommender: inputs are ``(user, item)`` id pairs, targets a
    low-rank user-item score plus user and item biases and noise. User activity and item
    popularity are heavy-tailed (log-normal and Zipf-like), so a batch touches a few
    percent of the user table and a popular head of the item table."""
    rng = np.random.default_rng(19)
    u = rng.standard_normal((users, rank)) / rank**0.25
    v = rng.standard_normal((items, rank)) / rank**0.25
    activity = rng.lognormal(0.0, 1.0, users)
    popularity = 1.0 / np.arange(1, items + 1) ** 0.8
    who = rng.choice(users, ratings, p=activity / activity.sum())
    what = rng.permutation(items)[rng.choice(items, ratings, p=popularity / popularity.sum())]
    score = (u[who] * v[what]).sum(1)
    score += 0.4 * rng.standard_normal(users)[who] + 0.4 * rng.standard_normal(items)[what]
    return np.stack([who, what], 1), score + 0.3 * rng.standard_normal(ratings)


def _corpus() -> str:
    import pydoc_data.topics as topics

    return "".join(topics.topics[k] for k in sorted(topics.topics))


# Vocabulary: newline, printable ASCII, and one id for everything else.
_VOCAB = ["\n"] + [chr(c) for c in range(32, 127)]
_UNK = len(_VOCAB)
VOCAB_SIZE = len(_VOCAB) + 1


def _encode(text: str) -> np.ndarray:
    table = np.full(128, _UNK, dtype=np.int64)
    for i, ch in enumerate(_VOCAB):
        table[ord(ch)] = i
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    out = np.full(codes.shape, _UNK, dtype=np.int64)
    ascii_mask = codes < 128
    out[ascii_mask] = table[codes[ascii_mask]]
    return out


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Turn character-LM token ids back into text ("?" for the unknown id)."""
    return "".join(_VOCAB[int(t)] if int(t) < len(_VOCAB) else "?" for t in tokens)


# ----------------------------------------------------------------------------- assembly
DATASET_KINDS = {
    "digits": "classification",
    "breast_cancer": "classification",
    "wine": "classification",
    "iris": "classification",
    "spirals": "classification",
    "logreg_synth": "classification",
    "diabetes": "regression",
    "linreg_synth": "regression",
    "quadratic_ill": "quadratic",
    "chars": "lm",
    "ratings_synth": "regression",
}

#: Datasets of ``(user, item)`` id pairs: only matrix factorisation (model ``"mf"``) fits
#: them, as ``(num_users, num_items)``.
RATINGS = {"ratings_synth": (3000, 250)}


def list_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`."""
    return sorted(DATASET_KINDS)


def _noise_seed(name: str, label_noise: float) -> int:
    return zlib.crc32(f"{name}:{label_noise!r}".encode())


def load_dataset(name: str, label_noise: float = 0.0, context: int = 32) -> Dataset:
    """Load (once per process) the named dataset.

    ``label_noise`` corrupts training targets only: for classification each label is
    replaced by a uniformly random class with that probability; for regression
    Gaussian noise of that standard deviation (in standardised units) is added.
    ``context`` is the window length of the "chars" corpus and is ignored otherwise.
    """
    if name not in DATASET_KINDS:
        raise ValueError(f"unknown dataset {name!r}; valid choices: {list_datasets()}")
    if not 0.0 <= label_noise < 1.0:
        raise ValueError(f"label_noise must be in [0, 1), got {label_noise}")
    if DATASET_KINDS[name] == "lm":
        return _load_chars(context)
    return _load_table(name, float(label_noise))


def _inputs(name: str, x: np.ndarray) -> torch.Tensor:
    """A table's inputs as a tensor: float32 features, or int64 ids for :data:`RATINGS`."""
    return torch.from_numpy(x).long() if name in RATINGS else torch.from_numpy(x).float()


@functools.lru_cache(maxsize=64)
def _load_table(name: str, label_noise: float) -> Dataset:
    kind = DATASET_KINDS[name]

    if name in ("digits", "breast_cancer", "wine", "iris", "diabetes"):
        x, y = _sklearn(name)
    else:
        x, y = {
            "spirals": _spirals,
            "logreg_synth": _logreg_synth,
            "linreg_synth": _linreg_synth,
            "quadratic_ill": _quadratic_ill,
            "ratings_synth": _ratings_synth,
        }[name]()
    train, test = _split(len(x), _SPLIT_SEED + zlib.crc32(name.encode()) % 1000)
    x_tr, x_te = x[train], x[test]
    if kind != "quadratic" and name not in RATINGS:  # id pairs stay integers
        x_tr, x_te = _standardise(x_tr, x_te)
    rng = np.random.default_rng(_noise_seed(name, label_noise))

    if kind == "classification":
        y = y.astype(np.int64)
        num_classes = int(y.max()) + 1
        y_tr, y_te = y[train].copy(), y[test]
        part = y_tr.copy()
        if label_noise > 0:
            flip = rng.uniform(size=len(y_tr)) < label_noise
            y_tr[flip] = rng.integers(0, num_classes, int(flip.sum()))
        y_tr_t = torch.from_numpy(y_tr)
        y_te_t = torch.from_numpy(y_te.astype(np.int64))
    else:
        num_classes = 1
        y_tr, y_te = y[train].astype(np.float64), y[test].astype(np.float64)
        if kind == "regression":
            mu, sd = y_tr.mean(), y_tr.std()
            y_tr, y_te = (y_tr - mu) / sd, (y_te - mu) / sd
        part = _quantile_bins(y_tr)
        if label_noise > 0:
            y_tr = y_tr + label_noise * rng.standard_normal(len(y_tr))
        y_tr_t = torch.from_numpy(y_tr).float()
        y_te_t = torch.from_numpy(y_te).float()

    return Dataset(
        name=name,
        kind=kind,
        x_train=_inputs(name, x_tr),
        y_train=y_tr_t,
        x_test=_inputs(name, x_te),
        y_test=y_te_t,
        num_classes=num_classes,
        partition_labels=torch.from_numpy(np.asarray(part, dtype=np.int64)),
    )


@functools.lru_cache(maxsize=8)
def _load_chars(context: int) -> Dataset:
    if not 4 <= context <= 512:
        raise ValueError(f"context must be in [4, 512], got {context}")
    tokens = _encode(_corpus())
    cut = int(len(tokens) * (1 - _TEST_FRACTION / 2))  # last 10% of the text is the test set

    def windows(arr: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n = (len(arr) - 1) // context
        starts = np.arange(n) * context
        idx = starts[:, None] + np.arange(context + 1)[None, :]
        w = torch.from_numpy(arr[idx])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    x_tr, y_tr = windows(tokens[:cut])
    x_te, y_te = windows(tokens[cut:])
    # Label skew for text: contiguous stretches of the corpus (roughly, topics).
    part = torch.from_numpy(_quantile_bins(np.arange(len(x_tr), dtype=np.float64)))
    return Dataset("chars", "lm", x_tr, y_tr, x_te, y_te, VOCAB_SIZE, part)
