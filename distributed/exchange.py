"""One exchange of a gossip step, written once for the real workers and meta-training.

Adapt-then-combine: every worker takes its local step (the *adapt*; the caller's), then
:func:`exchange_and_mix` sends its parameters (and, on the exchanges
:func:`~.mixing.shares_state` picks, the optimizer state it normalises with) to its
neighbours and mixes what comes back (the *combine*). :class:`GossipOptimizer
<.gossip.GossipOptimizer>` (and through it the Lightning strategy) calls it on one rank's
tensors, in place; meta-training's inner loop (``meta_train/inner.py``) calls it on every
worker's tensors stacked along a leading dimension, differentiably. Both reach the
network only through a :class:`Communicator`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from torch import Tensor

from learned_opt.config import NetConfig
from learned_opt.network import Theta

from .mixing import shares_state


@runtime_checkable
class Communicator(Protocol):
    """What the gossip code needs of a communicator: the single-process
    :class:`~.simulated.SimulatedCommunicator` (workers stacked along dim 0) and the real
    :class:`~.process_group.ProcessGroupCommunicator` (one rank's tensors) both are one."""

    world_size: int

    def mix(
        self,
        ys: list[Tensor],
        step: int,
        rule: str = "metropolis",
        theta: Theta | None = None,
        cfg: NetConfig | None = None,
        loss: Tensor | float | None = None,
        *,
        out: list[Tensor] | None = None,
        state: int = 0,
    ) -> tuple[list[Tensor], dict]:
        """Exchange ``ys`` with the neighbours of the 0-based exchange ``step`` and mix them
        by ``rule`` (the last ``state`` tensors are optimizer state, mixed by
        :func:`~.mixing.tensor_rules`); into ``out`` when given. Returns the mixed tensors
        and ``{"weights": one tensor of edge weights per tensor of ys, ...}``."""
        ...

    def consensus_distance(self, ys: list[Tensor], step: int = 0) -> Tensor:
        """``(1/N) sum_i ||x_i - x_bar||^2`` over all tensors and workers (0-d)."""
        ...


class Mixed(NamedTuple):
    """What :func:`exchange_and_mix` returns."""

    params: list[Tensor]  # the mixed parameters
    state: list[Tensor]  # the mixed state (empty when none was sent)
    info: dict  # the communicator's; "weights" holds the parameters' edge weights only


def sends_state(share_state: bool, exchange: int, every: int) -> bool:
    """Whether the 0-based ``exchange`` carries the shared state (``share_state`` on, and
    :func:`~.mixing.shares_state` picks it)."""
    return share_state and shares_state(exchange, every)


def exchange_and_mix(
    comm: Communicator,
    params: list[Tensor],
    state: list[Tensor],
    exchange: int,
    rule: str,
    theta: Theta | None = None,
    cfg: NetConfig | None = None,
    loss: Tensor | float | None = None,
    *,
    in_place: bool = False,
) -> Mixed:
    """The combine of one adapt-then-combine step: exchange ``params`` after the local
    step, with the optimizer ``state`` to share on this 0-based ``exchange`` (empty when
    :func:`sends_state` says no), and mix them by ``rule``.

    ``loss`` (this worker's batch loss, or every worker's) feeds the learned rule's loss
    features. ``in_place``: mix into ``params`` and ``state`` themselves (a real worker,
    under ``no_grad``); otherwise new tensors are returned (meta-training differentiates
    through them)."""
    ys = list(params) + list(state)
    kwargs = {"out": ys} if in_place else {}
    mixed, info = comm.mix(ys, exchange, rule, theta, cfg, loss, state=len(state), **kwargs)
    n = len(params)
    return Mixed(list(mixed[:n]), list(mixed[n:]), {**info, "weights": info["weights"][:n]})
