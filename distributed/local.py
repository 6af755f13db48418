"""The local optimizer as gossip sees it: one small protocol and its adapters.

:class:`GossipOptimizer <learned_opt.distributed.GossipOptimizer>` (and through it the
Lightning strategy and the torchrun entry) reaches the optimizer that takes each rank's
local steps only through :class:`GossipLocal`. Beside torch's ``param_groups``,
``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` it asks four things:

- ``has_shared_state`` and ``shared_state()``: the optimizer state mixed with the
  parameters (a learned optimizer's moments);
- ``mixing_net()`` and ``mixing_theta(device)``: the network whose edge head gives the
  learned mixing weights, and its theta;
- ``join_gossip()``: step under gossip from now on (a learned optimizer keeps its adapted
  step sizes within :meth:`MixingConfig.under_gossip
  <learned_opt.config.MixingConfig.under_gossip>`'s bounds);
- and ``step(closure)`` returns the closure's loss: the batch loss that the learned
  mixing's features read when the wrapper's ``step(loss=...)`` is not given.

:func:`gossip_local` adapts any optimizer to it: a
:class:`~learned_opt.LearnedOptimizer` as :class:`LearnedLocal`, another torch optimizer as
:class:`TorchLocal` (no state to share, no network), and an object that already implements
the protocol is used as it is. ``LearnedOptimizer`` itself knows nothing of gossip: the
adapter sets its generic ``config_transform`` hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from learned_opt.features import init_state
from learned_opt.network import LearnedOptimizerNet, Theta
from learned_opt.optimizer import LearnedOptimizer
from learned_opt.step import fit_state_rows, moment_rows


@runtime_checkable
class GossipLocal(Protocol):
    """What a gossip wrapper needs of the optimizer that takes each rank's local steps."""

    #: whether :meth:`shared_state` has state to mix (``share_state`` needs it)
    has_shared_state: bool

    @property
    def param_groups(self) -> list[dict]:
        """The model's parameters, as torch's optimizers hold them."""
        ...

    def step(self, closure: Callable[[], Tensor] | None = None) -> Any:
        """One local step from this rank's gradients; returns the closure's loss (the batch
        loss), or None without a closure."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

    def shared_state(self) -> list[Tensor]:
        """The state mixed with the parameters: the tensors themselves, mixed in place, the
        same number and shapes at every call (empty when ``has_shared_state`` is False)."""
        ...

    def mixing_net(self) -> LearnedOptimizerNet | None:
        """The network whose edge head gives the learned mixing weights: the one the local
        steps run with under gossip, or None. Changes nothing."""
        ...

    def mixing_theta(self, device: torch.device) -> Theta:
        """:meth:`mixing_net`'s theta, detached, float32 on ``device``."""
        ...

    def join_gossip(self) -> None:
        """Called once by the wrapper, after all its checks passed: step under gossip from
        now on."""
        ...


class TorchLocal:
    """Any ``torch.optim.Optimizer`` as a :class:`GossipLocal`: no state to share and no
    network of its own; gossip changes nothing in its steps."""

    has_shared_state = False

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self, closure: Callable[[], Tensor] | None = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def shared_state(self) -> list[Tensor]:
        return []

    def mixing_net(self) -> LearnedOptimizerNet | None:
        return None

    def mixing_theta(self, device: torch.device) -> Theta:
        raise ValueError(f"{type(self.optimizer).__name__} has no network to mix with")

    def join_gossip(self) -> None:
        pass


class LearnedLocal(TorchLocal):
    """A :class:`~learned_opt.LearnedOptimizer` as a :class:`GossipLocal`.

    - :meth:`shared_state`: its moments.
    - :meth:`join_gossip`: its step runs with :meth:`MixingConfig.under_gossip
      <learned_opt.config.MixingConfig.under_gossip>` (a lower ceiling and a higher floor on
      adapted step sizes), set through its ``config_transform``.
    """

    has_shared_state = True

    def mixing_net(self) -> LearnedOptimizerNet:
        return self.optimizer.net

    def mixing_theta(self, device: torch.device) -> Theta:
        return self.optimizer.theta(device, torch.float32)

    def join_gossip(self) -> None:
        self.optimizer.config_transform = self.optimizer.net.mixing.under_gossip

    def shared_state(self) -> list[Tensor]:
        """Each parameter's second moment ``v``, then each parameter's momenta ``m``
        (``[k, *shape]``: the rows the rule reads for every tensor; the further row of an
        embedding table, :func:`~learned_opt.step.adapt_row`, is its own), in param-group
        order (the tensors themselves, or views of them, mixed in place).

        Under label-skewed data each worker's state differs. With its own ``v``, the
        average of the workers' normalised updates ``m_i / sqrt(v_i)`` is not the
        normalised average gradient: a decentralized run settles where the workers'
        *normalised* gradients cancel, away from the optimum (an Adam-style rule's fixed
        point; D-SGD's is unbiased). Mixing ``v`` makes the normaliser common to the
        workers; mixing ``m`` makes each worker's direction and the features its network
        reads an average over its neighbourhood rather than its own shard's pull. Measured
        on the decentralized validation and held-out suites (3 seeds): see the README. A
        parameter with no state yet sends zeros, which are discarded."""
        opt, vs, ms = self.optimizer, [], []
        rows = moment_rows(opt.parts)
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p, {})
                if "v" not in state:
                    state = init_state(p, rows)
                else:  # kept for a rule that read other rows: converted in place
                    fit_state_rows(state, opt.parts)
                vs.append(state["v"])
                ms.append(state["m"][:rows])  # a view: an embedding table's 0.99 row stays local
        return vs + ms


def gossip_local(optimizer) -> GossipLocal:
    """``optimizer`` as a :class:`GossipLocal`: itself when it implements the protocol, a
    :class:`LearnedLocal` for a :class:`~learned_opt.LearnedOptimizer`, else a
    :class:`TorchLocal`."""
    if isinstance(optimizer, GossipLocal):
        return optimizer
    if isinstance(optimizer, LearnedOptimizer):
        return LearnedLocal(optimizer)
    return TorchLocal(optimizer)
