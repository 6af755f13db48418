"""Inner training on stacked workers: the unroll that meta-training differentiates through.

Every inner optimizer here is a pure function over parameter tensors stacked along a
leading worker dimension ``[N, ...]``, flattened to ``[N, P]``. The learned optimizer is
the core's differentiable :func:`learned_opt.step.flat_step` (the math that
``LearnedOptimizer`` runs in place), on every worker at once; mixing is the
:class:`~learned_opt.distributed.simulated.SimulatedCommunicator`, i.e. the same local-update
and mixing functions as deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap

from learned_opt.config import MOMENTUM_DECAYS, SECOND_MOMENT_DECAY, MixingConfig, NetConfig
from learned_opt.distributed.exchange import exchange_and_mix, sends_state
from learned_opt.distributed.mixing import check_share_state_every
from learned_opt.distributed.simulated import SimulatedCommunicator
from learned_opt.distributed.topology import get_topology
from learned_opt.distributed.tracking import tracker_update
from learned_opt.features import adam_direction
from learned_opt.optimizer import has_empty_rows
from learned_opt.orthogonal import gram_layout
from learned_opt.schedules import HoldThenDecay
from learned_opt.segments import FlatLayout, segment_mean
from learned_opt.step import (
    ALL_PARTS,
    Parts,
    active_parts,
    flat_step,
    init_flat_state,
    moment_rows,
)

#: Inner optimizers understood by :func:`make_inner_optimizer`. "dsgt" is gradient
#: tracking: its tracker ``y`` is mixed together with the parameters.
INNER_OPTIMIZERS = ("learned", "adam", "adamw", "sgd", "dsgt")
#: How :func:`inner_step` scores the workers of a decentralized trajectory: each worker's
#: parameters on the next worker's batch, or the workers' average on every worker's batch
#: (the model a decentralized run delivers, on the global objective).
SCORES = ("next_worker", "average")
#: The state an inner optimizer mixes with its parameters when ``share_state`` (the
#: second moment it normalises with and its momenta; see
#: :meth:`learned_opt.distributed.local.LearnedLocal.shared_state`).
SHARED_STATE = {"learned": ("v", "m")}


@dataclass
class InnerOptimizer:
    """A pure optimizer over flat stacked worker parameters ``[N, P]``, and the mixing rule
    it is paired with.

    ``kind`` is one of :data:`INNER_OPTIMIZERS`; ``lr`` is the hand-designed rule's
    learning rate or the learned optimizer's multiplier. ``theta``/``cfg`` are set for the
    learned optimizer, and ``gossip_cfg``, the rule it steps with under gossip
    (:meth:`MixingConfig.under_gossip <learned_opt.config.MixingConfig.under_gossip>` of
    ``cfg``; where not given, that of the default ``MixingConfig``, as a network without
    a mixing config of its own has).
    ``parts``: the networks the learned step evaluates (:class:`~learned_opt.step.Parts`;
    all by default). Leaving out a network whose output head is zero gives the same values.
    """

    kind: str
    lr: float = 1.0
    mixing: str = "metropolis"
    theta: dict[str, Tensor] | None = None
    cfg: NetConfig | None = None
    gossip_cfg: NetConfig | None = None
    momentum: float = 0.9
    weight_decay: float = 1e-2
    share_state: bool = True  # under gossip, mix SHARED_STATE with the parameters
    share_state_every: int = 2  # ... in one exchange of every k (see ``shares_state``)
    parts: Parts = ALL_PARTS

    def __post_init__(self):
        check_share_state_every(self.share_state_every)
        if self.gossip_cfg is None and self.cfg is not None:
            self.gossip_cfg = MixingConfig().under_gossip(self.cfg)

    def init(self, params: Tensor, layout: FlatLayout | None = None) -> dict[str, Tensor]:
        """Zero state for flat stacked parameters (of ``layout``: the learned optimizer's
        per-tensor step multipliers need it when its config adapts them). The learned
        optimizer keeps the momenta its ``parts`` read (:func:`~learned_opt.step.moment_rows`),
        as a deployed ``LearnedOptimizer`` does: one for a rule whose heads are zero, so
        that under gossip its shared state is the deployed one, not three times its size."""
        if self.kind == "learned":
            adapts = self.cfg is not None and self.cfg.adapts_lr
            sparse = layout is not None and any(layout.sparse_rows)
            rows = moment_rows(self.parts, sparse)
            state = init_flat_state(params, layout if adapts else None, rows)
            keeping = ()
            if layout is not None:
                keeping = gram_layout(self.cfg, layout.shapes, layout.matrices(self.cfg))
            if keeping:  # each keeping matrix's Gram polynomial, flattened (flat_step's q)
                eyes = [torch.eye(min(layout.shapes[k])).reshape(-1) for k in keeping]
                q = torch.cat(eyes).to(params)
                state["q"] = q.expand(params.shape[0], -1).clone()
            return state
        if self.kind in ("adam", "adamw"):
            return {"m": torch.zeros_like(params), "v": torch.zeros_like(params)}
        if self.kind == "dsgt":
            return {"wy": torch.zeros_like(params), "g_prev": torch.zeros_like(params)}
        return {"m": torch.zeros_like(params)}

    def update(
        self,
        layout: FlatLayout,
        p: Tensor,
        g: Tensor,
        state: dict,
        step: int,
        gossip=False,
        lr_scale: float = 1.0,
    ):
        """New ``(params, state)`` after the 1-based ``step``; differentiable in theta.
        ``gossip``: the workers mix after this step; the learned step then uses
        ``gossip_cfg``, as a real worker under
        :class:`~learned_opt.distributed.GossipOptimizer` does. ``lr_scale``: a
        schedule's factor on ``lr`` at this step."""
        lr = self.lr * lr_scale
        if self.kind == "learned":
            cfg = self.gossip_cfg if gossip else self.cfg
            out = flat_step(
                self.theta, cfg, layout, p, g, state["m"], state["v"], step, lr,
                log_lr=state.get("log_lr"), q=state.get("q"), parts=self.parts,
            )  # fmt: skip
            m = out[1]  # the momenta this step read; the rest stay (moment_rows)
            if m.shape[-2] < state["m"].shape[-2]:
                m = torch.cat([m, state["m"][..., m.shape[-2] :, :]], dim=-2)
            new = {"m": m, "v": out[2]}
            if "log_lr" in state:
                new["log_lr"] = out[3]
            if "q" in state:
                new["q"] = out[-1]
            return out[0], new
        if self.kind in ("adam", "adamw"):
            b1, b2 = MOMENTUM_DECAYS[0], SECOND_MOMENT_DECAY  # Adam's (0.9, 0.999)
            m = b1 * state["m"] + (1 - b1) * g
            v = b2 * state["v"] + (1 - b2) * g * g
            upd = adam_direction(m, v, step, eps=1e-8)
            if self.kind == "adamw":  # decoupled weight decay, torch's default 1e-2
                upd = upd + self.weight_decay * p
            return p - lr * upd, {"m": m, "v": v}
        if self.kind == "dsgt":  # y_t = W y_{t-1} + g_t - g_{t-1}; the caller mixes p and y
            y = tracker_update(None if step == 1 else state["wy"], g, state["g_prev"])
            return p - lr * y, {"wy": y, "g_prev": g}
        m = self.momentum * state["m"] + g
        return p - lr * m, {"m": m}


def make_inner_optimizer(
    kind: str,
    lr: float = 1.0,
    mixing: str = "metropolis",
    net=None,
    parts: Parts | None = ALL_PARTS,
    **worker,
) -> InnerOptimizer:
    """Build an :class:`InnerOptimizer`; ``net`` (a ``LearnedOptimizerNet``) for "learned",
    which evaluates ``parts`` of it: all of them by default (what meta-training
    differentiates through), or ``None`` for those whose output heads are not zero
    (:func:`~learned_opt.step.active_parts`: the same values, without the work a deployed
    :class:`~learned_opt.LearnedOptimizer` leaves out; for evaluation and timing).
    ``worker``: the gossip fields of :class:`InnerOptimizer` (``share_state``,
    ``share_state_every``)."""
    if kind not in INNER_OPTIMIZERS:
        raise ValueError(f"unknown inner optimizer {kind!r}; valid: {INNER_OPTIMIZERS}")
    if kind == "learned":
        if net is None:
            raise ValueError("the learned inner optimizer needs a network (net=...)")
        theta = dict(net.named_parameters())
        parts = active_parts(theta) if parts is None else parts
        gossip_cfg = net.mixing.under_gossip(net.config)
        return InnerOptimizer(
            kind, lr, mixing, theta, net.config, gossip_cfg, parts=parts, **worker
        )
    return InnerOptimizer(kind, lr, mixing, **worker)


@dataclass
class Trajectory:
    """One persistent inner run: a task on N stacked workers over a topology.

    ``params``/``states`` are the inner state; ``step`` counts inner steps taken;
    ``length`` is the step at which the trajectory is reset; ``loss0`` the initial loss.
    """

    task: object
    num_workers: int
    topology: str
    partition: str
    alpha: float
    seed: int
    length: int
    layout: FlatLayout
    params: Tensor
    states: dict[str, Tensor] | None
    batches: object
    comm: SimulatedCommunicator | None
    loss0: float
    step: int = 0
    score: str = "next_worker"  # one of SCORES
    #: the multiplier held, then decayed linearly to 0 over the last half of ``length``
    #: (:class:`~learned_opt.schedules.HoldThenDecay`: what ``wsd_schedule`` gives a
    #: deployed optimizer over a run of that length); held throughout when False
    scheduled: bool = False
    history: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.step >= self.length

    def detach_(self) -> None:
        """Cut the autograd graph at a truncation boundary."""
        self.params = self.params.detach()
        if self.states is not None:
            self.states = {k: v.detach() for k, v in self.states.items()}

    def tensors(self) -> list[Tensor]:
        """The stacked per-tensor views ``[N, *shape]`` of the flat parameters."""
        return list(self.layout.unflatten(self.params).values())


def new_trajectory(
    task,
    num_workers: int,
    topology: str,
    partition: str,
    alpha: float,
    seed: int,
    length: int,
    device=None,
    score: str = "next_worker",
    scheduled: bool = False,
) -> Trajectory:
    """Initialise identical parameters on every worker (as a real run does) and its data;
    ``score`` (one of :data:`SCORES`) is how :func:`inner_step` scores its workers, and
    ``scheduled`` whether its multiplier follows the paired schedule (see
    :class:`Trajectory`)."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; valid choices: {SCORES}")
    gen = torch.Generator().manual_seed(int(seed))
    init = task.init(gen)
    batches = task.worker_batches(int(seed), num_workers, partition, alpha, device=device)
    first = batches.get(0)
    layout = _table_layout(task, init, tuple(t.cpu() for t in first))
    params = layout.flatten(init, batch_dims=0).to(device).unsqueeze(0).repeat(num_workers, 1)
    comm = None
    if num_workers > 1:
        comm = SimulatedCommunicator(get_topology(topology, num_workers))
    with torch.no_grad():
        loss0 = float(vmap(task.loss)(layout.unflatten(params), first).mean())
    return Trajectory(
        task, num_workers, topology, partition, alpha, int(seed), int(length), layout, params,
        None, batches, comm, max(loss0, 1e-8), score=score, scheduled=bool(scheduled),
    )  # fmt: skip


def _table_layout(task, init: dict[str, Tensor], batches) -> FlatLayout:
    """The layout of ``init`` with each tensor marked ``sparse_rows`` as a deployed
    ``LearnedOptimizer`` marks it (:func:`~learned_opt.optimizer.has_empty_rows` of its
    first gradient): an embedding table whose first batch left at least half its rows
    without gradient takes the Adam form, never the orthogonalised step, so meta-training
    trains the per-tensor network on the step that such a table gets in deployment.
    ``batches``: every worker's first batch (``[N, ...]`` each). The simulated workers
    share one layout, so a tensor is marked where every worker's first gradient marks it:
    a table is, on every worker, while a hidden layer that one skewed shard leaves half
    dead on its first batch does not switch every worker's step."""
    grads = vmap(torch.func.grad(task.loss), in_dims=(None, 0))(init, batches)
    marks = tuple(all(has_empty_rows(g) for g in grads[name].unbind()) for name in init)
    return replace(FlatLayout.of(init), sparse_rows=marks)


def _one_worker_grad(loss_fn, params: Tensor, batch, second_order: bool):
    """``vmap(grad_and_value(loss_fn))`` of a single worker (``params`` ``[1, P]``, each
    tensor of ``batch`` ``[1, ...]``) by plain autograd, which made a single-worker
    stage's meta-steps 1.3x to 1.6x faster, by the tasks drawn
    (``benchmarks/meta_throughput.py``, in git at ``869ce3d``). Several workers keep the
    transform: a loop like this one was slower from 8 workers on small tasks.
    Differentiable in whatever ``params`` depends on, as the transform's results are;
    the gradient itself only with ``second_order``."""
    x, b = params[0], tuple(t[0] for t in batch)
    with torch.enable_grad():
        tracked = x.requires_grad
        if not tracked:
            x = x.detach().requires_grad_()
        loss = loss_fn(x, b)
        grad = None
        if loss.requires_grad:
            (grad,) = torch.autograd.grad(
                loss, x, create_graph=second_order and tracked, retain_graph=tracked,
                allow_unused=True,
            )  # fmt: skip
    if grad is None:  # a loss that does not read the parameters: zeros, as the transform
        grad = torch.zeros_like(x)
    return grad.unsqueeze(0), (loss if tracked else loss.detach()).unsqueeze(0)


def inner_step(traj: Trajectory, opt: InnerOptimizer, second_order: bool = False):
    """Advance ``traj`` by one adapt-then-combine step; returns ``(losses [N], info)``.

    The returned losses (also appended to ``traj.history``) score the parameters before
    the update, differentiable w.r.t. theta: with one worker, its batch loss; with N > 1,
    by ``traj.score``: each worker's parameters on the *next* worker's batch
    ("next_worker"), or the workers' average on each worker's batch ("average"). Under
    label skew a worker's loss on its own shard rewards drifting apart (no mixing fits one
    shard best), so decentralized runs are scored on data from other shards: the global
    objective. Inner gradients are treated as constants unless ``second_order``.
    """
    if traj.states is None:
        traj.states = opt.init(traj.params, traj.layout)
    layout = traj.layout
    batch = traj.batches.get(traj.step)

    def loss_fn(flat: Tensor, b):
        return traj.task.loss(layout.unflatten(flat), b)

    if traj.num_workers == 1:
        grads, losses = _one_worker_grad(loss_fn, traj.params, batch, second_order)
    else:
        grads, losses = vmap(grad_and_value(loss_fn))(traj.params, batch)
    scored = losses
    if traj.num_workers > 1 and traj.score == "average":
        scored = vmap(loss_fn, in_dims=(None, 0))(traj.params.mean(0), batch)
    elif traj.num_workers > 1:  # each worker scored on the next worker's batch
        rolled = tuple(torch.roll(t, 1, dims=0) for t in batch)
        scored = vmap(loss_fn)(traj.params, rolled)
    if not second_order:
        grads = grads.detach()
    step = traj.step + 1
    gossip = traj.comm is not None and opt.mixing != "none"
    # a scheduled trajectory's factor after traj.step scheduler steps, as LambdaLR gives it
    lr_scale = HoldThenDecay(traj.length)(traj.step) if traj.scheduled else 1.0
    new_params, new_states = opt.update(
        layout, traj.params, grads, traj.states, step, gossip, lr_scale
    )
    info: dict = {"num_workers": traj.num_workers}
    with torch.no_grad():
        delta = (new_params - traj.params).detach()
        info["update_rms"] = segment_mean(delta * delta, layout).mean(0).sqrt()
    if gossip:
        tensors = list(layout.unflatten(new_params).values())
        if opt.kind == "dsgt":  # one exchange carries the parameters and the tracker
            tensors += list(layout.unflatten(new_states["wy"]).values())
        sending = sends_state(opt.share_state, traj.step, opt.share_state_every)
        shared = SHARED_STATE.get(opt.kind, ()) if sending else ()
        # and the state the workers normalise and step with, one flat tensor per entry
        state = [new_states[k].reshape(traj.num_workers, -1) for k in shared]
        mixed, states, mix_info = exchange_and_mix(
            traj.comm, tensors, state, traj.step, opt.mixing, opt.theta, opt.cfg, losses.detach()
        )
        if shared:
            new_states = {**new_states, **{k: y.reshape(new_states[k].shape)
                                           for k, y in zip(shared, states)}}  # fmt: skip
        flat = torch.cat([y.reshape(traj.num_workers, -1) for y in mixed], dim=1)
        new_params = flat[:, : layout.size]
        if opt.kind == "dsgt":
            new_states = {**new_states, "wy": flat[:, layout.size :]}
        info.update(mix_info)
    traj.params, traj.states, traj.step = new_params, new_states, step
    traj.history.append(float(scored.detach().mean()))
    return scored, info


def consensus_distance(traj: Trajectory) -> float:
    """(1/N) sum_i ||x_i - x_bar||^2 over all tensors; 0 for a single worker."""
    if traj.comm is None:
        return 0.0
    with torch.no_grad():
        return float(traj.comm.consensus_distance(traj.tensors()))
