"""``GossipStrategy``: decentralized (gossip) training from a Lightning ``Trainer``.

    from learned_opt.distributed.lightning import GossipStrategy

    trainer = lightning.Trainer(
        strategy=GossipStrategy(topology="ring", mixing="learned"),
        accelerator="cpu", devices=4,
    )
    trainer.fit(model)

The strategy reuses Lightning's DDP machinery (launchers, cluster environments, process
group set-up, distributed samplers) but never wraps the model in
``DistributedDataParallel``: each rank trains its own replica on its own shard. Every
optimizer that ``configure_optimizers`` returns is wrapped in a
:class:`~learned_opt.distributed.GossipOptimizer`, so an optimizer step is the local step
(run by Lightning's precision plugin: closure, hooks, gradient clipping, scaler) followed
by the exchange with the topology's neighbours and the mix. ``mixing="allreduce"``
averages gradients instead (plain data parallel, for comparison).

This module imports Lightning; ``learned_opt`` and ``learned_opt.distributed`` do not
import this module, so they stay free of Lightning.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from learned_opt.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint

from .averaging import all_reduce_mean_
from .gossip import GossipOptimizer
from .local import GossipLocal, gossip_local
from .mixing import RULES
from .outer import DEFAULT_COMPRESSION, DEFAULT_LOCAL_STEPS, OUTER_RULES, OuterStep, outer_rule
from .process_group import ProcessGroupCommunicator
from .topology import Topology, get_topology, list_topologies

MIXINGS = (*RULES, "allreduce")
CHECKPOINT_KEY = "gossip"  # per-rank states inside a Lightning checkpoint
_RESERVED = {"local_optimizer", "topology", "mixing", "communicator", "net", "timeout"}
_RESERVED |= {"metrics_every", "writer", "logdir"}


class _LocalStep:
    """The user's optimizer as :class:`GossipOptimizer` sees it (a
    :class:`~learned_opt.distributed.local.GossipLocal`): ``step(closure)`` runs the step
    Lightning would run (``pending``, set by the strategy before each step), so hooks,
    gradient clipping and a grad scaler see the user's own optimizer; the rest is the
    optimizer's own adapter (:func:`~learned_opt.distributed.local.gossip_local`)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.inner: GossipLocal = gossip_local(optimizer)
        self.has_shared_state = self.inner.has_shared_state
        self.pending: Callable[[Callable | None], Any] | None = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def shared_state(self) -> list[Tensor]:
        return self.inner.shared_state()

    def mixing_net(self):
        return self.inner.mixing_net()

    def mixing_theta(self, device: torch.device):
        return self.inner.mixing_theta(device)

    def join_gossip(self) -> None:
        self.inner.join_gossip()

    def step(self, closure: Callable | None = None):
        run, self.pending = self.pending, None
        if run is None:
            raise RuntimeError("a gossip step runs through GossipStrategy.optimizer_step")
        return run(closure)


def _is_float(value) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def own_rank_view(checkpoint: dict, rank: int, world_size: int, path: Any = None) -> dict:
    """This rank's view of a checkpoint written by :class:`GossipStrategy`: its own model and
    optimizer states in place of the averaged model. Other checkpoints pass unchanged."""
    gossip = checkpoint.get(CHECKPOINT_KEY)
    if gossip is None:
        return checkpoint
    if gossip["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {path} holds the states of {gossip['world_size']} gossip ranks but this "
            f"run has {world_size}; resume with devices={gossip['world_size']}, or start a new "
            f"run from its averaged model (model.load_state_dict(checkpoint['state_dict']))"
        )
    return {**checkpoint, **gossip["ranks"][rank]}


class GossipStrategy(DDPStrategy):
    """Decentralized data-parallel training: one model replica per rank, mixed by gossip.

    Args:
        topology: a registry name (``list_topologies()``), built for the run's world size, or
            a :class:`~learned_opt.distributed.Topology` of that size.
        mixing: ``"learned"``, ``"metropolis"``, ``"uniform"`` or ``"allreduce"`` (gradients
            averaged over all ranks, as DDP does). Default: ``"learned"`` for a
            :class:`~learned_opt.LearnedOptimizer`, else ``"metropolis"``.
        checkpoint: the learned optimizer checkpoint whose edge head sets the weights when
            ``mixing="learned"`` wraps an optimizer that has no network (Adam, SGD, ...).
        timeout: seconds any collective may wait (gossip exchanges and Lightning's own).
        metrics_every: log the ``gossip/*`` metrics (and compute the consensus distance, one
            all-reduce) every k optimizer steps; default: the Trainer's ``log_every_n_steps``.
            0 disables them.
        average_at_end: when ``fit`` ends, replace every rank's model by the average of all
            ranks' models (the result of training), as the torchrun entry point evaluates it.
        outer_step: one of ``"nesterov"``, ``"learned"``, ``"demo"``: no gossip; local steps,
            then one compressed outer step shared by all ranks by this rule
            (:class:`~learned_opt.distributed.outer.OuterStep`; ``outer_kwargs``:
            ``local_steps``, ``compression``, ``lr``, by default the mode's).
        gossip_kwargs: further keyword arguments for each
            :class:`~learned_opt.distributed.GossipOptimizer`, and
        communicator_kwargs: for the
            :class:`~learned_opt.distributed.ProcessGroupCommunicator`, so whatever the
            gossip engine offers is reachable from here.
        start_method, process_group_backend, accelerator, parallel_devices,
        cluster_environment, checkpoint_io, precision_plugin: as for Lightning's
            ``DDPStrategy`` (``start_method="popen"`` relaunches the script, like torchrun;
            ``"spawn"`` suits notebooks).

    Validation, test and predict run on the averaged model; training resumes with every
    rank's own model. A checkpoint holds the averaged model as its ``state_dict`` (so
    ``Model.load_from_checkpoint`` gives the trained model) and, under ``"gossip"``, every
    rank's own model and optimizer states, which ``Trainer.fit(ckpt_path=...)`` restores.
    """

    def __init__(
        self,
        topology: str | Topology = "ring",
        mixing: str | None = None,
        *,
        checkpoint: str | os.PathLike = DEFAULT_CHECKPOINT,
        timeout: float = 60.0,
        metrics_every: int | None = None,
        average_at_end: bool = True,
        outer_step: str | None = None,
        outer_kwargs: Mapping[str, Any] | None = None,
        gossip_kwargs: Mapping[str, Any] | None = None,
        communicator_kwargs: Mapping[str, Any] | None = None,
        start_method: str = "popen",
        process_group_backend: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ):
        if mixing is not None and mixing not in MIXINGS:
            raise ValueError(f"unknown mixing {mixing!r}; choose from {MIXINGS}")
        if isinstance(topology, str) and topology not in list_topologies():
            raise ValueError(f"unknown topology {topology!r}; choose from {list_topologies()}")
        if not isinstance(topology, (str, Topology)):
            raise TypeError(f"topology must be a name or a Topology, got {type(topology)}")
        if metrics_every is not None and (not isinstance(metrics_every, int) or metrics_every < 0):
            raise ValueError(f"metrics_every must be an int >= 0 or None, got {metrics_every!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if outer_step is not None and outer_step not in OUTER_RULES:
            raise ValueError(f"unknown outer_step {outer_step!r}; choose from {OUTER_RULES}")
        if outer_step is not None and mixing is not None:
            raise ValueError("outer_step replaces the gossip: leave mixing unset")
        for name, given, reserved in (
            ("gossip_kwargs", gossip_kwargs, _RESERVED),
            ("communicator_kwargs", communicator_kwargs, {"topology", "group", "timeout"}),
        ):
            clash = reserved & set(given or {})
            if clash:
                raise ValueError(
                    f"{name} {sorted(clash)} are set by GossipStrategy; use its own arguments"
                )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout),
            start_method=start_method,
        )
        self.topology, self.mixing, self.checkpoint = topology, mixing, checkpoint
        self.gossip_timeout, self.metrics_every = float(timeout), metrics_every
        self.average_at_end = average_at_end
        self.outer_step = outer_step
        self.outer_kwargs = {"local_steps": DEFAULT_LOCAL_STEPS, "compression": DEFAULT_COMPRESSION,
                             "lr": None, **(outer_kwargs or {})}  # fmt: skip
        self.rounds: dict[int, OuterStep] = {}  # by id() of the user's optimizer, outer_step
        self.gossip_kwargs = dict(gossip_kwargs or {})
        self.communicator_kwargs = dict(communicator_kwargs or {})
        self.gossips: dict[int, GossipOptimizer] = {}  # by id() of the user's optimizer
        self._communicator: ProcessGroupCommunicator | None = None
        self._own_state: dict[str, Tensor] | None = None  # while the averaged model is in place
        self._sync_gradients = True
        self._every = 0  # log the gossip metrics every k optimizer steps (set in set-up)
        self._allreduce_bytes = 0

    # ------------------------------------------------------------------ set-up

    def _fitting(self) -> bool:
        module = self.lightning_module
        return module is not None and module.trainer.state.fn == TrainerFn.FITTING

    def communicator(self) -> ProcessGroupCommunicator:
        """The :class:`ProcessGroupCommunicator` of this run (created on first use)."""
        if self._communicator is None:
            topology = self.topology
            if isinstance(topology, str):
                topology = get_topology(topology, self.world_size)
            self._communicator = ProcessGroupCommunicator(
                topology, timeout=self.gossip_timeout, **self.communicator_kwargs
            )
        return self._communicator

    def configure_ddp(self) -> None:
        """No DDP wrapper. A fresh run starts every rank from rank 0's parameters and buffers;
        a resumed run keeps the state each rank restored from the checkpoint."""
        if self.lightning_module.trainer.ckpt_path is None and self.world_size > 1:
            timeout = timedelta(seconds=self.gossip_timeout)
            with torch.no_grad():
                for t in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(t.data, src=0, async_op=True).wait(timeout)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers and schedulers, then one :class:`GossipOptimizer` each."""
        super().setup_optimizers(trainer)
        self.gossips = {}
        comm = self.communicator()
        every = self.metrics_every
        self._every = trainer.log_every_n_steps if every is None else every
        if self.mixing == "allreduce":
            return
        if self.outer_step is not None:  # every rank starts its rounds from one anchor: the
            # ranks' average (a resumed run's ranks hold their own models)
            if self.world_size > 1:
                all_reduce_mean_(self._float_state().values(), comm, 0, "outer step start")
            kw = dict(self.outer_kwargs)
            factory, decay = outer_rule(self.outer_step, kw.pop("lr"))
            self.rounds = {id(opt): OuterStep(
                [p for g in opt.param_groups for p in g["params"]], factory, rank=self.global_rank,
                world_size=self.world_size, decay=decay, **kw) for opt in self.optimizers}  # fmt: skip
            return
        for opt in self.optimizers:
            local = _LocalStep(opt)
            net = local.mixing_net()
            mixing = self.mixing or ("learned" if net is not None else "metropolis")
            if mixing == "learned" and net is None:
                net = load_checkpoint(self.checkpoint)[0]  # its edge head mixes
            self.gossips[id(opt)] = GossipOptimizer(
                local,
                mixing=mixing,
                communicator=comm,
                net=net if mixing == "learned" else None,
                metrics_every=0,  # the strategy computes the consensus when it logs
                **self.gossip_kwargs,
            )

    # ------------------------------------------------------------------ training

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The local step through the precision plugin, then exchange and mix."""
        gossip = self.gossips.get(id(optimizer))
        if gossip is None:  # allreduce (gradients were averaged after backward), outer_step
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if id(optimizer) in self.rounds:
                self.rounds[id(optimizer)].step()
        else:
            local: _LocalStep = gossip.local
            local.pending = functools.partial(self._local_step, optimizer, model=model, **kwargs)
            out = gossip.step(closure)
        step = self.lightning_module.trainer.global_step + 1  # counting this step
        if self._every and step % self._every == 0:  # when the Trainer writes its logs
            self._log_metrics(optimizer, gossip, step)
        return out

    def _local_step(self, optimizer, closure, model=None, **kwargs):
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        if isinstance(out, Tensor) and module.automatic_optimization:
            out = out * module.trainer.accumulate_grad_batches  # the batch loss, unscaled
        return out

    def _log_metrics(self, optimizer, gossip: GossipOptimizer | None, step: int) -> None:
        """Consensus distance and the rank means of the per-rank metrics (two all-reduces),
        logged through the Trainer's logger."""
        comm = self.communicator()
        params = [p.detach() for group in optimizer.param_groups for p in group["params"]]
        out = {"gossip/consensus_distance": comm.consensus_distance(params, step)}
        if gossip is None:
            out["gossip/bytes_sent"] = torch.tensor(float(self._allreduce_bytes))
        else:
            m = gossip.metrics
            edge = m.get("gossip/edge_weight_mean")
            vec = torch.tensor(
                [
                    m["gossip/bytes_sent"],
                    m["gossip/self_weight_mean"],
                    0.0 if edge is None else edge,
                    0.0 if edge is None else 1.0,
                    m["gossip/nonfinite_excluded"],
                ],
                dtype=torch.float64,
                device=self.root_device,
            )
            comm.all_reduce(vec, step, "gossip metrics (all_reduce)")
            n = comm.world_size
            out["gossip/bytes_sent"] = vec[0] / n
            out["gossip/self_weight_mean"] = vec[1] / n
            out["gossip/nonfinite_excluded"] = vec[4]  # over all ranks, since the start
            if vec[3] > 0:
                out["gossip/edge_weight_mean"] = vec[2] / vec[3]
        if len(self.optimizers) > 1:
            k = [id(o) for o in self.optimizers].index(id(optimizer))
            out = {tag.replace("gossip/", f"gossip/opt{k}/"): v for tag, v in out.items()}
        metrics = {tag: v.detach().float().cpu() for tag, v in out.items()}
        self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @contextmanager
    def block_backward_sync(self):
        """During gradient accumulation, ``mixing="allreduce"`` averages gradients only on
        the micro-batch that ends with an optimizer step (as DDP's ``no_sync``)."""
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = True

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.mixing == "allreduce" and self._sync_gradients and self._fitting():
            params = self.lightning_module.parameters()
            grads = [p.grad for p in params if p.grad is not None]
            step = self.lightning_module.trainer.global_step
            comm = self.communicator()
            self._allreduce_bytes = all_reduce_mean_(grads, comm, step, "gradient all_reduce")

    # ------------------------------------------------------------------ the averaged model

    def _float_state(self) -> dict[str, Tensor]:
        state = self.lightning_module.state_dict(keep_vars=True)
        return {k: t.detach() for k, t in state.items() if _is_float(t)}

    def average_model_(self) -> None:
        """Replace this rank's parameters and floating-point buffers by their mean over all
        ranks (call on every rank)."""
        if self.world_size > 1:
            step = self.lightning_module.trainer.global_step
            all_reduce_mean_(self._float_state().values(), self.communicator(), step, "averaging")

    def _use_averaged_model(self) -> None:
        if self._own_state is None and self.world_size > 1:
            self._own_state = {k: t.clone() for k, t in self._float_state().items()}
            self.average_model_()

    def _use_own_model(self) -> None:
        if self._own_state is not None:
            with torch.no_grad():
                for k, t in self._float_state().items():
                    t.copy_(self._own_state[k])
            self._own_state = None

    on_validation_start = on_test_start = on_predict_start = _use_averaged_model
    on_validation_end = on_test_end = on_predict_end = _use_own_model

    def on_train_end(self) -> None:
        for rounds in self.rounds.values():
            rounds.flush()  # every rank ends on the anchor
        if self.average_at_end:
            self.average_model_()

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's own model state, even while validation holds the averaged model."""
        state = super().lightning_module_state_dict()
        if self._own_state is not None:
            state = {k: self._own_state.get(k, v) for k, v in state.items()}
        return state

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Gather every rank's model and optimizer states into rank 0's file, beside the
        averaged model (called on every rank)."""
        if self.world_size > 1 and dist.is_initialized():
            own = {k: checkpoint[k] for k in ("state_dict", "optimizer_states") if k in checkpoint}
            ranks = [None] * self.world_size if self.is_global_zero else None
            dist.gather_object(move_data_to_device(own, "cpu"), ranks, dst=0)
            averaged = {
                k: v.clone() if isinstance(v, Tensor) else v
                for k, v in checkpoint["state_dict"].items()
            }
            floats = [v for v in averaged.values() if _is_float(v)]
            all_reduce_mean_(floats, self.communicator(), 0, "checkpoint averaging")
            checkpoint = {**checkpoint, "state_dict": averaged}
            checkpoint[CHECKPOINT_KEY] = {
                "world_size": self.world_size,
                "step_counts": [g.step_count for g in self.gossips.values()],
                "ranks": ranks,
            }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Read with ``weights_only=True`` (reading can never run code). When fitting, this
        rank's own states (:func:`own_rank_view`); else the averaged model."""
        if weights_only is False:
            raise ValueError(
                f"{checkpoint_path}: GossipStrategy reads checkpoints with weights_only=True "
                "only (tensors and plain data), so that loading one can never run code"
            )
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True)
        if self._fitting():
            checkpoint = own_rank_view(
                checkpoint, self.global_rank, self.world_size, checkpoint_path
            )
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        steps = checkpoint.get(CHECKPOINT_KEY, {}).get("step_counts", [])
        for gossip, step_count in zip(self.gossips.values(), steps):
            gossip.step_count = int(step_count)

    def teardown(self) -> None:
        self._use_own_model()
        for gossip in self.gossips.values():
            gossip.close()
        super().teardown()
