"""``MetaTrainModule``: meta-trains the learned optimizer's theta with manual optimisation.

Each training step takes the task-sampling seeds of one meta-step, keeps
``tasks_per_step`` persistent inner trajectories (a task from the family, a worker count,
a topology, a data partition, a log-uniform length), advances each by one truncation of
``unroll_length`` inner steps with the estimator, and takes one clipped outer Adam step.
Validation compares against learning-rate-tuned Adam and D-Adam/Metropolis.

With ``estimator: es`` theta is the rule's constants (``theta_c``, :mod:`.rule_space`)
instead: each meta-step scores an antithetic population on whole training runs of jobs
drawn from the task distribution or a user's family (:mod:`.es`), its runs split across
the ranks of a data-parallel run and gathered, and takes one outer Adam step on
``theta_c``; validation scores the current constants against the base rule on fixed draws.
"""

from __future__ import annotations

import math
import statistics
import time

import lightning as L
import torch
import torch.distributed as dist

from learned_opt.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from learned_opt.config import NetConfig
from learned_opt.network import LearnedOptimizerNet, with_config
from learned_opt.step import Parts, active_parts
from learned_opt.tasks import get_family, get_task

from . import es
from .estimators import ESTIMATORS, is_finite, make_estimator
from .evaluation import BaselineCache, compare
from .families import resolve_family
from .inner import make_inner_optimizer
from .rule_space import DEFAULT_NAMES, apply_theta, base_fields, rule_fields
from .settings import PART_MODULES, validate_settings
from .slots import SlotSampler, restore_slots, serialise_slots


class MetaTrainModule(L.LightningModule):
    """Holds theta (``self.net``) and meta-trains it.

    Args (each is a field of the YAML ``model:`` section):
        width: per-element MLP width (8, 16 or 32).
        family: task family to sample inner tasks from (``learned_opt.tasks.list_families()``);
            with ``estimator: es``, ``"distribution"`` (the task distribution) or a family
            a user writes, by class path (``my_pkg.tasks:MyFamily``; see :mod:`.families`).
        tasks_per_step: persistent inner trajectories advanced per meta-step.
        unroll_length: inner steps per truncation (K).
        min_length, max_length: trajectory lengths are log-uniform in this range.
        worker_counts: simulated worker counts to sample from (1 = plain training).
        topologies: gossip topologies to sample from (invalid for a count -> ring).
        partitions: "iid" and/or "dirichlet"; alpha: the Dirichlet concentration.
        decentralized_score: how a decentralized trajectory's meta-loss scores it:
            "next_worker" (each worker on the next worker's batch) or "average" (the
            workers' averaged model on every worker's batch; see ``inner.SCORES``).
        estimator: "tbptt", "pes" or "es"; pes_sigma, pes_pairs: PES perturbation scale
            and pairs. "es" meta-trains the rule's constants on whole runs (:mod:`.es`):
        es_constants: the constants it trains (names of ``rule_space.SPACE``).
        es_pairs, es_sigma: antithetic pairs per meta-step and the perturbation scale.
        es_draws: jobs drawn per meta-step; every member and the base rule train each.
        es_horizon: the cap on a run's steps (a drawn job's own horizon when shorter).
        es_clip: a draw's speedup is clipped to [1/es_clip, es_clip] (its final-loss ratio
            alike).
        es_final_weight: the weight of the log final-loss ratio in a draw's score, beside
            the log step speedup (0: steps alone).
        es_kinds: the distribution's kinds to draw from (None: every kind).
        es_first_seed: the first job seed (meta-training draws from 10,000,000 on).
        es_val_draws: fixed draws that validation scores the constants on.
        meta_objective: "log_mean" (log of the mean loss ratio of a truncation),
            "mean_log" (mean of the log ratios) or "tail_log" (that mean weighted by where
            the truncation lies in its trajectory, the end counting most; see
            :mod:`.estimators`).
        train_parts: the parts of the network that meta-training changes, from "tensor"
            (the per-tensor network), "element" (the per-element MLP) and "edge" (the
            mixing head); the others keep their values exactly (no perturbation, no
            meta-gradient, no outer step). A part left out whose output head is zero is
            not evaluated in the unrolls either (the same values, cheaper).
        augment_loss_scale, augment_init_scale: task augmentation bounds (1 = off): each
            sampled task's loss times a log-uniform factor in [1/a, a], each of its initial
            parameter tensors times its own in [1/b, b] (see :mod:`.slots`).
        scheduled_fraction: the share of trajectories whose multiplier is held, then
            decayed linearly to 0 over the last half of their length, as ``wsd_schedule``
            decays a deployed optimizer's over a run of known length (0: every multiplier
            held, as in the stages before it).
        loss_clip: clip of L/L0 in the meta-loss (inner divergence).
        outer_lr, grad_clip: outer Adam learning rate and meta-gradient norm clip.
        val_*: validation tasks, horizon and the decentralized validation setting.
        init_checkpoint: start from a saved learned-optimizer checkpoint (with the es
            estimator, None is the shipped rule, ``adapt_init_2x``).
        init_config: fields of the starting network's ``NetConfig`` or ``MixingConfig``
            to replace, e.g. ``{"lr_adapt_min": -6.0}`` to train on a floor chosen after
            that checkpoint was saved (the exported checkpoint keeps them).
        baseline_cache: JSON file caching the tuned-baseline curves (None: memory only).
        histogram_every: log update/mixing histograms every this many meta-steps.
    """

    def __init__(
        self,
        width: int = 8,
        family: str = "mlp_family",
        tasks_per_step: int = 4,
        unroll_length: int = 20,
        min_length: int = 100,
        max_length: int = 1000,
        worker_counts: list[int] = (1, 2, 4, 8),
        topologies: list[str] = ("ring", "exponential", "one_peer_exponential"),
        partitions: list[str] = ("iid", "dirichlet"),
        alpha: float = 0.1,
        decentralized_score: str = "next_worker",
        estimator: str = "tbptt",
        pes_sigma: float = 0.01,
        pes_pairs: int = 4,
        meta_objective: str = "log_mean",
        train_parts: list[str] = ("tensor", "element", "edge"),
        augment_loss_scale: float = 1.0,
        augment_init_scale: float = 1.0,
        scheduled_fraction: float = 0.0,
        loss_clip: float = 4.0,
        outer_lr: float = 1e-3,
        grad_clip: float = 1.0,
        val_tasks: list[str] = ("digits_mlp", "wine_mlp"),
        val_horizon: int = 200,
        val_workers: int = 8,
        val_topology: str = "ring",
        val_partition: str = "dirichlet",
        val_alpha: float = 0.1,
        val_seed: int = 0,
        init_checkpoint: str | None = None,
        init_config: dict | None = None,
        baseline_cache: str | None = "runs/meta/baseline_cache.json",
        histogram_every: int = 50,
        es_constants: list[str] = DEFAULT_NAMES,
        es_pairs: int = 4,
        es_sigma: float = 0.1,
        es_draws: int = 4,
        es_horizon: int = 300,
        es_clip: float = 20.0,
        es_final_weight: float = 1.0,
        es_kinds: list[str] | None = None,
        es_first_seed: int = es.META_SEEDS,
        es_val_draws: int = 8,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.settings = validate_settings(dict(self.hparams))
        if init_checkpoint or estimator == "es":  # es: the shipped rule is theta_c = 0
            self.net, _ = load_checkpoint(init_checkpoint or DEFAULT_CHECKPOINT)
            if self.net.config.width != width:
                raise ValueError(
                    f"width: {width} differs from init_checkpoint's width {self.net.config.width}"
                )
        else:
            self.net = LearnedOptimizerNet(NetConfig(width=width))
        if init_config:
            try:
                self.net = with_config(self.net, init_config)
            except ValueError as exc:
                raise ValueError(f"init_config: {exc}") from None
        self.automatic_optimization = False
        s = self.settings
        self.uses_es = s.estimator == "es"
        if self.uses_es:  # theta is the rule's constants; the networks stay as they are
            self.constants = tuple(s.es_constants)
            self.theta_c = torch.nn.Parameter(torch.zeros(len(self.constants), dtype=torch.float64))
            self.trainable = frozenset()
            self.estimator, self.sampler = None, None
            self._make_job = resolve_family(s.family, s.es_kinds)
            try:
                rule_fields(base_fields(self.net), self.constants, self.theta_c.detach())
            except ValueError as exc:
                raise ValueError(f"es_constants: {exc}") from None
        else:
            self.trainable = trainable_names(self.net, s.train_parts)
            self.estimator = make_estimator(
                s.estimator, loss_clip=s.loss_clip, pes_sigma=s.pes_sigma,
                pes_pairs=s.pes_pairs, objective=s.meta_objective,
                trainable=None if len(s.train_parts) == len(PART_MODULES) else self.trainable,
            )  # fmt: skip
            self.sampler = SlotSampler(get_family(s.family), s)
        self.slots: list = []
        self.skipped_steps = 0
        self.train_seconds = 0.0
        self.last_validation: dict = {}
        self._cache = BaselineCache(s.baseline_cache)

    launch_command = "MetaTrainModule (Python API)"  # the CLI sets the exact command line

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of the ``train_parts`` (what the outer optimizer steps); with the
        es estimator, ``theta_c``."""
        if self.uses_es:
            return [self.theta_c]
        return [p for n, p in self.net.named_parameters() if n in self.trainable]

    def rule_net(self) -> LearnedOptimizerNet:
        """The network of the rule being trained: with the es estimator, the base network
        with the constants ``theta_c`` sets; otherwise ``self.net``."""
        if not self.uses_es:
            return self.net
        return apply_theta(self.net, self.constants, self.theta_c.detach())

    def constant_values(self) -> dict:
        """The constants ``theta_c`` sets (es estimator only)."""
        return rule_fields(base_fields(self.net), self.constants, self.theta_c.detach())

    def unroll_parts(self) -> Parts:
        """The networks the unrolls evaluate: those trained and those whose heads are set."""
        active = active_parts(self.net.theta())
        parts = self.settings.train_parts
        return Parts(
            tensor_net="tensor" in parts or active.tensor_net,
            element_net="element" in parts or active.element_net,
        )

    def configure_optimizers(self):
        return torch.optim.Adam(self.trainable_parameters(), lr=self.settings.outer_lr)

    # ---------------------------------------------------------------- training
    def training_step(self, batch, batch_idx):
        if self.uses_es:
            return self._es_training_step()
        s = self.settings
        start = time.perf_counter()
        seeds = [int(x) for x in batch.reshape(-1)]
        while len(self.slots) < s.tasks_per_step:
            self.slots.append(None)
        # a slot's index among every rank's (rank r of a data-parallel run holds slots
        # r * tasks_per_step on): N ranks sample the tasks one process with N times the slots
        # would
        first = rank_and_world()[0] * s.tasks_per_step
        for i in range(s.tasks_per_step):
            if self.slots[i] is None or self.slots[i][0].done:
                self.slots[i] = self.estimator.particles(
                    self.sampler.sample(seeds[i % len(seeds)] + first + i, self.device)
                )
        opt = make_inner_optimizer(
            "learned", net=self.net, mixing="learned", parts=self.unroll_parts()
        )
        infos: list = []
        meta_loss, grads = self.estimator.estimate(
            self.net, opt, self.slots, s.unroll_length, infos
        )
        outer = self.optimizers()
        meta_loss, *grads = mean_across_ranks([meta_loss, *grads])
        if is_finite(grads, meta_loss):
            for (name, p), g in zip(self.net.named_parameters(), grads):
                p.grad = g.to(p.dtype) if name in self.trainable else None
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), s.grad_clip)
            outer.step()
            outer.zero_grad(set_to_none=True)
            self.log("meta/grad_norm", float(grad_norm))
        else:
            self.skipped_steps += 1  # theta is untouched; the trajectories are reset
            for i, slot in enumerate(self.slots):
                if not math.isfinite(slot[0].history[-1] if slot[0].history else 0.0):
                    self.slots[i] = None
        elapsed = time.perf_counter() - start
        self.train_seconds += elapsed
        worker_steps = sum(info["num_workers"] for info in infos)
        self.log("meta/loss", float(meta_loss), prog_bar=True)
        self.log("meta/skipped_steps", float(self.skipped_steps))
        self.log("meta/outer_lr", outer.param_groups[0]["lr"])
        self.log(
            "meta/inner_steps_x_workers_per_s", worker_steps / max(elapsed, 1e-9), prog_bar=True
        )
        if s.histogram_every and self.global_step % s.histogram_every == 0:
            self._log_histograms(infos)
        return None

    # ---------------------------------------------------------------- evolution strategies
    def _rule(self, theta):
        """``make(params) -> optimizer`` of a member (``theta=None``: the base rule), the
        eager reference step."""
        from learned_opt.optimizer import LearnedOptimizer

        net = self.net if theta is None else apply_theta(self.net, self.constants, theta)
        return lambda params: LearnedOptimizer(params, net=net, compile=False)

    def _shares(self, units: list, seeds: list[int], world: int) -> list[list]:
        """The ranks' shares of ``units``, balanced by the draws' estimated costs (one
        process: every unit, and no job is built to estimate them)."""
        if world == 1:
            return [list(units)]
        cap = self.settings.es_horizon
        with torch.inference_mode(False):
            costs = [es.job_cost(self._make_job(seed), cap) for seed in seeds]
        return es.balanced_shares(units, costs, world)

    def es_update(self, meta_step: int, outer) -> dict:
        """One meta-step of the es estimator: this rank's share of the population's runs,
        the curves of every rank gathered, the antithetic gradient and one step of
        ``outer`` on ``theta_c``. Every rank computes the same update."""
        s = self.settings
        rank, world = rank_and_world()
        eps = es.perturbations(s.es_first_seed, meta_step, s.es_pairs, len(self.constants))
        members = es.population(self.theta_c, eps, s.es_sigma)
        seeds = es.draw_seeds(s.es_first_seed, meta_step, s.es_draws)
        shares = self._shares(es.work_units(len(members), len(seeds)), seeds, world)
        mine = shares[rank]
        runs = es.run_units(mine, members, seeds, self._make_job, self._rule, s.es_horizon)
        curves = es.merge(gather_objects(runs))
        scores = es.score_matrix(curves, len(members), len(seeds), s.es_clip, s.es_final_weight)
        busy = [sum(curves[u]["seconds"] for u in share) for share in shares]
        grad = es.gradient(eps, scores.mean(1), s.es_sigma)
        self.theta_c.grad = (-grad).to(self.theta_c)  # outer Adam descends; ES climbs
        norm = torch.nn.utils.clip_grad_norm_([self.theta_c], s.grad_clip)
        outer.step()
        outer.zero_grad(set_to_none=True)
        return {
            **es.summary(curves, scores), "grad_norm": float(norm), "my_runs": len(mine),
            # the ranks' seconds of runs: mean over max is 1 when the split is even
            "rank_balance": statistics.fmean(busy) / max(max(busy), 1e-9),
        }  # fmt: skip

    def _es_training_step(self):
        start = time.perf_counter()
        info = self.es_update(int(self.global_step), self.optimizers())
        elapsed = time.perf_counter() - start
        self.train_seconds += elapsed
        self.log("meta/es_score", info["score"], prog_bar=True)
        self.log("meta/es_member_diverged", float(info["member_diverged"]))
        self.log("meta/es_base_diverged", float(info["base_diverged"]))
        self.log("meta/grad_norm", info["grad_norm"])
        self.log("meta/outer_lr", self.optimizers().param_groups[0]["lr"])
        self.log("meta/seconds_per_step", elapsed)
        self.log("meta/es_rank_balance", info["rank_balance"])
        for name, value in self.constant_values().items():
            self.log(f"constants/{name}", float(value))
        return None

    def es_validation(self) -> dict:
        """The current constants against the base rule on ``es_val_draws`` fixed draws
        (seeds from :data:`.es.VAL_SEEDS`), each rank running its share."""
        s = self.settings
        seeds = list(range(es.VAL_SEEDS, es.VAL_SEEDS + s.es_val_draws))
        members = self.theta_c.detach().to(torch.float64)[None]
        rank, world = rank_and_world()
        mine = self._shares(es.work_units(1, len(seeds)), seeds, world)[rank]
        runs = es.run_units(mine, members, seeds, self._make_job, self._rule, s.es_horizon)
        curves = es.merge(gather_objects(runs))
        steps = [
            es.log_speedup(curves[(0, d)]["curve"], curves[(es.BASE, d)]["curve"], s.es_clip)
            for d in range(len(seeds))
        ]
        finals = [
            es.log_final_ratio(curves[(0, d)]["curve"], curves[(es.BASE, d)]["curve"], s.es_clip)
            for d in range(len(seeds))
        ]
        return {
            "es_geomean_speedup": es.geometric_mean_speedup(steps),
            "es_geomean_final_ratio": es.geometric_mean_speedup(finals),
            "es_log_speedups": [round(x, 4) for x in steps],
            "kinds": [curves[(es.BASE, d)]["kind"] for d in range(len(seeds))],
            "diverged": sum(es.diverged(curves[(0, d)]["curve"]) for d in range(len(seeds))),
            "base_diverged": sum(
                es.diverged(curves[(es.BASE, d)]["curve"]) for d in range(len(seeds))
            ),
            "constants": self.constant_values(),
            "setting": {
                "family": s.family, "draws": len(seeds), "first_seed": seeds[0] if seeds else None,
                "horizon_cap": s.es_horizon, "kinds": s.es_kinds, "against": "the base rule",
            },
            "global_step": int(self.global_step),
        }  # fmt: skip

    def _log_histograms(self, infos: list) -> None:
        writer = getattr(self.logger, "experiment", None)
        if writer is None or not hasattr(writer, "add_histogram"):
            return
        upd = [float(u) for info in infos for u in info.get("update_rms", [])]
        weights = [w.detach().reshape(-1) for info in infos for w in info.get("weights", [])]
        if upd:
            writer.add_histogram("train/update_rms", torch.tensor(upd), self.global_step)
        if weights:
            writer.add_histogram("train/mixing_weights", torch.cat(weights), self.global_step)

    # ---------------------------------------------------------------- validation
    @torch.no_grad()
    def run_validation(self) -> tuple[dict, list, list]:
        """Validation against tuned Adam (1 worker) and tuned D-Adam/Metropolis.

        Returns ``(summary, single, decentralized)``; the lists hold one comparison per
        validation task (see :func:`~learned_opt.meta_train.evaluation.compare`).
        """
        s = self.settings
        if self.uses_es:
            return self.es_validation(), [], []
        learned = make_inner_optimizer("learned", net=self.net, mixing="learned")
        single, decentral = [], []
        for name in s.val_tasks:
            task = get_task(name)
            common = dict(steps=s.val_horizon, seed=s.val_seed, device=self.device)
            single.append(compare(task, learned, self._cache, **common))
            decentral.append(
                compare(
                    task, learned, self._cache, num_workers=s.val_workers, topology=s.val_topology,
                    partition=s.val_partition, alpha=s.val_alpha, **common,
                )
            )  # fmt: skip
        summary = {
            "median_speedup_adam": statistics.median(r["speedup"] for r in single),
            "median_speedup_dadam": statistics.median(r["speedup"] for r in decentral),
            "diverged": int(sum(r["diverged"] for r in single + decentral)),
            "single": [{k: v for k, v in r.items() if "curve" not in k} for r in single],
            "decentralized": [{k: v for k, v in r.items() if "curve" not in k} for r in decentral],
            "setting": {
                "horizon": s.val_horizon, "workers": s.val_workers, "topology": s.val_topology,
                "partition": s.val_partition, "alpha": s.val_alpha, "seed": s.val_seed,
                "baseline_grid": "adam lr 1e-4..1e-1 (x3 steps), extended at the edges",
            },
            "global_step": int(self.global_step),
        }  # fmt: skip
        return summary, single, decentral

    def validation_step(self, batch, batch_idx):
        if self.uses_es:
            summary = self.es_validation()
            # the same on every rank; sync_dist only says so to Lightning
            sync = {"sync_dist": rank_and_world()[1] > 1}
            self.log("val/es_speedup", summary["es_geomean_speedup"], prog_bar=True, **sync)
            self.log("val/es_final_ratio", summary["es_geomean_final_ratio"], **sync)
            self.log("val/es_diverged", float(summary["diverged"]), **sync)
            self.log("hp_metric", summary["es_geomean_speedup"], **sync)
            self.last_validation = summary
            return
        summary, single, decentral = self.run_validation()
        for r in single:
            self.log(f"val/speedup_adam/{r['task']}", r["speedup"])
            self.log(
                f"val/final_loss_ratio_adam/{r['task']}", r["learned_final"] / r["baseline_final"]
            )
        for r in decentral:
            self.log(f"val/speedup_dadam/{r['task']}", r["speedup"])
            self.log(f"val/consensus/{r['task']}", r["consensus"])
            self.log(f"val/consensus_dadam/{r['task']}", r["baseline_consensus"])
        self.log("val/median_speedup_adam", summary["median_speedup_adam"], prog_bar=True)
        self.log("val/median_speedup_dadam", summary["median_speedup_dadam"], prog_bar=True)
        self.log("val/diverged", float(summary["diverged"]))
        self.log("hp_metric", summary["median_speedup_adam"])
        self.last_validation = summary
        self._log_probe(single[0], decentral[0])

    def _log_probe(self, single: dict, decentral: dict) -> None:
        writer = getattr(self.logger, "experiment", None)
        if writer is None or not hasattr(writer, "add_image"):
            return
        from .probe import probe_mixing_matrix
        from .summaries import curves_image, matrix_image

        img = curves_image(
            {
                "learned": single["learned_curve"], "tuned Adam": single["baseline_curve"],
                f"learned, {self.settings.val_workers} workers": decentral["learned_curve"],
                "tuned D-Adam/Metropolis": decentral["baseline_curve"],
            },
            f"probe task {single['task']}",
        )  # fmt: skip
        writer.add_image("probe/loss_curves", img, self.global_step, dataformats="HWC")
        matrix = probe_mixing_matrix(
            self.net, get_task(self.settings.val_tasks[0]), self.settings, self.device
        )
        writer.add_image(
            "probe/mixing_matrix",
            matrix_image(matrix, "learned mixing (first tensor)"),
            self.global_step,
            dataformats="HWC",
        )

    # ---------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["meta_slots"] = serialise_slots(self.slots)
        checkpoint["meta_state"] = {
            "command": self.launch_command,
            "skipped_steps": self.skipped_steps,
            "train_seconds": self.train_seconds,
            "last_validation": self.last_validation,
            # what export rebuilds the network from (with es, the constants theta_c sets)
            "net_config": self.rule_net().config.to_dict(),
            "net_mixing": self.rule_net().mixing.to_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("meta_state", {})
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.last_validation = state.get("last_validation", {})
        if self.estimator is not None:
            self.slots = restore_slots(
                checkpoint.get("meta_slots", []), self.estimator, self.device
            )


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes (0 and 1 outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` outside a process group)."""
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def mean_across_ranks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The mean of each tensor over the ranks (the tensors themselves outside a process
    group): the meta-gradients of data-parallel truncated unrolls."""
    _, world = rank_and_world()
    if world == 1:
        return tensors
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].reshape(t.shape).to(t.dtype))
        start += t.numel()
    return out


def trainable_names(net, parts) -> frozenset[str]:
    """Names of ``net``'s parameters that belong to ``parts`` (keys of ``PART_MODULES``)."""
    owner = {m: part for part, mods in PART_MODULES.items() for m in mods}
    names = set()
    for name, _ in net.named_parameters():
        module = name.split(".")[0]
        if module not in owner:
            raise ValueError(f"parameter {name!r} belongs to no part of train_parts")
        if owner[module] in parts:
            names.add(name)
    return frozenset(names)


__all__ = [
    "ESTIMATORS",
    "MetaTrainModule",
    "gather_objects",
    "mean_across_ranks",
    "rank_and_world",
    "trainable_names",
]
