"""Model definitions, each with two faces that compute the same function.

- ``apply(params, x)``: a pure function of a ``dict[str, Tensor]``; no module state, so
  it works under ``torch.func.vmap`` and ``torch.func.grad``.
- ``module()``: a plain ``nn.Module`` built from standard layers whose
  ``named_parameters()`` have exactly the names and shapes of ``params``.

The two faces are written independently (e.g. hand-written attention against
``scaled_dot_product_attention``, a hand-written GRU cell against ``nn.GRU``), and the
tests check that they agree.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "BN_EPS",
    "Model",
    "MLP",
    "CNN",
    "Transformer",
    "GRU",
    "MatrixFactorisation",
    "MatrixFactorisationModule",
    "batch_norm",
]

BN_EPS = 1e-5  # batch norm's variance epsilon, as nn.BatchNorm's default
ACTIVATIONS = {"relu": F.relu, "tanh": torch.tanh, "gelu": F.gelu, "silu": F.silu}
_GAIN = {"relu": math.sqrt(2.0), "tanh": 1.0, "gelu": math.sqrt(2.0), "silu": math.sqrt(2.0)}

Params = dict[str, torch.Tensor]


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; valid choices: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Model(ABC):
    """Base class: a list of parameter specs, a pure ``apply`` and a ``module`` twin."""

    @abstractmethod
    def param_specs(self) -> list[tuple[str, tuple[int, ...], str | float]]:
        """``(name, shape, init)`` with init "zeros", "ones" or a normal std (before scaling)."""

    def init(self, generator: torch.Generator | None, init_scale: float = 1.0) -> Params:
        """Fresh parameters; weight standard deviations are multiplied by ``init_scale``."""
        params: Params = {}
        for name, shape, how in self.param_specs():
            if how == "zeros":
                params[name] = torch.zeros(shape)
            elif how == "ones":
                params[name] = torch.ones(shape)
            else:
                params[name] = torch.randn(shape, generator=generator) * (float(how) * init_scale)
        return params

    @abstractmethod
    def apply(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """Outputs for inputs ``x``; pure in ``params``."""

    @abstractmethod
    def module(self) -> nn.Module:
        """A fresh ``nn.Module`` with the same parameter names."""

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.param_specs())


def batch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Batch norm over dim 1 (features or channels) with the batch's own statistics.

    Mean and biased variance over every dim but 1 (the batch, and the spatial dims of
    images), then a per-feature scale and shift. No running statistics: train and eval
    compute the same thing, as ``nn.BatchNorm1d/2d(track_running_stats=False)``.
    Pure, so it works under ``torch.func.vmap`` (per-worker batches) and ``grad``.
    """
    dims = [d for d in range(x.dim()) if d != 1]
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, correction=0, keepdim=True)
    shape = (-1,) + (1,) * (x.dim() - 2)
    return (x - mean) * torch.rsqrt(var + BN_EPS) * weight.reshape(shape) + bias.reshape(shape)


def _bn_specs(prefix: str, width: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [(f"{prefix}.weight", (width,), "ones"), (f"{prefix}.bias", (width,), "zeros")]


# ----------------------------------------------------------------------------- MLP
class MLP(Model):
    """Fully connected network; ``hidden=()`` is a linear (logistic/linear regression) model.

    With ``batch_norm`` every hidden layer is followed by :func:`batch_norm` (parameters
    ``norms.{i}.weight`` and ``norms.{i}.bias``) before its activation.
    """

    def __init__(
        self,
        in_dim: int,
        hidden: tuple[int, ...],
        out_dim: int,
        activation: str,
        batch_norm: bool = False,
    ):
        self.sizes = (in_dim, *hidden, out_dim)
        self.activation = activation
        self.act = _activation(activation)
        self.batch_norm = batch_norm

    def param_specs(self):
        specs = []
        last = len(self.sizes) - 2
        for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            gain = 1.0 if i == last else _GAIN[self.activation]
            specs.append((f"layers.{i}.weight", (b, a), gain / math.sqrt(a)))
            specs.append((f"layers.{i}.bias", (b,), "zeros"))
        if self.batch_norm:  # after the layers, as the module registers them
            for i, b in enumerate(self.sizes[1:-1]):
                specs += _bn_specs(f"norms.{i}", b)
        return specs

    def apply(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        n = len(self.sizes) - 1
        for i in range(n):
            x = x @ params[f"layers.{i}.weight"].transpose(-1, -2) + params[f"layers.{i}.bias"]
            if i < n - 1:
                if self.batch_norm:
                    x = batch_norm(x, params[f"norms.{i}.weight"], params[f"norms.{i}.bias"])
                x = self.act(x)
        return x

    def module(self) -> nn.Module:
        return _MLPModule(self.sizes, self.act, self.batch_norm)


class _MLPModule(nn.Module):
    def __init__(self, sizes, act, batch_norm=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        if batch_norm:
            self.norms = nn.ModuleList(
                nn.BatchNorm1d(b, eps=BN_EPS, track_running_stats=False) for b in sizes[1:-1]
            )
        self.norm = batch_norm
        self.act = act

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                if self.norm:
                    x = self.norms[i](x)
                x = self.act(x)
        return x


# ----------------------------------------------------------------------------- CNN
class CNN(Model):
    """Two 3x3 convolutions (the second with stride 2) and a linear head, on 8x8 images.

    With ``batch_norm`` each convolution is followed by :func:`batch_norm` (parameters
    ``bn1.*`` and ``bn2.*``) before its activation.
    """

    def __init__(
        self,
        channels: tuple[int, int],
        num_classes: int,
        activation: str,
        side: int = 8,
        batch_norm: bool = False,
    ):
        self.c1, self.c2 = channels
        self.num_classes, self.side = num_classes, side
        self.activation = activation
        self.act = _activation(activation)
        self.flat = self.c2 * ((side + 1) // 2) ** 2
        self.batch_norm = batch_norm

    def param_specs(self):
        g = _GAIN[self.activation]
        bn = self.batch_norm
        return [
            ("conv1.weight", (self.c1, 1, 3, 3), g / 3.0),
            ("conv1.bias", (self.c1,), "zeros"),
            *(_bn_specs("bn1", self.c1) if bn else []),
            ("conv2.weight", (self.c2, self.c1, 3, 3), g / math.sqrt(9 * self.c1)),
            ("conv2.bias", (self.c2,), "zeros"),
            *(_bn_specs("bn2", self.c2) if bn else []),
            ("head.weight", (self.num_classes, self.flat), 1.0 / math.sqrt(self.flat)),
            ("head.bias", (self.num_classes,), "zeros"),
        ]

    def apply(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        p = params
        x = x.reshape(x.shape[0], 1, self.side, self.side)
        x = F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=1)
        if self.batch_norm:
            x = batch_norm(x, p["bn1.weight"], p["bn1.bias"])
        x = F.conv2d(self.act(x), p["conv2.weight"], p["conv2.bias"], stride=2, padding=1)
        if self.batch_norm:
            x = batch_norm(x, p["bn2.weight"], p["bn2.bias"])
        return F.linear(self.act(x).flatten(1), p["head.weight"], p["head.bias"])

    def module(self) -> nn.Module:
        return _CNNModule(self)


class _CNNModule(nn.Module):
    def __init__(self, m: CNN):
        super().__init__()
        self.side, self.act = m.side, m.act

        def bn(c: int) -> nn.Module:
            if not m.batch_norm:
                return nn.Identity()
            return nn.BatchNorm2d(c, eps=BN_EPS, track_running_stats=False)

        self.conv1, self.bn1 = nn.Conv2d(1, m.c1, 3, padding=1), bn(m.c1)
        self.conv2, self.bn2 = nn.Conv2d(m.c1, m.c2, 3, stride=2, padding=1), bn(m.c2)
        self.head = nn.Linear(m.flat, m.num_classes)

    def forward(self, x):
        x = x.reshape(x.shape[0], 1, self.side, self.side)
        x = self.act(self.bn1(self.conv1(x)))
        x = self.act(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1))


# ----------------------------------------------------------------------------- Transformer
class Transformer(Model):
    """One pre-norm transformer block over characters, causal, learned positions."""

    def __init__(
        self, vocab: int, context: int, dim: int, heads: int = 2, activation: str = "gelu"
    ):
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.vocab, self.context, self.dim, self.heads = vocab, context, dim, heads
        self.activation = activation
        self.act = _activation(activation)

    def param_specs(self):
        d, v = self.dim, self.vocab
        s = 1.0 / math.sqrt(d)
        return [
            ("tok.weight", (v, d), 0.5),
            ("pos.weight", (self.context, d), 0.1),
            ("ln1.weight", (d,), "ones"),
            ("ln1.bias", (d,), "zeros"),
            ("qkv.weight", (3 * d, d), s),
            ("qkv.bias", (3 * d,), "zeros"),
            ("proj.weight", (d, d), s),
            ("proj.bias", (d,), "zeros"),
            ("ln2.weight", (d,), "ones"),
            ("ln2.bias", (d,), "zeros"),
            ("fc1.weight", (4 * d, d), s),
            ("fc1.bias", (4 * d,), "zeros"),
            ("fc2.weight", (d, 4 * d), 0.5 * s),
            ("fc2.bias", (d,), "zeros"),
            ("lnf.weight", (d,), "ones"),
            ("lnf.bias", (d,), "zeros"),
            ("head.weight", (v, d), s),
            ("head.bias", (v,), "zeros"),
        ]

    def apply(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        p, d, nh = params, self.dim, self.heads
        b, t = x.shape
        h = F.embedding(x, p["tok.weight"]) + p["pos.weight"][:t]
        a = F.layer_norm(h, (d,), p["ln1.weight"], p["ln1.bias"])
        q, k, v = F.linear(a, p["qkv.weight"], p["qkv.bias"]).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, nh, d // nh).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // nh)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        h = h + F.linear(y, p["proj.weight"], p["proj.bias"])
        a = F.layer_norm(h, (d,), p["ln2.weight"], p["ln2.bias"])
        h = h + F.linear(
            self.act(F.linear(a, p["fc1.weight"], p["fc1.bias"])), p["fc2.weight"], p["fc2.bias"]
        )
        h = F.layer_norm(h, (d,), p["lnf.weight"], p["lnf.bias"])
        return F.linear(h, p["head.weight"], p["head.bias"])

    def module(self) -> nn.Module:
        return _TransformerModule(self)


class _TransformerModule(nn.Module):
    def __init__(self, m: Transformer):
        super().__init__()
        d = m.dim
        self.heads, self.act = m.heads, m.act
        self.tok = nn.Embedding(m.vocab, d)
        self.pos = nn.Embedding(m.context, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, m.vocab)

    def forward(self, x):
        b, t = x.shape
        d = self.tok.embedding_dim
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        q, k, v = self.qkv(self.ln1(h)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(y.transpose(1, 2).reshape(b, t, d))
        h = h + self.fc2(self.act(self.fc1(self.ln2(h))))
        return self.head(self.lnf(h))


# ----------------------------------------------------------------------------- GRU
class GRU(Model):
    """Character embedding, one GRU layer (PyTorch's gate layout) and a linear head."""

    def __init__(self, vocab: int, embed: int, hidden: int):
        self.vocab, self.embed, self.hidden = vocab, embed, hidden

    def param_specs(self):
        e, h, v = self.embed, self.hidden, self.vocab
        s = 1.0 / math.sqrt(h)
        return [
            ("emb.weight", (v, e), 0.5),
            ("rnn.weight_ih_l0", (3 * h, e), 1.0 / math.sqrt(e)),
            ("rnn.weight_hh_l0", (3 * h, h), s),
            ("rnn.bias_ih_l0", (3 * h,), "zeros"),
            ("rnn.bias_hh_l0", (3 * h,), "zeros"),
            ("head.weight", (v, h), s),
            ("head.bias", (v,), "zeros"),
        ]

    def apply(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        p = params
        n = self.hidden
        gi = F.linear(F.embedding(x, p["emb.weight"]), p["rnn.weight_ih_l0"], p["rnn.bias_ih_l0"])
        gi_rz, gi_n = gi[..., : 2 * n].unbind(1), gi[..., 2 * n :].unbind(1)
        h = gi.new_zeros(x.shape[0], n)
        outs = []
        for t in range(x.shape[1]):
            gh = F.linear(h, p["rnn.weight_hh_l0"], p["rnn.bias_hh_l0"])
            r, z = torch.sigmoid(gi_rz[t] + gh[:, : 2 * n]).chunk(2, dim=-1)
            c = torch.tanh(gi_n[t] + r * gh[:, 2 * n :])
            h = c + z * (h - c)  # = (1 - z) * c + z * h
            outs.append(h)
        return F.linear(torch.stack(outs, dim=1), p["head.weight"], p["head.bias"])

    def module(self) -> nn.Module:
        return _GRUModule(self)


class _GRUModule(nn.Module):
    def __init__(self, m: GRU):
        super().__init__()
        self.emb = nn.Embedding(m.vocab, m.embed)
        self.rnn = nn.GRU(m.embed, m.hidden, batch_first=True)
        self.head = nn.Linear(m.hidden, m.vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


# ----------------------------------------------------------------------------- MF
class MatrixFactorisation(Model):
    """A recommender: rating = <user row, item row> + user bias + item bias + global bias.

    The inputs are ``(user, item)`` id pairs. The tables are embedding tables: a batch
    gives a gradient to the rows of the ids it holds and leaves the others at zero, as
    ``nn.Embedding`` does (the row-sparse matrices an optimizer meets in recommenders and
    language models).
    """

    def __init__(self, users: int, items: int, dim: int):
        self.users, self.items, self.dim = users, items, dim

    def param_specs(self):
        return [
            ("user.weight", (self.users, self.dim), 0.1),
            ("item.weight", (self.items, self.dim), 0.1),
            ("user_bias.weight", (self.users, 1), "zeros"),
            ("item_bias.weight", (self.items, 1), "zeros"),
            ("bias", (1,), "zeros"),
        ]

    def apply(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        u, i = x[..., 0], x[..., 1]
        user, item = F.embedding(u, params["user.weight"]), F.embedding(i, params["item.weight"])
        biases = F.embedding(u, params["user_bias.weight"]) + F.embedding(
            i, params["item_bias.weight"]
        )
        return (user * item).sum(-1) + biases[..., 0] + params["bias"]

    def module(self) -> nn.Module:
        return MatrixFactorisationModule(self.users, self.items, self.dim)


class MatrixFactorisationModule(nn.Module):
    """Rating = <user, item> + user bias + item bias + global bias; embeddings N(0, 0.1).
    The module face of :class:`MatrixFactorisation`, and the validation family's
    recommender."""

    def __init__(self, users: int, items: int, dim: int):
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.user_bias, self.item_bias = nn.Embedding(users, 1), nn.Embedding(items, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        for emb in (self.user, self.item):
            nn.init.normal_(emb.weight, std=0.1)
        for emb in (self.user_bias, self.item_bias):
            nn.init.zeros_(emb.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, i = x[:, 0], x[:, 1]
        dot = (self.user(u) * self.item(i)).sum(-1)
        return dot + self.user_bias(u)[:, 0] + self.item_bias(i)[:, 0] + self.bias
