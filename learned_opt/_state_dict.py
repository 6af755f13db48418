"""The check ``LearnedOptimizer.load_state_dict`` runs before it changes anything.

A state dict of another optimizer (``torch.optim.Adam``'s, say), or one saved for
parameters of other shapes, is refused with one line naming the parameter and what
differs; torch's own ``load_state_dict`` would accept either, and the next step would fail
far from the cause (a bare ``KeyError``, or a size assertion of the compiled kernel).
"""

from __future__ import annotations

from itertools import chain

from torch import Tensor

#: Per-parameter state of a LearnedOptimizer: required keys, then optional ones.
REQUIRED_STATE = ("m", "v")
OPTIONAL_STATE = ("log_lr", "step", "sparse_rows", "nonfinite_skips", "q")
#: Hyper-parameters of torch's built-in optimizers that a LearnedOptimizer's groups lack.
FOREIGN_GROUP_KEYS = (
    "betas", "momentum", "eps", "amsgrad", "dampening", "nesterov", "alpha",
    "rho", "lr_decay", "initial_accumulator_value", "momentum_decay", "etas", "step_sizes",
)  # fmt: skip


class StateDictError(ValueError):
    """A state dict that a LearnedOptimizer cannot load; nothing was loaded."""


def refuse_foreign_keys(group: dict, where: str, why: str, error=ValueError) -> None:
    """Raise ``error`` (one line: ``where``, the keys, ``why``) if the param group ``group``
    holds any of :data:`FOREIGN_GROUP_KEYS`."""
    foreign = sorted(k for k in FOREIGN_GROUP_KEYS if k in group)
    if foreign:
        raise error(f"{where} holds {', '.join(foreign)}: {why}")


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_entry(index: int, p: Tensor, entry: dict) -> None:
    """One parameter's saved state against the parameter it would be loaded into."""
    where = f"parameter {index} (shape {_shape(p)})"
    if not entry:
        return  # a parameter that has not stepped yet
    unknown = sorted(set(entry) - set(REQUIRED_STATE) - set(OPTIONAL_STATE))
    missing = [k for k in REQUIRED_STATE if k not in entry]
    if unknown or missing:
        raise StateDictError(
            f"{where}: saved state has keys {sorted(entry)}, a LearnedOptimizer's has "
            f"{list(REQUIRED_STATE + OPTIONAL_STATE)}: a state dict of another optimizer?"
        )
    # the momenta a rule reads: 1, or 2 for a row-sparse table (see step.moment_rows), or 3
    expected = {"m": [(k, *_shape(p)) for k in (1, 2, 3)], "v": [_shape(p)]}
    for key, shapes in expected.items():
        value = entry[key]
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise StateDictError(f"{where}: saved {key} is not a floating-point tensor")
        if _shape(value) not in shapes:
            shape = " or ".join(str(s) for s in shapes)
            raise StateDictError(
                f"{where}: saved {key} has shape {_shape(value)}, expected {shape}: "
                "state saved for other parameters, or in another order?"
            )
    q = entry.get("q")
    if q is not None and (
        not isinstance(q, Tensor) or not q.is_floating_point() or p.dim() != 2
        or _shape(q) != (min(p.shape),) * 2
    ):  # fmt: skip
        raise StateDictError(
            f"{where}: saved q is not a floating-point {min(p.shape, default=0)}-square matrix"
        )
    log_lr = entry.get("log_lr")
    if log_lr is not None and (not isinstance(log_lr, Tensor) or log_lr.numel() != 1):
        raise StateDictError(f"{where}: saved log_lr is not a one-element tensor")


def check_state_dict(param_groups: list[dict], state_dict: dict) -> None:
    """Raise :class:`StateDictError` (one line) unless ``state_dict`` is a LearnedOptimizer's
    state for parameters of the shapes in ``param_groups``."""
    try:
        _check(param_groups, state_dict)
    except StateDictError as exc:
        raise StateDictError(f"load_state_dict: {exc}; nothing was loaded") from None


def _check(param_groups: list[dict], state_dict: dict) -> None:
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise StateDictError("not an optimizer state dict (no 'state' and 'param_groups')")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise StateDictError(
            f"saved state has {len(saved_groups)} param groups, this optimizer {len(param_groups)}"
        )
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise StateDictError(
                f"param_groups[{g}] has {len(saved['params'])} parameters in the saved "
                f"state, {len(group['params'])} here"
            )
    saved_ids = chain.from_iterable(g["params"] for g in saved_groups)
    params = chain.from_iterable(g["params"] for g in param_groups)
    for index, (pid, p) in enumerate(zip(saved_ids, params)):
        entry = state_dict["state"].get(pid, {})
        if not isinstance(entry, dict):
            raise StateDictError(f"parameter {index}: saved state is not a dict")
        _check_entry(index, p, entry)
    for g, saved in enumerate(saved_groups):  # another optimizer's state before any step
        refuse_foreign_keys(
            saved, f"param_groups[{g}]", "a state dict of another optimizer (a "
            "LearnedOptimizer's groups hold lr, a multiplier, weight_decay and step)",
            StateDictError,
        )  # fmt: skip
