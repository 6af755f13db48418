"""The learned optimizer network: a per-tensor network, a per-element MLP and an edge head.

The meta-parameters ``theta`` live only here, as an ``nn.Module``. Every forward piece is
also a pure function of a ``theta`` dict (``dict(net.named_parameters())``), so the same
code runs under ``torch.func.functional_call``, ``grad`` and ``vmap`` in meta-training.

The per-element MLP outputs a direction ``d`` and a log magnitude; the output stage that
turns them into the update is :func:`learned_opt.step.apply_update` (Adam is built in;
zero-initialised heads give exactly Adam).

Mixing weights lie in ``[0, 1 / max_degree]`` and start at Metropolis-Hastings
``1 / (1 + max_degree)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import (
    NUM_EDGE_STATS,
    NUM_ELEMENT_FEATURES,
    NUM_TENSOR_STATS,
    MixingConfig,
    NetConfig,
    split_config,
)
from .features import constant

Theta = dict[str, Tensor]


class LearnedOptimizerNet(nn.Module):
    """Holds theta; the step that uses it is :func:`learned_opt.step.tensor_step`."""

    def __init__(self, config: NetConfig | None = None, mixing: MixingConfig | None = None):
        super().__init__()
        self.config = config or NetConfig()  # the update rule
        self.mixing = mixing or MixingConfig()  # the mixing head, and the rule under gossip
        c = self.config
        t = c.num_time_features
        # nn.Linear draws its initial weights from torch's global generator: building an
        # optimizer must not move a user's random stream (reset_parameters sets them all)
        with torch.random.fork_rng(devices=[]):
            self._build_layers(c, t)
        self.reset_parameters()

    def _build_layers(self, c: NetConfig, t: int) -> None:
        # per-tensor network: tensor statistics + time -> (log step scale, context bias)
        self.tensor_in = nn.Linear(NUM_TENSOR_STATS + t, c.tensor_width)
        self.tensor_out = nn.Linear(c.tensor_width, 1 + c.width)
        # per-element MLP: features -> hidden -> hidden -> (direction, magnitude)
        self.elem_in = nn.Linear(NUM_ELEMENT_FEATURES, c.width)
        self.elem_time = nn.Linear(t, c.width, bias=False)  # time folded into the first bias
        self.elem_hidden = nn.Linear(c.width, c.width)
        self.elem_out = nn.Linear(c.width, 2)
        # edge head: symmetric edge features + time -> mixing logit
        self.edge_in = nn.Linear(NUM_EDGE_STATS + t, self.mixing.edge_width)
        self.edge_out = nn.Linear(self.mixing.edge_width, 1)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "mixing" not in self.__dict__:  # pickled before NetConfig and MixingConfig split
            self.config, self.mixing = split_config(dict(vars(self.config)))

    def reset_parameters(self) -> None:
        """Random hidden layers, zero output heads: the update is exactly Adam(lr=step_mult)
        and the mixing weights are exactly Metropolis-Hastings."""
        gen = torch.Generator().manual_seed(0)
        for lin in (self.tensor_in, self.elem_in, self.elem_hidden, self.edge_in):
            bound = 1.0 / math.sqrt(lin.in_features)
            with torch.no_grad():
                lin.weight.uniform_(-bound, bound, generator=gen)
                lin.bias.zero_()
        with torch.no_grad():
            self.elem_time.weight.zero_()
            for lin in (self.tensor_out, self.elem_out, self.edge_out):
                lin.weight.zero_()
                lin.bias.zero_()

    def theta(self) -> Theta:
        """The meta-parameters as a plain dict (what the pure functions take)."""
        return dict(self.named_parameters())

    def forward(self, *args, **kwargs):
        """The network is not called: it holds theta, and the step takes it.

        The step lives in :mod:`learned_opt.step` (which imports this module, not the other
        way round): ``tensor_step(net.theta(), net.config, p, g, m, v, step)``."""
        raise TypeError(
            "LearnedOptimizerNet holds theta and is not called; run a step with "
            "learned_opt.step.tensor_step(net.theta(), net.config, p, g, m, v, step), "
            "or use learned_opt.LearnedOptimizer"
        )


def head_is_nonzero(theta: Theta, name: str) -> bool:
    """Whether the output layer ``name`` of theta (``tensor_out``, ``elem_out``,
    ``edge_out``) holds a non-zero weight or bias: a zero one makes its network's output
    exactly zero, whatever the features."""
    return bool(theta[f"{name}.weight"].any() or theta[f"{name}.bias"].any())


def _linear(theta: Theta, name: str, x: Tensor) -> Tensor:
    bias = theta.get(f"{name}.bias")
    return F.linear(
        x, theta[f"{name}.weight"].to(x.dtype), None if bias is None else bias.to(x.dtype)
    )


def tensor_head(theta: Theta, cfg: NetConfig, stats: Tensor, time: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor network: ``(log_scale, context_bias)`` with the time features folded in.

    ``stats`` is ``(..., 8)`` (leading dims: tensors, workers) and ``time`` is ``(T,)``.
    ``context_bias`` (shape ``(..., width)``) is the full first-layer bias of the
    per-element MLP; ``log_scale`` has shape ``(...)``.
    """
    x = torch.cat([stats, time.expand(*stats.shape[:-1], time.shape[-1])], dim=-1)
    h = F.relu(_linear(theta, "tensor_in", x))
    out = _linear(theta, "tensor_out", h)
    log_scale = cfg.max_log_scale * torch.tanh(out[..., 0] / cfg.max_log_scale)
    return log_scale, out[..., 1:] + element_bias(theta, time)


def element_bias(theta: Theta, time: Tensor) -> Tensor:
    """The per-element MLP's own first-layer bias with the time features folded in
    (``(width,)``); the per-tensor network's context is added to it."""
    return theta["elem_in.bias"].to(time.dtype) + _linear(theta, "elem_time", time)


Layers = tuple[tuple[Tensor, Tensor], ...]


def element_layers(
    theta: Theta, cfg: NetConfig, dtype, first_bias: Tensor, feature_scales: Tensor | None = None
) -> Layers:
    """The per-element MLP as ``((weight, bias), ...)``, biases shaped to add to ``W @ x``.

    ``first_bias`` is the first layer's bias, already shaped to broadcast over elements:
    ``(..., H, 1)`` per tensor, or ``(..., H, n)`` per element when the tensors' contexts
    differ along the elements. ``feature_scales`` (``(..., F)``), when given, folds the
    per-tensor feature normalisation into the first layer's columns, so the features are
    never rescaled per element; ``None`` means the features come normalised. ``exp_mult``
    is folded into the magnitude row of the output layer. Leading dims of ``first_bias``
    and ``feature_scales`` batch over tensors.
    """
    out_mult = constant(((1.0,), (cfg.exp_mult,)), dtype, first_bias.device)
    w_in = theta["elem_in.weight"].to(dtype)
    if feature_scales is not None:
        w_in = w_in * feature_scales.unsqueeze(-2)
    w_h, b_h = theta["elem_hidden.weight"].to(dtype), theta["elem_hidden.bias"].to(dtype)
    w_o, b_o = theta["elem_out.weight"].to(dtype), theta["elem_out.bias"].to(dtype)
    return (
        (w_in, first_bias),
        (w_h, b_h.unsqueeze(-1)),
        (w_o * out_mult, b_o.unsqueeze(-1) * out_mult),
    )


def element_mlp(layers: Layers, x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-element MLP on features ``x`` (``[..., F, n]``): 2 hidden ReLU layers.

    Returns ``(d, log_mag)``, each ``[..., n]``: the direction and ``exp_mult * a``.
    """
    h = x
    for i, (w, b) in enumerate(layers):
        h = torch.matmul(w, h) + b
        if i < len(layers) - 1:
            h = torch.relu(h)
    return h[..., 0, :], h[..., 1, :]


def edge_weight(
    theta: Theta, cfg: NetConfig, edge_feats: Tensor, max_degree, time: Tensor
) -> Tensor:
    """Mixing weight of one edge for one tensor, in ``[0, 1 / max_degree]``.

    With a zero-initialised head it equals Metropolis-Hastings ``1 / (1 + max_degree)``.
    Inputs are symmetric edge features, so both ends compute the same weight.
    """
    x = torch.cat([edge_feats, time])
    h = F.relu(_linear(theta, "edge_in", x))
    return weight_of_logit(_linear(theta, "edge_out", h)[0], max_degree)


def weight_of_logit(z: Tensor, max_degree) -> Tensor:
    """The edge head's output ``z`` (0-d) as a mixing weight, ``sigmoid(log(d) + z) / d``
    with ``d = max_degree``: Metropolis-Hastings ``1 / (1 + d)`` at ``z = 0``."""
    deg = torch.as_tensor(max_degree, dtype=z.dtype, device=z.device)
    return torch.sigmoid(torch.log(deg) + z) / deg


def with_config(net: LearnedOptimizerNet, fields: dict) -> LearnedOptimizerNet:
    """A copy of ``net`` with ``fields`` of its configs (:class:`NetConfig`'s or
    :class:`MixingConfig`'s) replaced and its parameters kept; a field that is unknown,
    invalid or changes the network's shape raises a one-line ``ValueError``."""
    try:
        new = LearnedOptimizerNet(
            *split_config({**net.config.to_dict(), **net.mixing.to_dict(), **dict(fields)})
        )
        new.load_state_dict(net.state_dict())
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(str(exc).splitlines()[0]) from None
    return new
