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
  step sizes within :meth:`NetConfig.under_gossip
  <learned_opt.config.NetConfig.under_gossip>`'s bounds);
- and ``step(closure)`` returns the closure's loss: the batch loss that the learned
  mixing's features read when the wrapper's ``step(loss=...)`` is not given.

:func:`gossip_local` adapts any optimizer to it: a
:class:`~learned_opt.LearnedOptimizer` as :class:`LearnedLocal`, another torch optimizer as
:class:`TorchLocal` (no state to share, no network), and an object that already implements
the protocol is used as it is. ``LearnedOptimizer`` itself knows nothing of gossip: the
adapter sets its generic ``config_transform`` hook.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from learned_opt.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, resolve_checkpoint
from learned_opt.config import NetConfig
from learned_opt.features import init_state
from learned_opt.network import LearnedOptimizerNet, Theta
from learned_opt.optimizer import LearnedOptimizer

#: The warning of a ``LearnedOptimizer`` built without a checkpoint that a gossip wrapper
#: switches to the shipped decentralized rule (Python shows it once per calling line).
RULE_SWITCH = (
    "GossipOptimizer: this LearnedOptimizer was built without a checkpoint, so under gossip "
    "it steps with the shipped decentralized rule {gossip!r} "
    "(learned_opt.checkpoint.DEFAULT_CHECKPOINT) in place of the single-worker rule "
    "{single!r}; pass LearnedOptimizer(params, checkpoint=...) to choose the rule yourself"
)


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
    - :meth:`join_gossip`: its step runs with :meth:`NetConfig.under_gossip
      <learned_opt.config.NetConfig.under_gossip>` (a lower ceiling and a higher floor on
      adapted step sizes), set through its ``config_transform``.
    - Built without a checkpoint (``checkpoint_by_default``) and not stepped yet, it takes
      the shipped decentralized rule, :data:`~learned_opt.checkpoint.DEFAULT_CHECKPOINT`
      (the best of the held-out suite under gossip), in place of the single-worker one,
      and a ``UserWarning`` says so (:data:`RULE_SWITCH`). An optimizer built with a
      checkpoint, or one that has stepped (its state belongs to its rule), keeps its own.
    """

    has_shared_state = True

    def __init__(self, optimizer: LearnedOptimizer):
        super().__init__(optimizer)
        self._switch: tuple[LearnedOptimizerNet, dict, Any] | None = None  # net, card, path

    def _switches(self) -> bool:
        opt = self.optimizer
        return opt.checkpoint_by_default and opt.config_transform is None and not opt.state

    def mixing_net(self) -> LearnedOptimizerNet:
        if not self._switches():
            return self.optimizer.net
        if self._switch is None:  # loaded once, installed by join_gossip
            path = resolve_checkpoint(DEFAULT_CHECKPOINT)
            self._switch = (*load_checkpoint(path), path)
        return self._switch[0]

    def mixing_theta(self, device: torch.device) -> Theta:
        return self.optimizer.theta(device, torch.float32)

    def join_gossip(self) -> None:
        opt = self.optimizer
        net = self.mixing_net()
        if net is not opt.net:
            single = Path(opt.checkpoint_path).stem  # the shipped name, as one passes it
            net, card, path = self._switch
            opt.net, opt.card, opt.checkpoint_path = net, card, path
            opt.refresh_theta()
            message = RULE_SWITCH.format(gossip=DEFAULT_CHECKPOINT, single=single)
            warnings.warn(message, UserWarning, stacklevel=3)  # the wrapper's caller
        opt.config_transform = NetConfig.under_gossip
        self._switch = None

    def shared_state(self) -> list[Tensor]:
        """Each parameter's second moment ``v``, then each parameter's momenta ``m``
        (``[3, *shape]``), in param-group order (the tensors themselves, mixed in place).

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
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p] if "v" in opt.state.get(p, {}) else init_state(p)
                vs.append(state["v"])
                ms.append(state["m"])
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
