"""Meta-gradient estimators behind one interface: truncated backprop and antithetic PES.

An estimator advances a set of persistent trajectories by one truncation of ``K`` inner
steps and returns ``(meta_loss, grads)``, where ``grads`` matches ``net.parameters()``.

Meta-loss of one truncation (design, "Meta-training"): the log of the mean training loss
over the unroll and the workers, normalised by the trajectory's initial loss, with each
ratio clipped at ``loss_clip`` (inner divergence) and a floor::

    log(mean(min(L / L0, loss_clip)) + 1e-6)              ("log_mean", the default)

or, as the option ``meta_objective: mean_log``, the mean over the unroll and the workers of
the log of each clipped ratio::

    mean(log(min(L / L0, loss_clip) + 1e-6))              ("mean_log")

The log of the mean is dominated by the largest losses of the unroll (its first steps);
the mean of the logs weighs every step alike on a log scale, so a rule that reaches a low
loss early and stays there scores better than one that ends at the same loss late or
climbs back after a dip. ``meta_objective: tail_log`` weighs each truncation's mean of
the logs by ``2 * position``, where ``position`` is the middle of the truncation as a share
of its trajectory's length: over a trajectory the weights average one, and a truncation
near the end counts about twice as much as the mean, one near the start about nothing, so
a rule is judged mostly by where its long runs end (a step-size signal that is greedy,
shrinking the step where the gradient is noise, wins the first steps and loses the end).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from .inner import InnerOptimizer, Trajectory, inner_step

ESTIMATORS = ("tbptt", "pes")
#: Meta-objectives of :func:`truncation_meta_loss` (the first is the default).
META_OBJECTIVES = ("log_mean", "mean_log", "tail_log")
META_LOSS_FLOOR = 1e-6


def truncation_meta_loss(
    losses: list[Tensor],
    loss0: float,
    loss_clip: float,
    objective: str = "log_mean",
    position: float = 0.5,
) -> Tensor:
    """Meta-loss of one truncation from its per-step worker losses (each ``[N]``):
    ``objective`` is one of :data:`META_OBJECTIVES` (see the module docstring);
    ``position``, the truncation's middle as a share of its trajectory (``tail_log``)."""
    ratios = torch.stack(losses) / loss0
    ratios = torch.nan_to_num(ratios, nan=loss_clip, posinf=loss_clip).clamp(max=loss_clip)
    if objective == "log_mean":
        return torch.log(ratios.mean() + META_LOSS_FLOOR)
    if objective in ("mean_log", "tail_log"):
        mean_log = torch.log(ratios + META_LOSS_FLOOR).mean()
        return mean_log if objective == "mean_log" else 2.0 * position * mean_log
    raise ValueError(f"unknown meta-objective {objective!r}; valid: {META_OBJECTIVES}")


def unroll(
    traj: Trajectory,
    opt: InnerOptimizer,
    steps: int,
    loss_clip: float,
    infos=None,
    second_order: bool = False,
    objective: str = "log_mean",
):
    """Run up to ``steps`` inner steps (stopping at the trajectory's end); meta-loss."""
    losses, start = [], traj.step
    for _ in range(steps):
        if traj.done:
            break
        step_losses, info = inner_step(traj, opt, second_order)
        losses.append(step_losses)
        if infos is not None:
            infos.append(info)
        if not bool(torch.isfinite(step_losses.detach()).all()):
            traj.length = traj.step  # diverged: end the trajectory, the sampler resets it
            break
    position = (start + traj.step) / (2 * max(traj.length, 1))
    return truncation_meta_loss(losses, traj.loss0, loss_clip, objective, position)


class TBPTT:
    """Truncated backprop through the unroll.

    Inner gradients are treated as constants (first order) unless ``second_order``, which
    differentiates through them too (exact, about twice the cost). ``trainable``: the
    names of the parameters to differentiate (None: all); the others get zero gradients.
    """

    name = "tbptt"

    def __init__(
        self,
        loss_clip: float = 4.0,
        second_order: bool = False,
        objective: str = "log_mean",
        trainable=None,
        **_,
    ):
        self.loss_clip, self.second_order = loss_clip, second_order
        self.objective = objective
        self.trainable = None if trainable is None else frozenset(trainable)

    def particles(self, traj: Trajectory) -> list[Trajectory]:
        return [traj]

    def estimate(
        self, net, opt: InnerOptimizer, trajs: list[list[Trajectory]], steps: int, infos=None
    ):
        named = list(net.named_parameters())
        wanted = [p for n, p in named if self.trainable is None or n in self.trainable]
        meta = []
        for (traj,) in trajs:
            traj.detach_()
            meta.append(
                unroll(traj, opt, steps, self.loss_clip, infos, self.second_order, self.objective)
            )
        meta_loss = torch.stack(meta).mean()
        found = torch.autograd.grad(meta_loss, wanted, allow_unused=True)
        by_id = {id(p): g for p, g in zip(wanted, found)}
        grads = [by_id.get(id(p)) for _, p in named]
        grads = [torch.zeros_like(p) if g is None else g for (_, p), g in zip(named, grads)]
        return meta_loss.detach(), grads


class PES:
    """Antithetic persistent evolution strategies.

    Each trajectory carries ``2 * pairs`` particles; particle pair ``k`` runs with
    ``theta + eps_k`` and ``theta - eps_k``. The perturbations of a pair accumulate over
    the truncations of one trajectory (reset with it), which removes truncation bias.
    ``trainable``: the names of the parameters to perturb (None: all); the others keep
    their value in every particle and get zero gradients.
    """

    name = "pes"

    def __init__(
        self,
        loss_clip: float = 4.0,
        pes_sigma: float = 0.01,
        pes_pairs: int = 4,
        objective: str = "log_mean",
        trainable=None,
        **_,
    ):
        if pes_pairs < 1 or not pes_sigma > 0:
            raise ValueError("PES needs pes_pairs >= 1 and pes_sigma > 0")
        self.loss_clip, self.sigma, self.pairs = loss_clip, pes_sigma, pes_pairs
        self.objective = objective
        self.trainable = None if trainable is None else frozenset(trainable)
        self.generator = torch.Generator().manual_seed(0)

    def particles(self, traj: Trajectory) -> list[Trajectory]:
        """The trajectory followed by its ``2 * pairs`` particle copies."""
        out = []
        for _ in range(2 * self.pairs):
            p = copy.copy(traj)
            p.params = traj.params.clone()
            p.states = (
                None if traj.states is None else {k: v.clone() for k, v in traj.states.items()}
            )
            p.history = []
            out.append(p)
        traj.pes_accum = None
        return [traj, *out]

    @torch.no_grad()
    def estimate(
        self, net, opt: InnerOptimizer, trajs: list[list[Trajectory]], steps: int, infos=None
    ):
        all_names = [n for n, _ in net.named_parameters()]
        names = [n for n in all_names if self.trainable is None or n in self.trainable]
        theta = {n: p.detach() for n, p in net.named_parameters()}
        grads = {n: torch.zeros_like(t) for n, t in theta.items()}
        meta = []
        for group in trajs:
            head, parts = group[0], group[1:]
            eps = [
                {
                    n: self.sigma
                    * torch.randn(theta[n].shape, generator=self.generator).to(theta[n])
                    for n in names
                }
                for _ in range(self.pairs)
            ]
            if getattr(head, "pes_accum", None) is None:
                head.pes_accum = [
                    {n: torch.zeros_like(theta[n]) for n in names} for _ in range(self.pairs)
                ]
            for k in range(self.pairs):
                acc = head.pes_accum[k]
                for n in names:
                    acc[n] += eps[k][n]
                values = []
                for sign, part in ((1.0, parts[2 * k]), (-1.0, parts[2 * k + 1])):
                    pert = copy.copy(opt)
                    pert.theta = {**theta, **{n: theta[n] + sign * eps[k][n] for n in names}}
                    values.append(
                        unroll(part, pert, steps, self.loss_clip, infos, objective=self.objective)
                    )
                meta.extend(values)
                diff = values[0] - values[1]
                if torch.isfinite(diff):
                    for n in names:
                        grads[n] += diff * acc[n] / (2 * self.sigma**2 * self.pairs)
            head.step = parts[0].step
            head.length = min(head.length, min(p.length for p in parts))
            head.history = list(parts[0].history)  # the unperturbed record: pair 0, +eps
        meta_loss = torch.stack(meta).mean()
        return meta_loss, [grads[n] for n in all_names]


def make_estimator(name: str, **kwargs):
    """Build an estimator by name; ``ValueError`` naming the valid choices."""
    if name == "tbptt":
        return TBPTT(**kwargs)
    if name == "pes":
        return PES(**kwargs)
    raise ValueError(f"unknown estimator {name!r}; valid choices: {ESTIMATORS}")


def is_finite(grads: list[Tensor], meta_loss: Tensor) -> bool:
    """True when the meta-loss and every meta-gradient entry are finite."""
    return math.isfinite(float(meta_loss)) and all(bool(torch.isfinite(g).all()) for g in grads)
