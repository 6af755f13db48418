"""Gradient tracking (DSGT), a baseline for heterogeneous data across workers.

Each rank keeps a tracker ``y`` of the network-average gradient::

    x <- W x - lr * y
    y <- W y + g_new - g_old        (y starts at the first gradient)

Both ``W x`` and ``W y`` travel in one exchange per step. With a doubly stochastic ``W``
the mean of the trackers equals the mean of the current gradients, which removes the
bias that label-skewed data puts on D-SGD. After a rank is dropped (see
:mod:`.membership`) its share of the trackers is gone, so from then on the trackers track
the survivors' gradients only approximately.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
from torch import Tensor

from .gossip import resolve_communicator
from .topology import Topology


def tracker_update(mixed_tracker: Tensor | None, grad: Tensor, prev_grad: Tensor | None) -> Tensor:
    """DSGT's tracker after a new gradient: ``W y + g_new - g_old``, or the gradient itself
    on the first step (``mixed_tracker`` None). The one definition, for the real workers
    and meta-training's inner loop."""
    return grad if mixed_tracker is None else mixed_tracker + grad - prev_grad


class GradientTracking:
    """DSGT on this rank's parameters.

    Args:
        params: the parameters (a plain iterable of tensors).
        lr: step size.
        topology: a :class:`Topology` or name (ignored when ``communicator`` is given).
        communicator: default: a ``ProcessGroupCommunicator`` on the default group.
        mixing: ``"metropolis"`` or ``"uniform"``.
        timeout: seconds any collective may wait (default communicator only).
        on_failure: ``"exclude"`` or ``"raise"`` (default communicator only; see
            :class:`~learned_opt.distributed.GossipOptimizer`).
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        topology: Topology | str | None = None,
        communicator=None,
        *,
        mixing: str = "metropolis",
        timeout: float | timedelta = 30.0,
        on_failure: str | None = None,
    ):
        if not lr > 0:
            raise ValueError(f"Invalid learning rate: {lr!r}")
        if mixing not in ("metropolis", "uniform"):
            raise ValueError(
                f"gradient tracking mixes with 'metropolis' or 'uniform', got {mixing!r}"
            )
        self.params = list(params)
        if not self.params:
            raise ValueError("GradientTracking got an empty parameter list")
        self.communicator = resolve_communicator(
            communicator, topology, timeout, "GradientTracking", on_failure=on_failure
        )
        self.lr = lr
        self.mixing = mixing
        self.step_count = 0
        self._tracker: list[Tensor] | None = None  # y_t
        self._mixed_tracker: list[Tensor] | None = None  # W y_{t-1}
        self._prev_grad: list[Tensor] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def step(self, closure: Callable[[], Tensor] | None = None, *, loss=None):
        """One DSGT step from the current gradients; returns the closure's loss."""
        ret = None
        if closure is not None:
            with torch.enable_grad():
                ret = closure()
        with torch.no_grad():
            grads = [
                torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for p in self.params
            ]
            if self._tracker is None:
                tracker = [tracker_update(None, g, None).clone() for g in grads]
                self._mixed_tracker = [torch.empty_like(g) for g in grads]
            else:
                tracker = [
                    tracker_update(wy, g, g0)
                    for wy, g, g0 in zip(self._mixed_tracker, grads, self._prev_grad)
                ]
            xs = [p.detach() for p in self.params]
            batch_loss = loss if loss is not None else ret
            self.communicator.mix(
                xs + tracker,
                self.step_count,
                self.mixing,
                loss=batch_loss,
                out=xs + self._mixed_tracker,
            )
            for x, y in zip(xs, tracker):
                x.add_(y, alpha=-self.lr)
            self._tracker, self._prev_grad = tracker, grads
        self.step_count += 1
        return ret

    def state_dict(self) -> dict:
        """Trackers, previous gradients and the step count."""
        return {
            "step_count": self.step_count,
            "tracker": self._tracker,
            "mixed_tracker": self._mixed_tracker,
            "prev_grad": self._prev_grad,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._tracker = state["tracker"]
        self._mixed_tracker = state["mixed_tracker"]
        self._prev_grad = state["prev_grad"]
