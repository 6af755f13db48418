"""In-place learned steps through the differentiable :func:`~learned_opt.flat.flat_step`.

* :func:`packed_step_`: many small tensors (biases, norms) packed into one flat vector.
* :func:`stacked_step_`: tensors of one shape stacked as rows (the default on accelerators).

Both only lay the tensors out and copy the results back; the math is ``flat_step``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NetConfig
from .flat import flat_step
from .network import Theta
from .segments import FlatLayout, one_segment


@torch.no_grad()
def packed_step_(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: int,
    lr: float = 1.0,
) -> list[bool]:
    """In-place learned step of many tensors packed into one flat vector (:func:`flat_step`).

    For small tensors (biases, norms), where one call per tensor costs far more than the
    math: the tensors are packed into one flat vector, stepped with a few dozen large ops
    and copied back. ``states`` are :func:`~learned_opt.features.init_state` dicts, all of one
    compute dtype (float32 for bf16 parameters), which ``theta`` must share. Returns, per
    tensor, False where the gradient or the parameter was not finite and nothing changed.
    """
    layout = FlatLayout(tuple(map(str, range(len(params)))), tuple(p.shape for p in params))
    p, g, m, v = (
        torch.cat(ts, dim=-1).unsqueeze(0) for ts in _flat_operands(params, grads, states)
    )
    log_lr = _log_lrs(cfg, states, as_rows=False)
    out = flat_step(theta, cfg, layout, p, g, m, v, step, lr, log_lr=log_lr, return_finite=True)
    numels = layout.numels
    new_p = [t.view(s) for t, s in zip(out[0][0].split(numels), layout.shapes)]
    new_m = [t.reshape(3, *s) for t, s in zip(out[1][0].split(numels, dim=-1), layout.shapes)]
    new_v = [t.view(s) for t, s in zip(out[2][0].split(numels), layout.shapes)]
    new_log_lr = None if log_lr is None else out[3][0].unbind()
    _copy_back(params, states, new_p, new_m, new_v, new_log_lr)
    return out[-1][0].tolist()


@torch.no_grad()
def stacked_step_(
    theta: Theta,
    cfg: NetConfig,
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    step: int,
    lr: float = 1.0,
) -> Tensor:
    """In-place learned step of tensors that share one shape, through :func:`flat_step`.

    The tensors are stacked as the rows ("workers") of a one-segment layout, so each keeps
    its own per-tensor statistics, and all are stepped with a few dozen large ops: on an
    accelerator this replaces a few dozen kernel launches per tensor. Same contract as
    :func:`packed_step_`, except that the per-tensor flags come back as a bool tensor (no
    device sync); the stacked copies cost memory of about 40 floats per element.
    """
    shape = tuple(params[0].shape)
    if any(tuple(t.shape) != shape for t in params):
        raise ValueError(
            f"stacked_step_ needs tensors of one shape, got {[t.shape for t in params]}"
        )
    layout = one_segment(shape)
    p, g, m, v = (torch.stack(ts) for ts in _flat_operands(params, grads, states))
    log_lr = _log_lrs(cfg, states, as_rows=True)
    out = flat_step(theta, cfg, layout, p, g, m, v, step, lr, log_lr=log_lr, return_finite=True)
    _copy_back(
        params,
        states,
        [t.view(shape) for t in out[0]],
        [t.view(3, *shape) for t in out[1]],
        [t.view(shape) for t in out[2]],
        None if log_lr is None else out[3][:, 0].unbind(),
    )
    return out[-1][:, 0]


def _flat_operands(params, grads, states) -> tuple[list[Tensor], ...]:
    """Per tensor, flat views (or compute-dtype copies) of ``(p, g, m, v)``; ``m`` is
    ``(3, n)``. The compute dtype is the states' (float32 for bf16 parameters)."""
    dtype = states[0]["v"].dtype
    return (
        [t.detach().reshape(-1).to(dtype) for t in params],
        [t.reshape(-1).to(dtype) for t in grads],
        [s["m"].reshape(3, -1) for s in states],
        [s["v"].reshape(-1) for s in states],
    )


def _log_lrs(cfg: NetConfig, states, as_rows: bool) -> Tensor | None:
    """The states' adapted log step multipliers, ``[T, 1]`` (tensors as rows) or ``[1, T]``
    (tensors as segments), when the config adapts them (else None: the step ignores them)."""
    if not cfg.adapts_lr:
        return None
    stacked = torch.stack([s["log_lr"] for s in states])
    return stacked.unsqueeze(1) if as_rows else stacked.unsqueeze(0)


def _copy_back(params, states, new_p, new_m, new_v, new_log_lr=None) -> None:
    """Write new values into the parameters and their states (one fused copy)."""
    dst = list(params) + [s["m"] for s in states] + [s["v"] for s in states]
    src = list(new_p) + list(new_m) + list(new_v)
    if new_log_lr is not None:
        dst += [s["log_lr"] for s in states]
        src += list(new_log_lr)
    torch._foreach_copy_(dst, src)
