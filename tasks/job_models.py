"""The models of the task distribution (:mod:`learned_opt.tasks.distribution`): plain
``nn.Module``\\ s, the way users write them.

Each model takes one input tensor and returns logits, predictions or, for the models that
score themselves (autoencoders, contrastive encoders, mixtures of experts), what their loss
in :mod:`learned_opt.tasks.jobs` reads. Sizes come from a drawn spec; nothing here draws.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def norm_1d(kind: str, width: int) -> nn.Module:
    """A feature norm: ``"batch"``, ``"layer"`` or ``"none"``."""
    return {"batch": lambda: nn.BatchNorm1d(width), "layer": lambda: nn.LayerNorm(width),
            "none": nn.Identity}[kind]()  # fmt: skip


def norm_2d(kind: str, channels: int) -> nn.Module:
    """A channel norm: ``"batch"`` or ``"group"`` (groups of 4 channels where they divide)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    groups = 4 if channels % 4 == 0 else 1
    return nn.GroupNorm(groups, channels)


def mlp(d_in: int, widths: tuple[int, ...], d_out: int, act: str = "relu", norm: str = "none"):
    """Linear layers of ``widths`` between ``d_in`` and ``d_out``, each hidden one followed
    by the norm and the activation."""
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Linear(d_in, w), norm_1d(norm, w), ACTIVATIONS[act]()]
        d_in = w
    layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers)


class ConvNet(nn.Module):
    """Conv, norm, ReLU blocks (every other one halves the size), pooled, then a linear head."""

    def __init__(self, c_in: int, channels: tuple[int, ...], d_out: int, norm: str):
        super().__init__()
        blocks: list[nn.Module] = []
        for i, c in enumerate(channels):
            stride = 2 if i % 2 == 1 else 1
            blocks += [nn.Conv2d(c_in, c, 3, stride, 1, bias=False), norm_2d(norm, c), nn.ReLU()]
            c_in = c
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, d_out)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3)))


class ResBlock(nn.Module):
    """``x + f(x)``: two convs with norms (images) or a pre-norm MLP (features)."""

    def __init__(self, width: int, conv: bool, norm: str):
        super().__init__()
        if conv:
            self.f = nn.Sequential(
                nn.Conv2d(width, width, 3, 1, 1, bias=False), norm_2d(norm, width), nn.ReLU(),
                nn.Conv2d(width, width, 3, 1, 1, bias=False), norm_2d(norm, width),
            )  # fmt: skip
        else:
            self.f = nn.Sequential(
                norm_1d(norm, width), nn.Linear(width, 2 * width), nn.GELU(),
                nn.Linear(2 * width, width),
            )  # fmt: skip

    def forward(self, x):
        return x + self.f(x)


class ResNet(nn.Module):
    """A stem, ``blocks`` residual blocks and a head, over images (``conv``) or features."""

    def __init__(self, d_in: int, width: int, blocks: int, d_out: int, conv: bool, norm: str):
        super().__init__()
        self.conv = conv
        self.stem = nn.Conv2d(d_in, width, 3, 1, 1) if conv else nn.Linear(d_in, width)
        self.blocks = nn.Sequential(*[ResBlock(width, conv, norm) for _ in range(blocks)])
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.head(F.relu(h).mean(dim=(2, 3)) if self.conv else h)


class RecurrentLM(nn.Module):
    """Next-character logits from an embedding, a GRU or an LSTM, and a linear head."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, cell: str):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.rnn = rnn(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


class Encoder(nn.Module):
    """Transformer layers over tokens of width ``dim`` with learned positions."""

    def __init__(self, dim: int, heads: int, layers: int, length: int, pre_norm: bool):
        super().__init__()
        self.pos = nn.Parameter(0.02 * torch.randn(length, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=pre_norm
        )
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, h, causal: bool = False):
        n = h.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n) if causal else None
        return self.norm(self.layers(h + self.pos[:n], mask=mask, is_causal=causal))


class TransformerLM(nn.Module):
    """A causal character transformer."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, length: int, pre_norm: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = Encoder(dim, heads, layers, length, pre_norm)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens), causal=True))


class VisionTransformer(nn.Module):
    """Patches of an image as tokens, mean-pooled into class logits."""

    def __init__(self, c_in: int, size: int, patch: int, dim: int, heads: int, layers: int,
                 d_out: int, pre_norm: bool):  # fmt: skip
        super().__init__()
        self.patch = nn.Conv2d(c_in, dim, patch, patch)
        self.encoder = Encoder(dim, heads, layers, (size // patch) ** 2, pre_norm)
        self.head = nn.Linear(dim, d_out)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(tokens).mean(1))


class TabularTransformer(nn.Module):
    """Each feature a token (its value times a learned vector plus a bias), a class token."""

    def __init__(self, features: int, dim: int, heads: int, layers: int, d_out: int,
                 pre_norm: bool):  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, dim) / math.sqrt(dim))
        self.bias = nn.Parameter(torch.zeros(features, dim))
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.encoder = Encoder(dim, heads, layers, features + 1, pre_norm)
        self.head = nn.Linear(dim, d_out)

    def forward(self, x):
        tokens = x.unsqueeze(-1) * self.weight + self.bias
        h = torch.cat([self.cls.expand(len(x), -1, -1), tokens], 1)
        return self.head(self.encoder(h)[:, 0])


class Recommender(nn.Module):
    """Ratings from user and item embeddings: their dot product and biases, or a two-tower
    MLP over the pair. Each batch touches a few rows of the tables."""

    def __init__(self, users: int, items: int, dim: int, towers: bool):
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
        for table in (self.user, self.item):
            nn.init.normal_(table.weight, std=1 / math.sqrt(dim))
        self.user_bias, self.item_bias = nn.Embedding(users, 1), nn.Embedding(items, 1)
        for table in (self.user_bias, self.item_bias):
            nn.init.zeros_(table.weight)
        self.towers = mlp(2 * dim, (2 * dim,), 1, "relu") if towers else None

    def forward(self, pairs):
        u, i = self.user(pairs[:, 0]), self.item(pairs[:, 1])
        score = self.towers(torch.cat([u, i], 1))[:, 0] if self.towers else (u * i).sum(1)
        return score + self.user_bias(pairs[:, 0])[:, 0] + self.item_bias(pairs[:, 1])[:, 0]


class AutoEncoder(nn.Module):
    """An MLP through a bottleneck; ``variational`` adds the reparameterised code and its KL
    (returned beside the reconstruction)."""

    def __init__(self, d: int, widths: tuple[int, ...], code: int, act: str, variational: bool):
        super().__init__()
        self.variational = variational
        self.encode = mlp(d, widths, 2 * code if variational else code, act)
        self.decode = mlp(code, tuple(reversed(widths)), d, act)

    def forward(self, x):
        z = self.encode(x)
        if not self.variational:
            return self.decode(z), z.new_zeros(())
        mu, log_var = z.chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * log_var).exp()
        kl = 0.5 * (mu.square() + log_var.exp() - 1 - log_var).sum(1).mean()
        return self.decode(z), kl


class GraphNet(nn.Module):
    """Graph convolutions ``relu(A h W)`` over a fixed normalised adjacency (a buffer)."""

    def __init__(self, adjacency: torch.Tensor, d_in: int, widths: tuple[int, ...], d_out: int):
        super().__init__()
        self.register_buffer("adjacency", adjacency)
        dims = (d_in, *widths, d_out)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = self.adjacency @ layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class MixtureOfExperts(nn.Module):
    """A stem, then ``experts`` MLPs mixed by a softmax gate over its top ``k``; returns the
    output and the load-balancing term (the experts' mean gate times their share of the
    batch's top choices, times the number of experts)."""

    def __init__(self, d_in: int, width: int, experts: int, k: int, d_out: int):
        super().__init__()
        self.k = k
        self.stem = nn.Sequential(nn.Linear(d_in, width), nn.GELU())
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            mlp(width, (2 * width,), width, "gelu") for _ in range(experts)
        )
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        h = self.stem(x)
        probs = self.gate(h).softmax(-1)
        top, idx = probs.topk(self.k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        out = torch.stack([e(h) for e in self.experts], 1)  # [batch, experts, width]
        mixed = (weights.unsqueeze(-1) * out).sum(1)
        share = F.one_hot(idx[:, 0], probs.shape[-1]).float().mean(0)
        balance = probs.shape[-1] * (probs.mean(0) * share).sum()
        return self.head(h + mixed), balance


class FourierMLP(nn.Module):
    """An MLP on fixed random Fourier features of low-dimensional inputs (``freqs`` 0: none)."""

    def __init__(self, d_in: int, widths: tuple[int, ...], act: str, freqs: int, scale: float):
        super().__init__()
        self.register_buffer("basis", scale * torch.randn(d_in, freqs))
        self.net = mlp(2 * freqs if freqs else d_in, widths, 1, act)

    def forward(self, x):
        if self.basis.shape[1]:
            x = torch.cat([torch.sin(x @ self.basis), torch.cos(x @ self.basis)], 1)
        return self.net(x)[:, 0]
