"""The hand-set constants of the update rule as meta-parameters: a vector ``theta_c``.

Each constant is one coordinate of ``theta_c``, bounded and parameterised so that
``theta_c = 0`` gives exactly the base rule's value (the shipped rule: the hand-set config of
``checkpoints/adapt_init_2x.pt``), and a unit of ``theta_c`` near 0 moves each constant by
its ``unit``:

* ``log``: a positive scale, ``base * exp(s)`` with ``s`` sigmoid-bounded to
  ``[log(lo / base), log(hi / base)]``; near the base a factor of ``e`` per unit;
* ``range``: a value in ``[lo, hi]``, ``base + (hi - lo) * (sigmoid(z0 + k t) - sigmoid(z0))``
  with ``sigmoid(z0)`` the base's place in the range and ``k`` such that the value moves by
  ``unit`` (a tenth of the range unless set) per unit near the base;
* ``clip``: a value whose base lies on its bound (``ortho_snr = 0``), ``clip(base + unit * t,
  lo, hi)``; evolution strategies need no gradient, so the kink does no harm.

The integer constants (``ns_steps``, ``ns_every``, ``adam_max_width``, ``ortho_min_dim``) are
not in the space: a small perturbation of a rounded value changes nothing, so evolution
strategies get no signal from them, and a large one is a different rule.

    >>> names = ("step_mult", "lr_adapt_rate")
    >>> fields = rule_fields(base_fields(net), names, torch.zeros(2))  # the base values
    >>> net2 = apply_theta(net, names, torch.tensor([0.5, -1.0]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from learned_opt.network import LearnedOptimizerNet, with_config


@dataclass(frozen=True)
class Constant:
    """One constant of the rule: its config field, parameterisation and bounds."""

    field: str
    kind: str  # "log", "range" or "clip"
    lo: float
    hi: float
    unit: float | None = None  # the change per unit of theta near the base (see above)
    fallback: str | None = None  # the field whose value a None base takes

    def value(self, base: float, t: float) -> float:
        """The constant at ``theta = t`` around ``base`` (``base`` itself at ``t = 0``)."""
        if self.kind == "clip":
            return min(self.hi, max(self.lo, base + (self.unit or 1.0) * t))
        if self.kind == "log":
            lo, hi = math.log(self.lo / base), math.log(self.hi / base)
            return base * math.exp(_bounded(0.0, lo, hi, t, self.unit or 1.0))
        unit = self.unit or (self.hi - self.lo) / 10
        return _bounded(base, self.lo, self.hi, t, unit)

    def check_base(self, base: float) -> None:
        inside = self.lo <= base <= self.hi if self.kind == "clip" else self.lo < base < self.hi
        if not inside:
            raise ValueError(
                f"rule constant {self.field}: the base value {base!r} lies outside its range "
                f"({self.lo}, {self.hi})"
            )


def _bounded(base: float, lo: float, hi: float, t: float, unit: float) -> float:
    """``base + (hi - lo) * (sigmoid(z0 + k t) - sigmoid(z0))``: in ``(lo, hi)``, exactly
    ``base`` at ``t = 0``, with slope ``unit`` there."""
    p = (base - lo) / (hi - lo)
    z0 = math.log(p / (1 - p))
    k = unit / ((hi - lo) * p * (1 - p))
    return base + (hi - lo) * (_sigmoid(z0 + k * t) - p)


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


#: Every constant the space knows; ranges hold what ``NetConfig`` and ``MixingConfig``
#: accept, and the values the hand search considered (see ``learned_opt/config.py``).
SPACE: dict[str, Constant] = {
    c.field: c
    for c in (
        Constant("step_mult", "log", 1e-4, 3e-2),
        Constant("ortho_step_mult", "log", 2e-4, 6e-2),
        Constant("lr_adapt_rate", "log", 1e-2, 2.0),
        Constant("lr_adapt_min", "range", -12.0, 0.0),
        Constant("lr_adapt_max", "range", 0.0, 12.0),
        Constant("lr_adapt_max_ortho", "range", 0.0, 8.0, fallback="lr_adapt_max"),
        Constant("lr_adapt_brake", "log", 1e-2, 1.0),
        Constant("table_step_mult", "log", 0.1, 100.0),
        Constant("ortho_nesterov", "range", 0.0, 1.0),
        Constant("ortho_snr", "clip", 0.0, 4.0, unit=0.5),
        Constant("clip_value", "log", 0.5, 30.0),
        # the rule under gossip (MixingConfig); single-worker runs do not exercise them
        Constant("lr_adapt_max_gossip", "range", 0.0, 10.0),
        Constant("lr_adapt_min_gossip", "range", -8.0, 0.0),
        Constant("lr_adapt_rate_gossip", "log", 1e-2, 2.0, fallback="lr_adapt_rate"),
    )
}

#: The constants meta-trained by default: those of the single-worker rule that the hand
#: search set.
DEFAULT_NAMES = (
    "step_mult",
    "ortho_step_mult",
    "lr_adapt_rate",
    "lr_adapt_min",
    "lr_adapt_max",
    "lr_adapt_max_ortho",
    "ortho_nesterov",
)


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple; a one-line ``ValueError`` for an unknown or repeated name."""
    names = tuple(names)
    unknown = [n for n in names if n not in SPACE]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(
            f"rule constants must be distinct names from {sorted(SPACE)}, got {list(names)}"
        )
    return names


def base_fields(net: LearnedOptimizerNet) -> dict:
    """The config fields (``NetConfig``'s and ``MixingConfig``'s) of ``net``: the base rule."""
    return {**net.config.to_dict(), **net.mixing.to_dict()}


def base_value(fields: dict, name: str) -> float:
    """The base value of constant ``name`` (a ``None`` field takes its fallback's)."""
    value = fields[name]
    if value is None:
        value = fields[SPACE[name].fallback]
    return float(value)


def rule_fields(base: dict, names: Sequence[str], theta) -> dict:
    """The config fields that ``theta`` (one value per name) sets, around ``base``'s
    values; ``theta = 0`` gives exactly the base values."""
    values = [float(t) for t in torch.as_tensor(theta, dtype=torch.float64).reshape(-1)]
    if len(values) != len(names):
        raise ValueError(f"theta has {len(values)} values for {len(names)} constants")
    out = {}
    for name, t in zip(names, values):
        constant, value = SPACE[name], base_value(base, name)
        constant.check_base(value)
        out[name] = value if t == 0.0 else constant.value(value, t)
    return out


def apply_theta(net: LearnedOptimizerNet, names: Sequence[str], theta) -> LearnedOptimizerNet:
    """A copy of ``net`` whose config holds the constants ``theta`` sets (its parameters
    kept)."""
    return with_config(net, rule_fields(base_fields(net), names, theta))


__all__ = [
    "DEFAULT_NAMES",
    "SPACE",
    "Constant",
    "apply_theta",
    "base_fields",
    "base_value",
    "check_names",
    "rule_fields",
]
