"""The mixing math: one function shared by the simulator and the real workers.

A worker's tensor ``x`` moves towards its neighbours' tensors::

    mix(x, [x_j], [w_j]) = x + sum_j w_j * (x_j - x)

With symmetric weights ``w_ij = w_ji`` in ``[0, 1 / max(deg_i, deg_j)]`` every row of the
implied mixing matrix sums to 1 with a non-negative diagonal, and the network average is
preserved exactly (up to rounding), whatever the weights are. The learned weights come
from the optimizer network's edge head on features that are symmetric in the two ends;
callers order each pair by rank (lower rank first) so both ends run bitwise the same
float operations and get bitwise the same weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from learned_opt.config import NetConfig
from learned_opt.features import edge_features, time_features
from learned_opt.network import Theta, edge_weight


def mix(
    x: Tensor,
    neighbor_xs: Sequence[Tensor],
    weights: Sequence[Tensor | float],
    *,
    out: Tensor | None = None,
) -> Tensor:
    """``x + sum_j w_j * (x_j - x)``, computed as ``(1 - sum_j w_j) * x + sum_j w_j * x_j``.

    Weights may be floats or tensors that broadcast against ``x`` (the simulator passes one
    weight per stacked worker). Under autograd it builds a new tensor and is differentiable
    in ``x``, the neighbours and the weights. Without autograd it writes into ``out`` (which
    may be ``x`` itself, for an in-place mix without temporaries) or a new tensor, using one
    pass over ``x`` and one per neighbour. Neighbours and weights are never modified.
    """
    if len(neighbor_xs) != len(weights):
        raise ValueError(f"mix got {len(neighbor_xs)} neighbours but {len(weights)} weights")
    if not neighbor_xs:
        return x if out is None else out.copy_(x)
    self_weight = 1.0 - sum(weights)
    tracked = torch.is_grad_enabled() and (
        x.requires_grad
        or any(t.requires_grad for t in neighbor_xs)
        or any(isinstance(w, Tensor) and w.requires_grad for w in weights)
    )
    if tracked:
        if out is not None:
            raise ValueError("mix(out=...) is for the no-grad path; autograd needs a new tensor")
        result = x * self_weight
        for xj, w in zip(neighbor_xs, weights):
            result = result + w * xj
        return result
    result = torch.mul(x, self_weight, out=out) if out is not None else x * self_weight
    for xj, w in zip(neighbor_xs, weights):
        if isinstance(w, Tensor):
            result.addcmul_(xj, w)
        else:
            result.add_(xj, alpha=w)
    return result


def metropolis_weight(deg_i: int, deg_j: int) -> float:
    """Metropolis-Hastings weight of the edge between ranks of degrees ``deg_i`` and ``deg_j``."""
    return 1.0 / (1.0 + max(deg_i, deg_j))


def learned_edge_weight(
    theta: Theta,
    cfg: NetConfig,
    y_a: Tensor,
    y_b: Tensor,
    loss_a: Tensor | float | None,
    loss_b: Tensor | float | None,
    max_degree: int | Tensor,
    step: int | Tensor,
) -> Tensor:
    """Learned mixing weight (0-d) of one tensor on edge ``(a, b)``, in ``[0, 1/max_degree]``.

    ``a`` is the lower rank. ``loss_a``/``loss_b`` are the two batch losses, or ``None``
    (the loss features are then marked absent). ``step`` feeds the time features. Built from
    :func:`learned_opt.features.edge_features` and :func:`learned_opt.network.edge_weight`;
    differentiable in ``theta`` and the ``y``; works under ``torch.func.vmap``.
    """
    feats = edge_features(y_a, y_b, loss_a, loss_b, max_degree)
    time = time_features(step, cfg, feats)
    return edge_weight(theta, cfg, feats, max_degree, time)
