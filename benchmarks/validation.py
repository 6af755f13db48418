"""Validation benchmark: a rule on the validation family, where every choice about it is made.

Single worker: every problem of :data:`learned_opt.tasks.validation.SINGLE_PROBLEMS` (a
task and a horizon) against AdamW tuned per problem and seed over 6 learning rates
(extended at an edge) x constant/cosine, the way the held-out suite tunes it
(:mod:`benchmarks.heldout_single`), and beside the zero-tuning anchors
(:mod:`benchmarks.validation_anchors`: schedule-free AdamW, Prodigy constant and cosine,
Muon with AdamW). Speedups by step count (steps tuned AdamW needs to reach a loss level /
steps the side needs, :func:`learned_opt.meta_train.evaluation.speedup`) and by wall clock
(the step speedup times the ratio of step times measured side by side at seed 0, optimizer
included); a run *diverged* if its loss went non-finite or ended above where it started.
A row is the median over the seeds; the summary splits small problems (at most 300 steps)
from runs of 1000 steps or more.

The rule is ``--checkpoint NAME`` (a shipped name or a path) or ``--side
label=checkpoint:field=value,...`` with :class:`~learned_opt.config.NetConfig` fields
replaced (a value is a number, or a name for a field that takes one, such as
``output=adam``). Tuned baselines and anchor runs are cached in
``benchmarks/results/validation_baselines.json.gz``, so a rerun only runs the rule.
Writes ``benchmarks/results/validation.json`` (``--quick``: ``validation_quick.json``),
rewritten as results come in.

    python -m benchmarks.validation --checkpoint adapt_init_2x --jobs 1
    python -m benchmarks.validation --side e3=adapt_init_2x:lr_adapt_max_ortho=3 --quick
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from benchmarks import heldout_single as single
from benchmarks import rules
from benchmarks import validation_anchors as anchors
from benchmarks.common import RESULTS, Cache, command_line, machine, write_json
from benchmarks.job_queue import AdamWGrid, run_jobs
from learned_opt import LearnedOptimizer, load_checkpoint
from learned_opt.meta_train.evaluation import final_loss, speedup
from learned_opt.network import with_config
from learned_opt.tasks.validation import SINGLE_PROBLEMS

CACHE = RESULTS / "validation_baselines.json.gz"
SEEDS = (0, 1, 2)  # a row is the median over them; one seed moved rows by up to 10x
SHORT, LONG = 300, 1000  # the summary's small problems (up to SHORT steps) and long runs
#: The issue's targets, recorded beside the measured summary.
TARGETS = {"min_speedup": ">= 0.9", "median_speedup_short": ">= 1.3",
           "median_speedup_long": ">= 1.3", "divergences": "0"}  # fmt: skip


def r4(x):
    return None if x is None else round(float(x), 4)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return r4(statistics.median(xs)) if xs else None


# ----------------------------------------------------------------------------- scores
def score_seed(best: dict, learned: list[float], anchor_curves: dict, ms: dict | None) -> dict:
    """One seed of a problem: the rule's and each anchor's step speedup over the tuned
    AdamW run ``best`` (:func:`single.best_adamw`), finals, divergence and, with the
    step times ``ms``, wall-clock speedups (the step speedup times AdamW's ms per step
    over the optimizer's)."""

    def one(curve, name):
        out = {"speedup": speedup(curve, best["curve"]), "final": final_loss(curve),
               "diverged": single.diverged(curve)}  # fmt: skip
        if ms:
            out["wall_speedup"] = out["speedup"] * ms["adamw"] / ms[name]
        return out

    return {"learned": one(learned, "learned"),
            "anchors": {a: one(c, a) for a, c in anchor_curves.items()}}  # fmt: skip


def merge(scored: list[dict]) -> dict:
    """Per-seed scores of one optimizer as one: median speedups, any divergence, the
    first seed's final loss, and the per-seed step speedups."""
    out = {"speedup": r4(statistics.median(x["speedup"] for x in scored)),
           "speedup_by_seed": [r4(x["speedup"]) for x in scored],
           "final": r4(scored[0]["final"]), "diverged": any(x["diverged"] for x in scored)}  # fmt: skip
    if all("wall_speedup" in x for x in scored):
        out["wall_speedup"] = r4(statistics.median(x["wall_speedup"] for x in scored))
    return out


def summarise(rows: list[dict]) -> dict:
    """The issue's criteria on the validation family, and each anchor's median."""
    sp = [r["learned"]["speedup"] for r in rows]
    by_h = lambda keep: [r["learned"]["speedup"] for r in rows if keep(r["horizon"])]  # noqa: E731
    names = sorted({a for r in rows for a in r["anchors"]})
    anchor = lambda a, key: [r["anchors"][a][key] for r in rows if a in r["anchors"]]  # noqa: E731
    return {
        "median_speedup": _median(sp),
        "median_speedup_short": _median(by_h(lambda h: h <= SHORT)),
        "median_speedup_long": _median(by_h(lambda h: h >= LONG)),
        "min_speedup": min(sp) if sp else None,
        "rows_below_0.9": [f"{r['task']}@{r['horizon']}" for r in rows
                           if r["learned"]["speedup"] < 0.9],  # fmt: skip
        "divergences": sum(r["learned"]["diverged"] for r in rows),
        "median_wall_speedup": _median([r["learned"].get("wall_speedup") for r in rows]),
        "anchors_median_speedup": {a: _median(anchor(a, "speedup")) for a in names},
        "anchors_divergences": {a: sum(anchor(a, "diverged")) for a in names},
        "single_rows": len(rows),
    }  # fmt: skip


# ----------------------------------------------------------------------------- jobs
def parse_side(text: str) -> tuple[str, str, dict]:
    """``label=checkpoint[:field=value,...]`` (a bare ``checkpoint`` is its own label) ->
    ``(label, checkpoint, fields)``, the values read by :func:`benchmarks.rules.parse_side`."""
    label, eq, rest = text.partition("=")
    checkpoint, fields = rules.parse_side(rest if eq else text)
    return (label if eq else checkpoint), checkpoint, fields


def side_factory(checkpoint: str, fields: dict) -> single.Factory:
    """The rule as a factory ``(params, lr_mult) -> LearnedOptimizer``: the checkpoint, its
    config's ``fields`` replaced."""
    if not fields:
        return single.resolve_side(checkpoint)
    replaced = with_config(load_checkpoint(checkpoint)[0], fields)
    return lambda params, lr_mult=1.0: LearnedOptimizer(params, net=replaced, lr=lr_mult)


def typed_fields(checkpoint: str, fields: dict) -> dict:
    """``fields`` (parsed as floats) with whole numbers made ``int`` where the checkpoint's
    config holds an ``int`` (``ns_steps=3`` must not become ``3.0``)."""
    net = load_checkpoint(checkpoint)[0]
    out = {}
    for key, value in fields.items():
        current = getattr(net.config, key, getattr(net.mixing, key, None))
        if current is not None and isinstance(value, str) != isinstance(current, str):
            kind = "a name" if isinstance(current, str) else "a number"
            raise ValueError(f"field {key}={value!r}: {checkpoint}'s {key} takes {kind}")
        whole = isinstance(current, int) and not isinstance(current, bool)
        out[key] = int(value) if whole and float(value).is_integer() else value
    return out


def learned_job(task: str, side: tuple, steps: int, seed: int, schedule: str = "constant") -> dict:
    """The rule's run (multiplier 1) of ``steps`` steps at ``seed``, its learning rate
    held (``"constant"``) or annealed to 0 over the run (``"cosine"``, ``"wsd"``: see
    :func:`benchmarks.heldout_single.run`)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    factory = side_factory(side[1], side[2])
    curve = single.run(task, factory, steps, seed=seed, schedule=schedule)
    return {"curve": curve, "seconds": round(time.perf_counter() - start, 1)}


def timing_job(task: str, side: tuple, steps: int) -> dict:
    """Median ms per training step of AdamW, the rule and every anchor, side by side."""
    torch.set_num_threads(1)
    factories = {"adamw": single.adamw(1e-3), "learned": side_factory(side[1], side[2])}
    found = anchors.factories(task, steps)
    factories.update((a, found[a]) for a in ("schedulefree_adamw", "prodigy_constant",
                                             "muon_adamw"))  # fmt: skip
    ms = single.time_side_by_side(task, factories)
    ms["prodigy_cosine"] = ms["prodigy_constant"]  # the same step
    return {"ms_per_step": ms}


def anchor_key(task, anchor, steps, seed) -> str:
    return f"anchor|{task}|{anchor}|{steps}|{seed}|{anchors.versions()}"


def commit() -> str:
    """The checkout's commit, with "+dirty" when the rule's code has uncommitted changes
    (the files :func:`single.code_hash` reads are the ones that count)."""
    root = RESULTS.parents[1]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)  # noqa: E731
    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "learned_opt", "distributed", "meta_train/inner.py")
    return head + ("+dirty" if dirty.stdout.strip() else "")


# ----------------------------------------------------------------------------- the run
class Run(AdamWGrid):
    """The jobs of one invocation, their results and the baseline cache (AdamW's grid per
    task and seed, over the task's problems' horizons: :class:`AdamWGrid`)."""

    def __init__(self, args, side: tuple):
        self.args, self.side = args, side
        self.cache = Cache(CACHE)
        wanted = lambda task: not args.problems or task in args.problems  # noqa: E731
        self.problems = [(t, h, k) for t, h, k in SINGLE_PROBLEMS
                         if wanted(t) and (not args.quick or h <= 500)]  # fmt: skip
        self.seeds = list(args.seeds or (SEEDS[:1] if args.quick else SEEDS))
        self.grid = single.QUICK_GRID if args.quick else single.ADAMW_GRID
        self.lrs = {(t, s): set(self.grid) for t, _, _ in self.problems for s in self.seeds}
        self.extensions = dict.fromkeys(self.lrs, 0)
        self.learned: dict = {}  # (task, horizon, seed) -> curve
        self.timing: dict = {}  # task -> ms per step by optimizer
        self.pending: dict = {}  # ticket -> (kind, key)
        self.failed: list[str] = []  # jobs that raised, one line each

    def horizons(self, task: str) -> list[int]:
        return sorted({h for t, h, _ in self.problems if t == task})

    def submit(self, pool, kind: str, key, task: str, fn, *args) -> None:
        self.pending[pool.submit(fn, *args)] = (kind, key, task)

    # ------------------------------------------------------------------ scheduling
    def submit_problem(self, pool, task: str, h: int, seed: int) -> None:
        args = (task, self.side, h, seed, self.args.schedule)
        self.submit(pool, "learned", (task, h, seed), task, learned_job, *args)
        for lr in sorted(self.lrs[task, seed]):
            self.submit_adamw(pool, task, lr, [h], seed)
        for a in anchors.ANCHORS:
            key = anchor_key(task, a, h, seed)
            if key not in self.cache.data:
                self.submit(pool, "anchor", key, task, anchors.run_anchor, task, a, h, seed)
        if seed == self.seeds[0] and task not in self.timing:
            self.timing[task] = None
            self.submit(pool, "timing", task, task, timing_job, task, self.side, h)

    def submit_all(self, pool) -> None:
        """Seed by seed, the shortest problems first, so that a run stopped early holds
        whole rows."""
        for seed in self.seeds:
            for task, h, _ in sorted(self.problems, key=lambda p: p[1]):
                self.submit_problem(pool, task, h, seed)
        for key in self.lrs:
            self.maybe_extend(pool, *key)  # whole grids already cached

    def record(self, pool, ticket, future) -> None:
        kind, key, task = self.pending.pop(ticket)
        try:
            out = future.result()
        except Exception as exc:  # one broken job must not lose the others' hours
            self.failed.append(f"{kind} {key}: {type(exc).__name__}: {str(exc)[:200]}")
            print(f"[{len(self.pending)} left] FAILED {self.failed[-1]}", flush=True)
            return
        if kind in ("adamw", "anchor"):
            self.cache.get(key, lambda: out["curve"])
            if kind == "adamw":
                self.maybe_extend(pool, task, int(key.rsplit("|", 1)[1]))
        elif kind == "learned":
            self.learned[key] = out["curve"]
        else:
            self.timing[key] = out["ms_per_step"]
        print(f"[{len(self.pending)} left] {kind} {key}"
              + (f" ({out['seconds']} s)" if "seconds" in out else ""), flush=True)  # fmt: skip

    # ------------------------------------------------------------------ result
    def single_rows(self) -> list[dict]:
        rows = []
        for task, h, kind in self.problems:
            bests, scored = [], []
            for seed in self.seeds:
                curves = {
                    a: self.cache.data.get(anchor_key(task, a, h, seed)) for a in anchors.ANCHORS
                }
                learned = self.learned.get((task, h, seed))
                if (
                    not self.grid_complete(task, h, seed)
                    or learned is None
                    or None in curves.values()
                ):
                    break
                bests.append(single.best_adamw(self.adamw_runs(task, seed), h))
                scored.append(score_seed(bests[-1], learned, curves, self.timing.get(task)))
            if len(scored) < len(self.seeds):
                continue
            a = bests[0]
            rows.append({
                "task": task, "horizon": h, "kind": kind,
                "adamw": {"lr": a["lr"], "schedule": a["schedule"], "final": r4(a["final"]),
                          "grid": {k: r4(v) for k, v in a["grid"].items()}},
                "adamw_by_seed": [{"lr": b["lr"], "schedule": b["schedule"]} for b in bests],
                "learned": merge([x["learned"] for x in scored]),
                "anchors": {n: merge([x["anchors"][n] for x in scored]) for n in anchors.ANCHORS},
                "ms_per_step": self.timing.get(task),
            })  # fmt: skip
        return rows

    def payload(self, seconds: float, command: str) -> dict:
        singles = self.single_rows()
        complete = len(singles) == len(self.problems) and not self.failed
        label, checkpoint, fields = self.side
        return {
            "benchmark": "validation", "complete": complete, "quick": self.args.quick,
            "side": {"label": label, "checkpoint": checkpoint, "fields": fields},
            "schedule": self.args.schedule,
            "summary": summarise(singles), "targets": TARGETS,
            "single": singles, "seeds": self.seeds,
            "adamw_grid": list(self.grid), "anchors": list(anchors.ANCHORS),
            "anchor_versions": anchors.versions(), "timing_seed": self.seeds[0],
            "failed_jobs": self.failed, "code_hash": single.code_hash(), "commit": commit(),
            "wall_seconds": round(seconds, 1), "command": command, **machine(),
        }  # fmt: skip


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rule = parser.add_mutually_exclusive_group(required=True)
    rule.add_argument("--checkpoint", help="a shipped checkpoint name or a path")
    rule.add_argument("--side", type=parse_side, help="label=checkpoint:field=value,...")
    parser.add_argument("--quick", action="store_true",
                        help="problems of up to 500 steps, 3 AdamW rates, one seed")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"seeds of every row (default {' '.join(map(str, SEEDS))})")  # fmt: skip
    parser.add_argument("--problems", nargs="*", help="only these validation tasks")
    parser.add_argument("--schedule", choices=single.RULE_SCHEDULES, default="constant",
                        help="the rule's learning-rate schedule over each run (cosine: "
                        "torch's CosineAnnealingLR to 0 at the horizon; wsd: held, then "
                        "linear to 0 over the last fifth; wsd_half: over the last half)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", default=None, help="result name under benchmarks/results/")
    return parser


def execute(args, side: tuple, command: str, name: str | None = None) -> dict:
    """Run the side's jobs (cached baselines skipped); the payload, also written to
    ``results/NAME.json`` as results come in when ``name`` is given."""
    run = Run(args, side)
    start = time.perf_counter()

    def snapshot() -> None:
        if name:
            write_json(name, run.payload(time.perf_counter() - start, command), quiet=True)

    run_jobs(run, args.jobs, snapshot)
    return run.payload(time.perf_counter() - start, command)


def checked_side(parser: argparse.ArgumentParser, args) -> tuple:
    """``(label, checkpoint, typed fields)`` of the parsed ``--checkpoint``/``--side``."""
    side = args.side or (args.checkpoint, args.checkpoint, {})
    try:
        side = (side[0], side[1], typed_fields(side[1], side[2]))
        side_factory(side[1], side[2])
    except (TypeError, ValueError, OSError) as exc:
        parser.error(f"side {side[0]!r}: {exc}")
    return side


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    side = checked_side(parser, args)
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds repeats a seed: {args.seeds}")
    known = {t for t, _, _ in SINGLE_PROBLEMS}
    if set(args.problems or ()) - known:
        parser.error(
            f"unknown problems {sorted(set(args.problems) - known)}; valid: {sorted(known)}"
        )
    name = args.out or ("validation_quick" if args.quick else "validation")
    command = command_line("python -m benchmarks.validation", argv)
    payload = execute(args, side, command, name)
    write_json(name, payload)
    s = payload["summary"]
    print(f"{side[0]}: median {s['median_speedup']} (short {s['median_speedup_short']}, long "
          f"{s['median_speedup_long']}), min {s['min_speedup']}, divergences {s['divergences']}; "
          f"anchors {s['anchors_median_speedup']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
