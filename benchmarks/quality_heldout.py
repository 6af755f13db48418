"""Held-out suite: the learned optimizer, untuned, on tasks meta-training never sees.

Single worker (:mod:`.heldout_single`): every held-out task at two horizons against AdamW
tuned per task and horizon. Decentralized (:mod:`.heldout_decentralized`): simulated workers
on label-skewed data against tuned D-SGD, D-Adam and DSGT. Every row runs at every seed of
``--seeds``, its baselines tuned per seed, and is scored by the median over the seeds
(:mod:`.heldout_rows`); the step times behind the wall-clock speedups are seed 0's. Tuned
baselines are cached in :data:`CACHE`, so a new checkpoint only runs the learned side. A
factory is evaluated single-worker only (decentralized runs need a mixing head).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks import heldout_decentralized as dec
from benchmarks import heldout_single as single
from benchmarks.common import RESULTS, Cache, command_line, curves_png, machine, write_json
from benchmarks.heldout_rows import TARGETS, decentralized_rows, headline, single_rows, summarise
from benchmarks.job_queue import AdamWGrid, run_jobs
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.meta_train.evaluation import final_loss
from learned_opt.tasks import list_heldout_tasks

SHORT = 200
LONG = {"heldout_char_lm": 1500, "heldout_wide_mlp": 1500}  # the costliest at 1500 steps
DEFAULT_LONG = 2000
#: Relative cost, for the submission order.
COST = {"heldout_logreg_l2": 0, "heldout_autoencoder": 1, "heldout_convnet_bn": 2,
        "heldout_wide_mlp": 3, "heldout_char_lm": 4}  # fmt: skip
#: Bumped whenever what a cached baseline run measures changes.
CACHE_VERSION = 1
CACHE = RESULTS / f"quality_heldout_baselines_v{CACHE_VERSION}.json.gz"


def _setting(task, workers, topology, alpha, horizon, every=1) -> dict:
    return dict(task=task, workers=workers, topology=topology, alpha=alpha,
                horizon=horizon, every=every, seed=0)  # fmt: skip


DEC_FULL = [
    _setting("heldout_autoencoder", 16, "ring", 0.1, 200),
    _setting("heldout_autoencoder", 8, "torus", 1.0, 200),
    _setting("heldout_logreg_l2", 8, "exponential", 0.3, 200),
    _setting("heldout_logreg_l2", 16, "torus", 0.1, 200),
    _setting("heldout_convnet_bn", 4, "ring", 0.3, 200, every=5),
]
DEC_QUICK = DEC_FULL[1:3]  # a subset, so the full suite's tuned baselines serve it
#: Seeds of every row, single-worker and decentralized (--quick: the first only).
DEC_SEEDS = (0, 1, 2)


class Suite(AdamWGrid):
    """The jobs of one invocation, their results, and the baseline cache."""

    def __init__(self, args):
        self.args = args
        self.cache = Cache(CACHE)
        self.tasks = args.tasks or list_heldout_tasks()
        self.sides = list(args.checkpoint) + list(args.factory)
        self.checkpoints = list(args.checkpoint)
        self.grid = single.QUICK_GRID if args.quick else single.ADAMW_GRID
        plan = DEC_QUICK if args.quick else DEC_FULL
        self.seeds = list(args.seeds or (DEC_SEEDS[:1] if args.quick else DEC_SEEDS))
        # AdamW's grid per (task, seed), each extended at its own edge
        self.lrs = {(t, seed): set(self.grid) for t in self.tasks for seed in self.seeds}
        self.extensions = {ts: 0 for ts in self.lrs}
        # factories and a rule under a schedule run single-worker only: no decentralized
        # row is scored, so no decentralized baseline is tuned either
        scored = self.checkpoints and args.schedule == "constant"
        self.settings = [dict(s, seed=seed) for s in plan if s["task"] in self.tasks
                         for seed in self.seeds] if scored else []  # fmt: skip
        self.learned: dict = {}  # (side, task, mult, steps, seed) -> curve
        self.timing: dict = {}  # (side, task) -> ms per step
        self.dec_learned: dict = {}  # (side, setting key) -> result
        self.pending: dict = {}  # job ticket -> (kind, key, task)
        self.done = 0

    def horizons(self, task: str) -> list[int]:
        return [SHORT] if self.args.quick else [SHORT, LONG.get(task, DEFAULT_LONG)]

    def lengths(self, task: str) -> set[int]:  # a constant run of the long horizon serves --quick
        return {SHORT, LONG.get(task, DEFAULT_LONG)}

    # ------------------------------------------------------------------ scheduling
    def submit_learned(self, pool, kind: str, key: tuple, task: str, fn, *args, **kwargs):
        """Submit a learned-side job; its result goes to ``self.<kind>[key]``."""
        self.pending[pool.submit(fn, *args, **kwargs)] = (kind, key, task)

    def submit_all(self, pool) -> None:
        """Submit every job, seed by seed, in the order that makes a run stopped early most
        useful: the short horizon (cheapest task first), the decentralized settings, the long
        horizon, and its lr-multiplier runs."""
        order = sorted(self.tasks, key=lambda t: COST.get(t, 0))
        for seed in self.seeds:
            for task in order:
                self.submit_task(pool, task, SHORT, single.LR_MULTS, seed,
                                 timing=seed == self.seeds[0])  # fmt: skip
            self.submit_decentralized(pool, seed)
            if not self.args.quick:
                for task in order:
                    long = LONG.get(task, DEFAULT_LONG)
                    self.submit_task(pool, task, long, single.LR_MULTS[:1], seed)
                for task in order:
                    long = LONG.get(task, DEFAULT_LONG)
                    self.submit_task(pool, task, long, single.LR_MULTS[1:], seed, grid=False)
        for seed in self.seeds:
            for task in order:
                self.maybe_extend(pool, task, seed)  # when whole grids were cached

    def submit_decentralized(self, pool, seed: int) -> None:
        """The decentralized settings at ``seed``: tuned baselines and checkpoints' runs."""
        for s in (s for s in self.settings if s["seed"] == seed):
            key = dec.setting_key(s)
            if key not in self.cache.data:
                f = pool.submit(dec.baseline_job, s["task"], s)
                self.pending[f] = ("dec_base", key, s["task"])
            for side in self.checkpoints:
                self.submit_learned(pool, "dec_learned", (side, key), s["task"],
                                    dec.learned_job, s["task"], s, side)  # fmt: skip

    def submit_task(self, pool, task: str, steps: int, mults: tuple, seed: int,
                    grid: bool = True, timing: bool = False) -> None:  # fmt: skip
        """A task's learned-side runs of ``steps`` steps at ``mults`` and ``seed`` (and its
        step timing, at seed 0), and with ``grid`` the AdamW grid at that horizon and seed."""
        for side in self.sides:
            if timing:
                self.submit_learned(pool, "timing", (side, task), task,
                                    single.timing_job, task, side)  # fmt: skip
            for mult in mults:
                key = (side, task, mult, steps, seed)
                self.submit_learned(pool, "learned", key, task, single.run_job, task, side,
                                    steps, lr=mult, seed=seed,
                                    schedule=self.args.schedule)  # fmt: skip
        if grid:
            for lr in sorted(self.lrs[task, seed]):
                self.submit_adamw(pool, task, lr, [steps], seed)

    def learned_curve(self, side: str, task: str, mult: float, h: int,
                      seed: int) -> list[float] | None:  # fmt: skip
        """The learned side's curve at horizon ``h`` and ``seed``: its run of ``h`` steps, else
        (no schedule only) the first ``h`` steps of its longest run."""
        longest = [max(self.horizons(task))] if self.args.schedule == "constant" else []
        for steps in (h, *longest):
            curve = self.learned.get((side, task, mult, steps, seed))
            if curve is not None and len(curve) >= h:
                return curve[:h]
        return None

    def record(self, pool, ticket, future) -> None:
        kind, key, task = self.pending.pop(ticket)
        out = future.result()
        self.done += 1
        total = self.done + len(self.pending)
        if kind == "adamw":
            self.cache.get(key, lambda: out["curve"])
            what = f"AdamW {key.split('|', 2)[2]}: final {final_loss(out['curve']):.4g}"
            self.maybe_extend(pool, task, int(key.rsplit("|", 1)[1]))
        elif kind == "learned":
            self.learned[key] = out["curve"]
            what = f"{key[0]} x{key[2]:g} seed {key[4]}: final {final_loss(out['curve']):.4g}"
        elif kind == "timing":
            self.timing[key] = out["ms_per_step"]
            what = f"{key[0]} timing: " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in out["ms_per_step"].items()
            )
        elif kind == "dec_base":
            self.cache.get(key, lambda: out)
            what = "decentralized baselines tuned: " + ", ".join(
                f"{k} lr {out[k]['lr']:g} final {out[k]['final']:.4g}" for k in dec.BASELINES
            )
        else:
            self.dec_learned[key] = out
            what = f"{key[0]} decentralized: final {final_loss(out['curve']):.4g}"
        secs = f" ({out['seconds']} s)" if "seconds" in out else ""
        print(f"[{self.done}/{total}] {task} {what}{secs}", flush=True)


def assemble(suite, seconds: float) -> tuple[dict, dict]:
    """The JSON payload (the :func:`headline` summary at the top) and the plot panels."""
    singles, p1 = single_rows(suite)
    decs, p2 = decentralized_rows(suite)
    summaries = {side: summarise(side, singles, decs) for side in suite.sides}
    expected_single = len(suite.sides) * sum(len(suite.horizons(t)) for t in suite.tasks)
    expected_dec = len(suite.checkpoints) * len(suite.settings) // len(suite.seeds)
    complete = not suite.pending and len(singles) == expected_single and len(decs) == expected_dec
    payload = {
        "benchmark": "quality_heldout",
        "complete": complete,
        "quick": suite.args.quick,
        "sides": suite.sides,
        "summary": headline(suite.sides, singles, decs),
        "summaries": summaries,
        "targets": TARGETS,
        "single": singles,
        "decentralized": decs,
        "expected_rows": {"single": expected_single, "decentralized": expected_dec},
        "seeds": suite.seeds,  # of every row, single-worker and decentralized
        "timing_seed": 0,  # of the single-worker step times
        "adamw_grid": list(suite.grid),
        "lr_mults": list(single.LR_MULTS),
        "wall_seconds": round(seconds, 1),
    }
    return payload, {**p1, **p2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", nargs="*",
                        default=[DEFAULT_CHECKPOINT],
                        help="checkpoints (shipped names or paths) to evaluate (default: the "
                        "shipped rule)")  # fmt: skip
    parser.add_argument("--factory", nargs="*", default=[],
                        help="optimizer factories module:function, (params, lr_mult) -> opt")  # fmt: skip
    parser.add_argument("--tasks", nargs="*", default=None, help="default: every held-out task")
    parser.add_argument("--quick", action="store_true",
                        help="200 steps, 3 AdamW rates, 2 of the decentralized settings")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds of every row, single-worker and decentralized, each row "
                        "the median over them, its baselines tuned per seed (default "
                        f"{' '.join(map(str, DEC_SEEDS))}; --quick: the first)")  # fmt: skip
    parser.add_argument("--schedule", choices=single.RULE_SCHEDULES, default="constant",
                        help="the learned sides' schedule over each run (not constant: "
                        "single-worker rows only; see benchmarks.heldout_single.run)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=None, help="result name under benchmarks/results/")
    args = parser.parse_args(argv)
    sides = list(args.checkpoint) + list(args.factory)
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds repeats a seed: {args.seeds}")
    if not sides:
        parser.error("give at least one --checkpoint or --factory")
    unknown = sorted(set(args.tasks or []) - set(list_heldout_tasks()))
    if unknown:
        parser.error(f"unknown held-out tasks {unknown}; valid choices: {list_heldout_tasks()}")
    for side in args.factory:
        if not single.is_factory(side):
            parser.error(f"--factory takes module:function, got {side!r}")
    for side in sides:  # fail before any work: bad checkpoint file, unimportable factory
        single.resolve_side(side)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # what machine() records
    name = args.out or ("quality_heldout_quick" if args.quick else "quality_heldout")
    suite = Suite(args)
    start = time.perf_counter()
    command = command_line("python -m benchmarks.quality_heldout", argv)
    loads: list[float] = []  # the machine's load while measuring, for the record

    def snapshot(quiet: bool):
        loads.append(os.getloadavg()[0])
        payload, panels = assemble(suite, time.perf_counter() - start)
        payload.update(load_average=round(sum(loads) / len(loads), 1), command=command.strip(),
                       schedule=args.schedule)  # fmt: skip
        payload = {**payload, **machine()}
        write_json(name, payload, quiet=quiet)
        return payload, panels

    run_jobs(suite, args.jobs, lambda: snapshot(quiet=True))
    payload, panels = snapshot(quiet=False)
    curves_png(name, panels, ncols=5)
    s = payload["summary"]
    print(f"{s['side']}: median speedup single {s['median_speedup_single']}, decentralized "
          f"{s['median_speedup_decentralized']}, min {s['min_speedup']}, divergences "
          f"{s['divergences']}; {(time.perf_counter() - start) / 60:.1f} min")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
