"""Offline data of the task distribution: scikit-learn tables, digits as images, the
standard library's help text, and synthetic generators whose structure and noise are drawn.

Everything is a float32 or int64 tensor; structure comes from a ``numpy`` generator that the
caller seeds, so a draw's data is reproducible from its seed. Loaded datasets are cached per
process.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .datasets import VOCAB_SIZE, _corpus, _encode

__all__ = ["VOCAB_SIZE", "Rows", "table", "images", "text", "ratings", "sbm_graph", "function"]


class Rows:
    """Minibatches of rows of ``x`` (and ``y``), drawn with replacement; a batch size of 0 is
    the full batch, the same tensors every step."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor | None = None):
        self.x, self.y = x, y

    def __call__(self, gen: torch.Generator, batch_size: int):
        if batch_size == 0:
            return self.x, self.y
        idx = torch.randint(len(self.x), (batch_size,), generator=gen)
        return self.x[idx], None if self.y is None else self.y[idx]


def _standardise(x: np.ndarray) -> torch.Tensor:
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    return torch.as_tensor(x, dtype=torch.float32)


@functools.cache
def _sklearn(name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets

    loader = {"digits": datasets.load_digits, "breast_cancer": datasets.load_breast_cancer,
              "wine": datasets.load_wine, "diabetes": datasets.load_diabetes}[name]  # fmt: skip
    data = loader()
    return data.data.astype(np.float64), data.target


CLASSIFICATION = ("digits", "breast_cancer", "wine", "synthetic")
REGRESSION = ("diabetes", "friedman1", "friedman2", "friedman3", "low_rank")


def table(name: str, rng: np.random.Generator, noise: float = 0.0):
    """``(x, y, classes)``: a standardised table and its targets (``classes`` 0: a
    regression target, standardised). ``"synthetic"`` and the regressions are generated
    from ``rng`` with ``noise``; ``noise`` on a real classification table flips that share
    of its labels."""
    from sklearn import datasets

    state = int(rng.integers(2**31))
    if name == "synthetic":
        d = int(rng.integers(8, 40))
        classes, clusters = int(rng.integers(2, 11)), int(rng.integers(1, 3))
        informative = max(int(d * rng.uniform(0.2, 0.8)), int(np.ceil(np.log2(classes * clusters))))
        x, y = datasets.make_classification(
            n_samples=int(rng.integers(500, 3000)), n_features=d,
            n_informative=informative, n_redundant=0,
            n_classes=classes, n_clusters_per_class=clusters,
            class_sep=float(rng.uniform(0.5, 2.0)), flip_y=noise, random_state=state,
        )  # fmt: skip
    elif name in ("digits", "breast_cancer", "wine"):
        x, y = _sklearn(name)
        classes = int(y.max()) + 1
        if noise:
            y = y.copy()
            flip = rng.random(len(y)) < noise
            y[flip] = rng.integers(0, classes, int(flip.sum()))
    else:
        classes = 0
        n = int(rng.integers(400, 3000))
        if name == "diabetes":
            x, y = _sklearn(name)
        elif name == "low_rank":
            x, y = datasets.make_regression(
                n_samples=n, n_features=int(rng.integers(10, 40)), n_informative=10,
                effective_rank=int(rng.integers(3, 20)), noise=0.0, random_state=state,
            )  # fmt: skip
        else:
            make = getattr(datasets, f"make_{name}")
            x, y = make(n_samples=n, noise=0.0, random_state=state)
        y = y + noise * y.std() * rng.standard_normal(len(y))
    y_t = torch.as_tensor(y, dtype=torch.long) if classes else _standardise(y[:, None])[:, 0]
    return _standardise(x), y_t, classes


def images(name: str, rng: np.random.Generator, noise: float = 0.0):
    """``(x, y, classes)`` images ``[n, c, s, s]``: the 8x8 digits (scaled to [0, 1]), or
    ``"blobs"``: per class a smooth random template of a drawn size and channel count, each
    image its template shifted by up to 2 pixels plus noise."""
    if name == "digits":
        x, y = _sklearn("digits")
        x = torch.as_tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
        return x, torch.as_tensor(y, dtype=torch.long), 10
    size, c = int(rng.choice([8, 12])), int(rng.choice([1, 3]))
    classes, n = int(rng.integers(3, 11)), int(rng.integers(800, 3000))
    grid = np.linspace(-1, 1, size)
    templates = np.zeros((classes, c, size, size))
    for k in range(classes):
        for _ in range(3):  # three Gaussian bumps per template
            cx, cy, w = rng.uniform(-0.8, 0.8), rng.uniform(-0.8, 0.8), rng.uniform(0.15, 0.5)
            bump = np.exp(-((grid[:, None] - cy) ** 2 + (grid[None] - cx) ** 2) / (2 * w * w))
            templates[k] += rng.standard_normal(c)[:, None, None] * bump
    y = rng.integers(0, classes, n)
    shifts = rng.integers(-2, 3, (n, 2))
    x = np.stack([np.roll(templates[k], tuple(s), axis=(1, 2)) for k, s in zip(y, shifts)])
    x = x + (0.2 + noise) * rng.standard_normal(x.shape)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long), classes


@functools.lru_cache(maxsize=1)
def _tokens() -> torch.Tensor:
    return torch.as_tensor(_encode(_corpus()))


class Text:
    """Windows of ``length + 1`` characters of the standard library's help text, from a
    drawn stretch of it; a batch is ``(inputs, next characters)``."""

    def __init__(self, rng: np.random.Generator, length: int, chars: int = 200_000):
        tokens = _tokens()
        start = int(rng.integers(0, len(tokens) - chars))
        self.tokens, self.length = tokens[start : start + chars], length

    def __call__(self, gen: torch.Generator, batch_size: int):
        starts = torch.randint(
            len(self.tokens) - self.length - 1, (batch_size or 256,), generator=gen
        )
        windows = self.tokens[starts[:, None] + torch.arange(self.length + 1)]
        return windows[:, :-1], windows[:, 1:]


def text(rng: np.random.Generator, length: int) -> Text:
    """A :class:`Text` stream over a drawn stretch of the corpus."""
    return Text(rng, length)


def ratings(rng: np.random.Generator, noise: float):
    """``(pairs, scores, users, items)``: ratings of a low-rank taste model with popularity
    skew (items drawn by a Zipf-like law), a drawn rank and noise."""
    users, items = int(rng.integers(200, 2000)), int(rng.integers(100, 1000))
    rank, n = int(rng.integers(2, 16)), int(rng.integers(5000, 30000))
    u_f, i_f = rng.standard_normal((users, rank)), rng.standard_normal((items, rank))
    popularity = 1.0 / np.arange(1, items + 1) ** rng.uniform(0.3, 1.2)
    who = rng.integers(0, users, n)
    what = rng.choice(items, n, p=popularity / popularity.sum())
    score = (u_f[who] * i_f[what]).sum(1) / np.sqrt(rank) + noise * rng.standard_normal(n)
    pairs = torch.as_tensor(np.stack([who, what], 1), dtype=torch.long)
    return pairs, torch.as_tensor(score, dtype=torch.float32), users, items


def sbm_graph(rng: np.random.Generator, noise: float):
    """``(adjacency, x, y, classes)``: a stochastic block model, its symmetric normalised
    adjacency with self-loops, node features (the class's mean plus noise) and classes."""
    n, classes = int(rng.integers(200, 800)), int(rng.integers(2, 8))
    y = rng.integers(0, classes, n)
    p_in, ratio = rng.uniform(0.02, 0.1), rng.uniform(0.05, 0.5)
    p = np.where(y[:, None] == y[None], p_in, p_in * ratio)
    a = np.triu(rng.random((n, n)) < p, 1)
    a = a + a.T + np.eye(n)
    d = 1.0 / np.sqrt(a.sum(1))
    d_feat = int(rng.integers(8, 64))
    means = rng.standard_normal((classes, d_feat))
    x = means[y] + (1.0 + 3 * noise) * rng.standard_normal((n, d_feat))
    adjacency = torch.as_tensor(d[:, None] * a * d[None], dtype=torch.float32)
    return adjacency, _standardise(x), torch.as_tensor(y, dtype=torch.long), classes


def function(rng: np.random.Generator, noise: float):
    """``(x, y)``: a drawn smooth function of 1-3 inputs (random sinusoids plus a quadratic)
    sampled at 256-2048 points, with noise; a scientific regression's data."""
    d, n = int(rng.integers(1, 4)), int(rng.integers(256, 2048))
    x = rng.uniform(-1, 1, (n, d))
    terms = int(rng.integers(2, 8))
    freq = rng.uniform(0.5, 6.0, (terms, d)) * rng.choice([-1, 1], (terms, d))
    y = (np.sin(x @ freq.T + rng.uniform(0, 6.3, terms)) * rng.standard_normal(terms)).sum(1)
    y = y + 0.5 * ((x @ rng.standard_normal(d)) ** 2)
    y = (y - y.mean()) / (y.std() + 1e-8) + noise * rng.standard_normal(n)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)
