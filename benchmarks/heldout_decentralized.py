"""Decentralized runs of the held-out suite: simulated gossip workers on label-skewed data.

The inner training and the tuned baselines are meta-training's own; what differs is the
score: the loss of the *averaged* model on the whole training set, evaluated every
``every`` steps (held in between), not the workers' batch losses.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from learned_opt import load_checkpoint
from learned_opt.meta_train.evaluation import final_loss, speedup, tune_baseline
from learned_opt.meta_train.inner import (
    InnerOptimizer,
    consensus_distance,
    inner_step,
    make_inner_optimizer,
    new_trajectory,
)
from learned_opt.tasks import get_task

#: Baselines: label -> inner optimizer kind (each Metropolis-mixed and tuned).
BASELINES = {"D-SGD": "sgd", "D-Adam": "adam", "DSGT": "dsgt"}


def setting_key(setting: dict) -> str:
    """The cache key of a setting's tuned baselines (each over its full grid)."""
    return "dec|" + "|".join(f"{k}={setting[k]}" for k in sorted(setting)) + "|gridNone"


def averaged_train_loss(task, traj) -> float:
    """The decentralized objective at the workers' average (inf if not finite): its loss on
    the whole training set, which the workers' label-skewed shards partition."""
    avg = {k: v.mean(0) for k, v in traj.layout.unflatten(traj.params).items()}
    loss = task.evaluate(avg, split="train", max_examples=task.data.num_train)["loss"]
    return loss if math.isfinite(loss) else math.inf


@torch.no_grad()
def run_averaged(task_name: str, opt: InnerOptimizer, setting: dict) -> dict:
    """One decentralized run; ``curve[t]`` is the averaged model's training-set loss after
    step ``t + 1`` (evaluated every ``setting["every"]`` steps and held in between)."""
    task = get_task(task_name)
    steps, every = setting["horizon"], setting["every"]
    traj = new_trajectory(task, setting["workers"], setting["topology"], "dirichlet",
                          setting["alpha"], setting.get("seed", 0), steps)  # fmt: skip
    curve: list[float] = []
    value = math.inf
    for t in range(steps):
        losses, _ = inner_step(traj, opt)
        if not bool(torch.isfinite(losses).all()):
            curve += [math.inf] * (steps - len(curve))
            break
        if t % every == 0 or t == steps - 1:
            value = float(f"{averaged_train_loss(task, traj):.6g}")
        curve.append(value)
    return {"curve": curve, "consensus": consensus_distance(traj)}


def baseline_job(task_name: str, setting: dict) -> dict:
    """Every baseline tuned over its grid by the averaged model's final loss."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    out = {}
    for label, kind in BASELINES.items():
        tuned = tune_baseline(kind, "metropolis",
                              lambda o: run_averaged(task_name, o, setting))  # fmt: skip
        out[label] = {"lr": tuned["lr"], "curve": tuned["curve"], "final": tuned["final"],
                      "consensus": tuned["consensus"], "grid": tuned["grid"]}  # fmt: skip
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def learned_job(task_name: str, setting: dict, checkpoint: str, timing_steps: int = 10) -> dict:
    """The checkpoint's optimizer with learned mixing, then its simulated step time side by
    side with every baseline's (all workers in one process, without the evaluations)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    net, _ = load_checkpoint(checkpoint)
    learned = make_inner_optimizer("learned", net=net, mixing="learned", parts=None)
    out = run_averaged(task_name, learned, setting)
    opts = {"learned": learned, **{k: InnerOptimizer(v, 1e-3) for k, v in BASELINES.items()}}
    timing = time_inner_steps(task_name, opts, setting, timing_steps)
    return {**out, "ms_per_step": timing, "seconds": round(time.perf_counter() - start, 1)}


@torch.no_grad()
def time_inner_steps(task_name: str, opts: dict[str, InnerOptimizer], setting: dict,
                     steps: int = 10, warmup: int = 2) -> dict[str, float]:  # fmt: skip
    """Median ms of one simulated step of all workers per optimizer, taking turns."""
    task = get_task(task_name)
    trajs = {
        name: new_trajectory(task, setting["workers"], setting["topology"], "dirichlet",
                             setting["alpha"], 0, steps + warmup)
        for name in opts
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(warmup + steps):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            inner_step(trajs[name], opt)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def score(learned: dict, baselines: dict) -> dict:
    """Speedups of the learned run over every tuned baseline and over the best one, by
    step count and, where ``learned`` holds ``ms_per_step``, by wall clock."""
    rows = {k: v for k, v in baselines.items() if k in BASELINES}
    best = min(rows, key=lambda k: rows[k]["final"])
    step_speedup = speedup(learned["curve"], rows[best]["curve"])
    out = {
        "best_baseline": best,
        "speedup": step_speedup,
        "speedup_vs": {k: speedup(learned["curve"], r["curve"]) for k, r in rows.items()},
        "learned_final": final_loss(learned["curve"]),
        "baselines": {
            k: {"lr": r["lr"], "final": r["final"], "consensus": r["consensus"]}
            for k, r in rows.items()
        },  # fmt: skip
        "learned_consensus": learned["consensus"],
    }
    if "ms_per_step" in learned:
        ms = learned["ms_per_step"]
        out["wall_speedup"] = step_speedup * ms[best] / ms["learned"]
        out["ms_per_step"] = ms
    return out


def over_seeds(scored: list[dict]) -> dict:
    """Scores of one row at several seeds as one row: the first seed's fields, with
    ``speedup`` (and ``wall_speedup`` where every seed has one) the median over the seeds,
    the per-seed step speedups in ``speedup_by_seed`` and, where the scores name a best
    baseline, the per-seed ones in ``best_baseline_by_seed``."""
    row = {**scored[0], "speedup": statistics.median(x["speedup"] for x in scored),
           "speedup_by_seed": [round(x["speedup"], 4) for x in scored]}  # fmt: skip
    if all("best_baseline" in x for x in scored):
        row["best_baseline_by_seed"] = [x["best_baseline"] for x in scored]
    if all("wall_speedup" in x for x in scored):
        row["wall_speedup"] = statistics.median(x["wall_speedup"] for x in scored)
    return row
