"""Held-out evaluation tasks: ordinary training jobs that meta-training never sees.

They are registered in :mod:`learned_opt.tasks.registry` with the held-out mark, and a
meta-training config that names one (or a held-out family) fails before training. Each
is written as a user writes a model: a plain ``nn.Module`` with PyTorch's default
initialisation, on offline data.

=====================  ===========================================================  =======
name                   what                                                          params
=====================  ===========================================================  =======
heldout_char_lm        2-layer causal transformer LM, pydoc topics, context 64        ~430k
heldout_autoencoder    MLP autoencoder 64-32-8-32-64 on digits (reconstruction MSE)     ~5k
heldout_logreg_l2      L2-regularised logistic regression, breast cancer, full batch     62
heldout_convnet_bn     conv net with batch norm on 8x8 digits                           ~90k
heldout_wide_mlp       32-1024-1024-1 MLP regressing a random teacher network           ~1.1M
=====================  ===========================================================  =======

Run any torch optimizer on one for N steps::

    import torch
    from learned_opt.tasks import get_task

    task = get_task("heldout_autoencoder")
    model, loss_fn, batches = task.workload(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # or LearnedOptimizer(...)
    for step, batch in zip(range(1000), batches):
        loss = loss_fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()

The functional face (``task.init``, ``task.loss``, ``task.worker_batches``) works as
for every task, so simulated decentralized workers run on them too
(``heldout_char_lm`` is expensive there). List them with
``learned_opt.tasks.list_heldout_tasks()``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .datasets import Dataset, _quantile_bins, _split, load_dataset
from .module_task import ModuleTask

__all__ = ["HELDOUT_BUILDERS", "CharTransformerLM", "ConvNetBN"]

LM_CONTEXT = 64
_TEACHER_SEED = 2024


# ----------------------------------------------------------------------------- models
class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_in = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 3 * dim))
        self.attn_out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.attn_in(h).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.attn_out(y.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(h)


class CharTransformerLM(nn.Module):
    """A small GPT-style character LM: token and position embeddings, blocks, a head."""

    def __init__(self, vocab: int, context: int, dim: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[-1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.lnf(h))


class ConvNetBN(nn.Module):
    """Three 3x3 conv layers with batch norm (batch statistics only) and an MLP head, 8x8."""

    def __init__(self, num_classes: int = 10):
        super().__init__()

        def conv(a: int, b: int) -> nn.Sequential:
            bn = nn.BatchNorm2d(b, track_running_stats=False)
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1), bn, nn.ReLU())

        self.features = nn.Sequential(
            conv(1, 32), conv(32, 64), nn.MaxPool2d(2), conv(64, 64), nn.MaxPool2d(2)
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 2 * 2, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(x.shape[0], 1, 8, 8)))


def _mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- data
def _reconstruction(name: str) -> Dataset:
    """``name``'s inputs as their own targets; label skew still follows the class labels."""
    d = load_dataset(name)
    return Dataset(
        f"{name}_reconstruction", "regression", d.x_train, d.x_train.clone(), d.x_test,
        d.x_test.clone(), 1, d.partition_labels,
    )  # fmt: skip


@functools.cache
def _teacher(n: int = 5120, d: int = 32, hidden: int = 64) -> Dataset:
    """Regression on a fixed random 2-layer tanh teacher network, with 5% label noise."""
    rng = np.random.default_rng(_TEACHER_SEED)
    x = rng.standard_normal((n, d))
    w1 = rng.standard_normal((d, hidden)) / math.sqrt(d)
    w2 = rng.standard_normal((hidden, hidden)) / math.sqrt(hidden)
    w3 = rng.standard_normal(hidden) / math.sqrt(hidden)
    y = np.tanh(np.tanh(x @ w1 * 1.5) @ w2 * 1.5) @ w3
    y = (y - y.mean()) / y.std() + 0.05 * rng.standard_normal(n)
    train, test = _split(n, _TEACHER_SEED)
    t = lambda a: torch.from_numpy(a).float()  # noqa: E731
    return Dataset(
        "teacher", "regression", t(x[train]), t(y[train]), t(x[test]), t(y[test]), 1,
        torch.from_numpy(_quantile_bins(y[train]).astype(np.int64)),
    )  # fmt: skip


# ----------------------------------------------------------------------------- the tasks
def _char_lm() -> ModuleTask:
    data = load_dataset("chars", context=LM_CONTEXT)
    return ModuleTask(
        "heldout_char_lm",
        lambda: CharTransformerLM(data.num_classes, LM_CONTEXT),
        data, batch_size=16,
        doc="2-layer causal transformer (dim 128, 4 heads) on pydoc topics, context 64",
    )  # fmt: skip


def _autoencoder() -> ModuleTask:
    return ModuleTask(
        "heldout_autoencoder", lambda: _mlp(64, 32, 8, 32, 64), _reconstruction("digits"),
        batch_size=64, doc="MLP autoencoder 64-32-8-32-64 on digits, reconstruction MSE",
    )  # fmt: skip


def _logreg_l2() -> ModuleTask:
    return ModuleTask(
        "heldout_logreg_l2", lambda: nn.Linear(30, 2), load_dataset("breast_cancer"),
        batch_size=None, l2=1e-3,
        doc="logistic regression on breast cancer, L2 1e-3 on the weights, full batch",
    )  # fmt: skip


def _convnet_bn() -> ModuleTask:
    return ModuleTask(
        "heldout_convnet_bn", ConvNetBN, load_dataset("digits"), batch_size=64,
        doc="3 conv layers with batch norm and an MLP head on 8x8 digits",
    )  # fmt: skip


def _wide_mlp() -> ModuleTask:
    return ModuleTask(
        "heldout_wide_mlp", lambda: _mlp(32, 1024, 1024, 1), _teacher(), batch_size=128,
        doc="32-1024-1024-1 ReLU MLP regressing a random tanh teacher network",
    )  # fmt: skip


#: The held-out tasks by name, each built on first use.
HELDOUT_BUILDERS = {
    "heldout_char_lm": _char_lm,
    "heldout_autoencoder": _autoencoder,
    "heldout_logreg_l2": _logreg_l2,
    "heldout_convnet_bn": _convnet_bn,
    "heldout_wide_mlp": _wide_mlp,
}
