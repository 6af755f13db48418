"""``GossipOptimizer``: decentralized training around any torch optimizer.

Adapt-then-combine, once per step on every rank:

1. local step of the wrapped optimizer (the gradient was computed on the local batch);
2. exchange the parameters (and the batch loss) with the topology's neighbours;
3. mix: ``x_i <- x_i + sum_j w_ij (x_j - x_i)``, in place.

``mixing="metropolis"`` around ``torch.optim.SGD`` is D-SGD and around ``torch.optim.Adam``
is D-Adam (see :func:`dsgd`, :func:`dadam`). With a
:class:`~learned_opt.LearnedOptimizer` and ``mixing="learned"`` the weights come from the
same network's edge head, so one checkpoint drives both the local update and the mixing.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
from torch import Tensor
from torch.optim import Optimizer

from learned_opt.network import LearnedOptimizerNet

from .process_group import ProcessGroupCommunicator
from .simulated import RULES
from .topology import Topology, get_topology


def default_communicator(
    topology: Topology | str, timeout: float | timedelta = 30.0
) -> ProcessGroupCommunicator:
    """A :class:`ProcessGroupCommunicator` on the default process group; a topology given
    by name is built for the group's world size."""
    import torch.distributed as dist

    if isinstance(topology, str):
        if not dist.is_initialized():
            raise RuntimeError("init_process_group() first, or pass a communicator")
        topology = get_topology(topology, dist.get_world_size())
    return ProcessGroupCommunicator(topology, timeout=timeout)


def resolve_communicator(communicator, topology, timeout, owner: str):
    """``communicator`` if given, else :func:`default_communicator` for ``topology``."""
    if communicator is not None:
        return communicator
    if topology is None:
        raise ValueError(f"{owner} needs a topology or a communicator")
    return default_communicator(topology, timeout)


class GossipOptimizer:
    """Wraps ``local_optimizer`` with neighbour exchange and mixing after every step.

    Args:
        local_optimizer: any ``torch.optim.Optimizer`` (its param groups are the model).
        topology: a :class:`Topology` or a registry name; ignored when ``communicator`` is
            given.
        mixing: ``"metropolis"``, ``"uniform"`` or ``"learned"``; default: ``"learned"`` when
            a network is available (a ``LearnedOptimizer`` or ``net=``), else ``"metropolis"``.
        communicator: default: a :class:`ProcessGroupCommunicator` on the default group.
        net: the network whose edge head gives learned weights; defaults to
            ``local_optimizer.net`` (a ``LearnedOptimizer``).
        timeout: seconds any collective may wait (default communicator only).
        metrics_every: compute the consensus distance (one all_reduce) every k steps;
            0 disables it. All ranks must use the same value.
        writer: a ``SummaryWriter`` (or anything with ``add_scalar``) for this rank, or
        logdir: a folder; a writer for ``<logdir>/rank<r>`` is created (tensorboard is
            imported only then).

    ``metrics`` holds the latest ``gossip/*`` values: ``bytes_sent``, ``edge_weight_mean``,
    ``self_weight_mean``, ``nonfinite_excluded`` and (every k steps) ``consensus_distance``.
    """

    def __init__(
        self,
        local_optimizer: Optimizer,
        topology: Topology | str | None = None,
        mixing: str | None = None,
        communicator=None,
        *,
        net: LearnedOptimizerNet | None = None,
        timeout: float | timedelta = 30.0,
        metrics_every: int = 10,
        writer=None,
        logdir: str | os.PathLike | None = None,
    ):
        if mixing is None:
            has_net = net is not None or getattr(local_optimizer, "net", None) is not None
            mixing = "learned" if has_net else "metropolis"
        if mixing not in RULES:
            raise ValueError(f"unknown mixing {mixing!r}; choose from {RULES}")
        if metrics_every < 0:
            raise ValueError(f"metrics_every must be >= 0, got {metrics_every}")
        communicator = resolve_communicator(communicator, topology, timeout, "GossipOptimizer")
        self.local = local_optimizer
        self.mixing = mixing
        self.communicator = communicator
        self.topology = communicator.topology
        self.net = net if net is not None else getattr(local_optimizer, "net", None)
        if mixing == "learned" and self.net is None:
            raise ValueError(
                "mixing='learned' needs a LearnedOptimizer as the local optimizer, or net="
            )
        self.metrics_every = metrics_every
        self.step_count = 0
        self.metrics: dict[str, float] = {}
        self._takes_loss = "loss" in inspect.signature(local_optimizer.step).parameters
        self._writer = writer
        if writer is None and logdir is not None:
            from torch.utils.tensorboard import SummaryWriter  # only when asked for

            self._writer = SummaryWriter(os.path.join(os.fspath(logdir), f"rank{self.rank}"))
        if hasattr(communicator, "check_layout"):
            communicator.check_layout([p.detach() for p in self.params])

    @property
    def rank(self) -> int:
        return getattr(self.communicator, "rank", 0)

    @property
    def param_groups(self) -> list[dict]:
        return self.local.param_groups

    @property
    def params(self) -> list[Tensor]:
        """Every parameter of the wrapped optimizer, in param-group order."""
        return [p for group in self.local.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local.zero_grad(set_to_none=set_to_none)

    def _theta(self, like: Tensor):
        if self.mixing != "learned":
            return None
        theta_fn = getattr(self.local, "theta", None)
        if theta_fn is not None and getattr(self.local, "net", None) is self.net:
            return theta_fn(like.device, torch.float32)
        return {k: v.detach().to(like.device) for k, v in self.net.named_parameters()}

    def step(self, closure: Callable[[], Tensor] | None = None, *, loss=None):
        """Local step, exchange, mix. ``loss`` (this rank's batch loss) feeds the learned
        mixing's loss features; without it (and without a closure) they are marked absent.
        Returns what the local optimizer's ``step`` returned."""
        if self._takes_loss:
            ret = self.local.step(closure, loss=loss)
        else:
            ret = self.local.step(closure)
        batch_loss = loss if loss is not None else ret
        params = self.params
        with torch.no_grad():
            ys = [p.detach() for p in params]
            cfg = self.net.config if self.mixing == "learned" else None
            _, info = self.communicator.mix(
                ys, self.step_count, self.mixing, self._theta(ys[0]), cfg, batch_loss, out=ys
            )
        self._record(info, ys)
        self.step_count += 1
        return ret

    def _record(self, info: dict, ys: list[Tensor]) -> None:
        weights = info["weights"]
        edge_sums = [float(w.sum()) for w in weights]
        m = self.metrics
        m["gossip/bytes_sent"] = float(info.get("bytes_sent", 0))
        m["gossip/nonfinite_excluded"] = float(getattr(self.communicator, "nonfinite_excluded", 0))
        if weights and weights[0].numel():
            m["gossip/edge_weight_mean"] = float(
                sum(float(w.mean()) for w in weights) / len(weights)
            )
        m["gossip/self_weight_mean"] = 1.0 - sum(edge_sums) / max(len(edge_sums), 1)
        # logged only on the steps it is measured, never repeated stale in between
        logged = {k: v for k, v in m.items() if k != "gossip/consensus_distance"}
        if self.metrics_every and self.step_count % self.metrics_every == 0:
            dist = self.communicator.consensus_distance(ys, self.step_count)
            m["gossip/consensus_distance"] = logged["gossip/consensus_distance"] = float(dist)
        if self._writer is not None:
            for tag, value in logged.items():
                self._writer.add_scalar(tag, value, self.step_count)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus the gossip step count."""
        return {"local": self.local.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.local.load_state_dict(state_dict["local"])
        self.step_count = int(state_dict["step_count"])

    def close(self) -> None:
        """Flush and close the TensorBoard writer, if any."""
        if self._writer is not None and hasattr(self._writer, "close"):
            self._writer.close()


def dsgd(
    params: Iterable, lr: float, topology: Topology | str | None = None, *, momentum=0.0, **kw
) -> GossipOptimizer:
    """D-SGD: ``torch.optim.SGD`` with Metropolis-Hastings gossip (``kw`` go to the wrapper)."""
    sgd = torch.optim.SGD(params, lr=lr, momentum=momentum)
    return GossipOptimizer(sgd, topology, kw.pop("mixing", "metropolis"), **kw)


def dadam(
    params: Iterable,
    lr: float = 1e-3,
    topology: Topology | str | None = None,
    *,
    betas=(0.9, 0.999),
    **kw,
) -> GossipOptimizer:
    """D-Adam: ``torch.optim.Adam`` with Metropolis-Hastings gossip (``kw`` go to the wrapper)."""
    adam = torch.optim.Adam(params, lr=lr, betas=betas)
    return GossipOptimizer(adam, topology, kw.pop("mixing", "metropolis"), **kw)
