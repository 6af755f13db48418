"""The mixing math: one function shared by the simulator and the real workers.

A worker's tensor ``x`` moves towards its neighbours' tensors::

    mix(x, [x_j], [w_j]) = x + sum_j w_j * (x_j - x)

With symmetric weights ``w_ij = w_ji`` in ``[0, 1 / max(deg_i, deg_j)]`` every row of the
implied mixing matrix sums to 1 with a non-negative diagonal, and the network average is
preserved exactly (up to rounding), whatever the weights are. The learned weights come
from the optimizer network's edge head on features that are symmetric in the two ends;
callers order each pair by rank (lower rank first) so both ends run bitwise the same
float operations and get bitwise the same weight.

Robust mixing (``robust="clip"``) guards a worker against a neighbour that sends finite bad
values (faulty or malicious). It is self-centred clipping (He, Karimireddy & Jaggi, 2022)::

    x + sum_j w_j * clip(x_j - x, tau),   clip(z, tau) = z * min(1, tau / ||z||)

per tensor, with ``tau`` a multiple ``C`` of the distance to the *closest* neighbour (one
bad neighbour among honest ones cannot raise it), and a pull that falls off as ``1 / ||z||``
past ``REDESCEND * tau``, so a neighbour far from all the others is all but left out.
Since ``clip(z, tau) = s * z`` with a scalar ``s`` in ``(0, 1]``, clipping is plain
:func:`mix` with each weight scaled by its ``s`` (:func:`robust_weights`). The scaled
weights are not symmetric, so the network average is no longer kept exactly. A neighbour
that stays the closest one sets ``tau`` itself: a bad one that drifts away slowly enough
is not clipped (``benchmarks/robust_gossip.py`` measures when that matters).

The rules (:data:`RULES`) and which tensors of an exchange take which (:func:`tensor_rules`,
:func:`shares_state`) are decided here too, once for the simulator and the real workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from learned_opt.config import NetConfig
from learned_opt.features import edge_features, time_features
from learned_opt.network import Theta, edge_weight, head_is_nonzero, weight_of_logit

#: Robust mixing rules: ``None`` (plain mixing) or ``"clip"`` / ``"clip:C"`` (self-centred
#: clipping at ``C`` times the closest neighbour's distance).
ROBUST = (None, "clip")
#: The default ``C`` of ``"clip"``: chosen by ``benchmarks/robust_gossip.py``.
CLIP_MULTIPLE = 2.0
#: Past this many ``tau`` a neighbour's pull falls off as ``1 / distance`` (see
#: :func:`clip_scales`); chosen by ``benchmarks/robust_gossip.py``.
REDESCEND = 4.0


#: Rules the communicators accept.
RULES = ("metropolis", "uniform", "learned")


def shares_state(exchange: int, every: int) -> bool:
    """Whether the 0-based ``exchange`` of a run carries the optimizer's shared state when
    it is shared once every ``every`` exchanges: the exchanges after local steps
    ``every``, ``2 * every``, ... (every one for ``every=1``). The real workers
    (``GossipOptimizer(share_state_every=...)``) and the simulator
    (``InnerOptimizer.share_state_every``) both decide by this rule."""
    return (exchange + 1) % every == 0


def check_share_state_every(every) -> int:
    """``every`` as an int >= 1, or a ``ValueError`` that says what was wrong."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"share_state_every must be an int >= 1, got {every!r}")
    return every


def check_rule(rule: str, theta: Theta | None, cfg: NetConfig | None) -> None:
    """Raise ``ValueError`` for an unknown rule, or ``learned`` without theta and config."""
    if rule not in RULES:
        raise ValueError(f"unknown mixing rule {rule!r}; choose from {RULES}")
    if rule == "learned" and (theta is None or cfg is None):
        raise ValueError("mixing rule 'learned' needs theta and cfg (the network's config)")


def tensor_rules(rule: str, count: int, state: int = 0) -> list[str]:
    """The rule of each of ``count`` mixed tensors whose last ``state`` are optimizer state
    shared with the neighbours (the learned optimizer's moments, see
    :meth:`LearnedLocal.shared_state <learned_opt.distributed.local.LearnedLocal.shared_state>`):
    those take Metropolis weights under the learned rule, whose edge head reads parameters,
    and ``rule`` otherwise."""
    if not 0 <= state <= count:
        raise ValueError(f"state must be between 0 and the {count} tensors, got {state}")
    static = "metropolis" if rule == "learned" else rule
    return [rule] * (count - state) + [static] * state


def parse_robust(robust: str | None) -> float | None:
    """The clipping multiple ``C`` of a robust spec (``None`` for plain mixing), or a
    ``ValueError`` that says what was wrong."""
    if robust is None:
        return None
    name, _, arg = str(robust).partition(":") if isinstance(robust, str) else ("", "", "")
    if name != "clip":
        raise ValueError(f"unknown robust mixing {robust!r}; choose None, 'clip' or 'clip:C'")
    try:
        multiple = float(arg) if arg else CLIP_MULTIPLE
    except ValueError:
        multiple = float("nan")
    if not multiple > 0 or multiple == float("inf"):
        raise ValueError(f"robust={robust!r}: the clipping multiple C must be a number > 0")
    return multiple


def neighbour_distances(
    x: Tensor, neighbor_xs: Sequence[Tensor] | Tensor, batch_dims: int = 0
) -> Tensor:
    """``[D, *batch]``: ``||x_j - x||`` for each of the ``D`` neighbours, over all but the
    first ``batch_dims`` dimensions of ``x`` (the workers of a stacked tensor).
    ``neighbor_xs`` is a sequence of tensors shaped like ``x``, or one tensor ``[D, *x.shape]``
    (one pass for all of them)."""
    batch = x.shape[:batch_dims]
    if isinstance(neighbor_xs, Tensor):
        diff = (neighbor_xs - x).reshape(len(neighbor_xs), *batch, -1)
        return torch.linalg.vector_norm(diff, dim=-1)
    return torch.stack(
        [torch.linalg.vector_norm((xj - x).reshape(*batch, -1), dim=-1) for xj in neighbor_xs]
    )


def clip_scales(dist: Tensor, weights: Tensor, multiple: float = CLIP_MULTIPLE) -> Tensor:
    """The factors ``s_j`` of self-centred clipping, ``clip(x_j - x, tau) = s_j (x_j - x)``.

    ``dist`` and ``weights`` are ``[D, ...]``: dimension 0 indexes the neighbours, every
    other one an independent clip (a worker, a tensor). ``tau = multiple * min_j d_j`` over
    the neighbours with a non-zero weight and a non-zero distance (``s_j = 1`` where there is
    none), and ``s_j = min(1, tau / d_j) * min(1, REDESCEND * tau / d_j)``: each ``x_j - x``
    is clipped to length ``tau``, and past ``REDESCEND * tau`` its pull falls off as
    ``1 / d_j``, so a neighbour far from all the others is all but left out
    (:data:`REDESCEND` ``inf``: plain clipping). No neighbour moves ``x`` by more than
    ``w_j * tau``. Differentiable in ``dist``.
    """
    active = (weights != 0) & (dist > 0)
    tau = dist.masked_fill(~active, float("inf")).amin(0) * multiple
    tau = torch.where(torch.isinf(tau), 1.0, tau)
    scale = tau / torch.maximum(dist, tau)  # min(1, tau / d), with no inf in either branch
    if REDESCEND != float("inf"):
        far = tau * REDESCEND
        scale = scale * (far / torch.maximum(dist, far))
    return scale


def robust_weights(
    xs: Sequence[Tensor],
    neighbor_xs: Sequence[Sequence[Tensor] | Tensor],
    weights: Sequence[Tensor],
    multiple: float = CLIP_MULTIPLE,
    *,
    batch_dims: int = 0,
) -> list[Tensor]:
    """The clipped weights ``w_j * s_j`` (:func:`clip_scales`) of several tensors at once,
    each tensor clipped on its own: ``xs[t]``, its neighbours ``neighbor_xs[t]`` (as
    :func:`neighbour_distances` takes them) and its weights ``weights[t]``, ``[D, *batch]``.
    With them, plain :func:`mix` is the clipped mix. One clip for all the tensors keeps
    the operation count per step low (the simulator's mix); differentiable."""
    dist = torch.stack(
        [
            neighbour_distances(x, nb, batch_dims).to(torch.float64)
            for x, nb in zip(xs, neighbor_xs)
        ],
        dim=1,
    )
    stacked = torch.stack([w.to(dist) for w in weights], dim=1)
    scale = clip_scales(dist, stacked, multiple)
    return [w * s.to(w.dtype) for w, s in zip(weights, scale.unbind(1))]


def distance_lists(xs: Sequence[Tensor], neighbor_xs: Sequence[Sequence[Tensor]]) -> Tensor:
    """``[D, T]``: ``||x_j - x||`` of neighbour ``j`` for tensor ``t``, for one worker:
    ``xs[t]`` and its list of neighbour tensors ``neighbor_xs[t]``, one fused pass each
    (no autograd). A neighbour that sent NaN or Inf has a non-finite distance."""
    with torch.no_grad():
        dist = [torch.dist(xj, x) for x, nbs in zip(xs, neighbor_xs) for xj in nbs]
        if len({d.dtype for d in dist}) > 1:
            dist = [d.double() for d in dist]
        return torch.stack(dist).view(len(xs), -1).T


def robust_weight_lists(
    xs: Sequence[Tensor],
    neighbor_xs: Sequence[Sequence[Tensor]],
    weights: Sequence[Sequence[Tensor | float]],
    multiple: float = CLIP_MULTIPLE,
    dist: Tensor | None = None,
) -> list[list[float]]:
    """:func:`robust_weights` for one worker, without autograd, in few operations (a real
    worker's step): ``xs[t]`` with its list of neighbour tensors ``neighbor_xs[t]`` and
    list of weights ``weights[t]`` (floats or 0-d tensors), as :func:`mix` takes them.
    ``dist``: their :func:`distance_lists`, when already computed. Returns the clipped
    weights as lists of floats."""
    with torch.no_grad():
        if dist is None:
            dist = distance_lists(xs, neighbor_xs)
        flat = [float(w) for ws in weights for w in ws]
        w = torch.tensor(flat, dtype=dist.dtype, device=dist.device).view(len(xs), -1).T
        return (w * clip_scales(dist, w, multiple)).T.tolist()


def mix(
    x: Tensor,
    neighbor_xs: Sequence[Tensor],
    weights: Sequence[Tensor | float],
    *,
    out: Tensor | None = None,
    robust: str | None = None,
    batch_dims: int = 0,
) -> Tensor:
    """``x + sum_j w_j * (x_j - x)``, computed as ``(1 - sum_j w_j) * x + sum_j w_j * x_j``.

    ``robust`` (see :data:`ROBUST`): ``"clip"`` clips each ``x_j - x`` first
    (:func:`robust_weights`); the first ``batch_dims`` dimensions of ``x`` then index
    workers, each clipped on its own, and tensor weights are shaped
    ``x.shape[:batch_dims] + (1, ...)``.

    Weights may be floats or tensors that broadcast against ``x`` (the simulator passes one
    weight per stacked worker). Under autograd it builds a new tensor and is differentiable
    in ``x``, the neighbours and the weights. Without autograd it writes into ``out`` (which
    may be ``x`` itself, for an in-place mix without temporaries) or a new tensor, using one
    pass over ``x`` and one per neighbour (``robust`` adds one more per neighbour, and one
    temporary the size of ``x`` at a time). Neighbours and weights are never modified.
    """
    if len(neighbor_xs) != len(weights):
        raise ValueError(f"mix got {len(neighbor_xs)} neighbours but {len(weights)} weights")
    multiple = parse_robust(robust)
    if not neighbor_xs:
        return x if out is None else out.copy_(x)
    tracked = torch.is_grad_enabled() and (
        x.requires_grad
        or any(t.requires_grad for t in neighbor_xs)
        or any(isinstance(w, Tensor) and w.requires_grad for w in weights)
    )
    if multiple is not None and not batch_dims and not tracked:  # a real worker's tensor
        weights = robust_weight_lists([x], [neighbor_xs], [weights], multiple)[0]
    elif multiple is not None:  # computed from x before an in-place mix overwrites it
        batch = x.shape[:batch_dims]
        w = [torch.as_tensor(wj, dtype=x.dtype, device=x.device) for wj in weights]
        flat = torch.stack([wj.reshape(batch) if wj.dim() else wj.expand(batch) for wj in w])
        scaled = robust_weights([x], [neighbor_xs], [flat], multiple, batch_dims=batch_dims)[0]
        weights = [s.reshape(wj.shape) for wj, s in zip(w, scaled)]
    self_weight = 1.0 - sum(weights)
    if tracked:
        if out is not None:
            raise ValueError("mix(out=...) is for the no-grad path; autograd needs a new tensor")
        result = x * self_weight
        for xj, w in zip(neighbor_xs, weights):
            result = result + w * xj
        return result
    result = torch.mul(x, self_weight, out=out) if out is not None else x * self_weight
    for xj, w in zip(neighbor_xs, weights):
        if not isinstance(w, Tensor) and xj.dtype != result.dtype:
            # bfloat16 state into float32: add_ with alpha took 2.5x an addcmul_'s time there
            w = torch.tensor(w, dtype=result.dtype, device=result.device)
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
    if edge_head_is_zero(theta):  # the features cannot change the weight: skip reading y
        return weight_of_logit(y_a.new_zeros(()), max_degree)  # edge_weight's, bitwise
    feats = edge_features(y_a, y_b, loss_a, loss_b, max_degree)
    time = time_features(step, cfg, feats)
    return edge_weight(theta, cfg, feats, max_degree, time)


def edge_head_is_zero(theta: Theta) -> bool:
    """Whether the edge head's output layer is zero and nothing differentiates through it:
    every learned edge weight is then Metropolis-Hastings ``1 / (1 + max_degree)`` whatever
    the features (:func:`~learned_opt.network.edge_weight` at ``z = 0``), so
    :func:`learned_edge_weight` leaves out the features, which read both ends' tensors.
    Meta-training (theta requiring gradients, autograd on) always evaluates the head, so
    that a zero head still learns."""
    w, b = theta["edge_out.weight"], theta["edge_out.bias"]
    if torch.is_grad_enabled() and (w.requires_grad or b.requires_grad):
        return False
    return not head_is_nonzero(theta, "edge_out")
