"""Wall-clock speedups with the compile included: each side trained in a fresh process.

For every single-worker row of the held-out suite's record, at seed 0, the rule and tuned
AdamW each train in a new process at one thread, recording after every step the seconds
since the optimizer was built; the speedup is the ratio of the seconds each needs to reach
the row's loss level. The *AdamW-paced* speedup is AdamW's seconds to the level over its
own seconds after the rule's number of steps. The rule's compile cache (``--cache``):
``machine``, one cache that each task's rule run filled beforehand, untimed (a machine that
has built before), or ``empty`` (the first model on the machine). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, command_line, commit, compile_env, machine, write_json

#: The recorded suites whose rows are timed, and the seed their step times are taken at.
SUITES = {"heldout": "quality_heldout.json"}
TIMING_SEED = 0
ROOT = Path(__file__).resolve().parents[1]


def child(spec: dict) -> dict:
    """One side's run in this (fresh) process: its loss curve, cumulative seconds, and the
    step after which the rule's kernel was ready (``None``: not within the run)."""
    import torch

    from benchmarks import heldout_single as single

    torch.set_num_threads(1)
    if spec.get("fill"):  # build every kind of tensor the run steps, however short the run
        import learned_opt.kernel

        learned_opt.kernel.COMPILE_AFTER_SECONDS = 0
    built = []
    if spec["side"] == "adamw":
        base = single.adamw(spec["lr"])
    else:
        base = single.resolve_side(spec["side"])

    def factory(params, lr_mult=1.0):
        built.append(base(params, lr_mult))
        return built[-1]

    class Clock(list):  # also notes the first step after which the kernel was ready
        ready_step = None

        def append(self, seconds):
            super().append(seconds)
            opt = built[0]
            if self.ready_step is None and hasattr(opt, "wait_compiled"):
                if opt.wait_compiled(timeout=0):
                    self.ready_step = len(self)

    clock = Clock()
    curve = single.run(spec["task"], factory, spec["steps"], schedule=spec["schedule"],
                       seed=TIMING_SEED, clock=clock)  # fmt: skip
    if spec.get("fill") and hasattr(built[0], "wait_compiled"):
        built[0].wait_compiled(timeout=1800)  # fill the cache: exiting would stop the compile
    return {"curve": curve, "seconds": [round(s, 5) for s in clock],
            "ready_step": clock.ready_step}  # fmt: skip


def run_fresh(spec: dict, cache: str) -> dict:
    """:func:`child` in a new interpreter (one thread, compiling on, inductor cache
    ``cache``)."""
    env = compile_env(cache, 1)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.wallclock", "--child", json.dumps(spec)],
        env=env, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{spec['task']} ({spec['side']}) failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows_of(suite: str, tasks: list[str] | None) -> list[dict]:
    """The single-worker rows of the recorded suite, with tuned AdamW at the timing seed and
    the recorded speedups."""
    recorded = json.loads((RESULTS / SUITES[suite]).read_text())
    out = []
    for r in recorded["single"]:
        if tasks and r["task"] not in tasks:
            continue
        out.append({
            "task": r["task"], "horizon": r["horizon"], "side": r["side"],
            "adamw": r["adamw_by_seed"][TIMING_SEED], "recorded_speedup": r["speedup"],
            "recorded_wall_speedup": r.get("wall_speedup"),
        })  # fmt: skip
    return out


def score(row: dict, rule: dict, adamw: dict) -> dict:
    """The row's speedups from the two fresh-process runs (0 where a run diverged, as the
    suites' step speedups)."""
    from learned_opt.meta_train.evaluation import steps_to_common_level

    h = row["horizon"]
    steps = steps_to_common_level(rule["curve"][:h], adamw["curve"][:h])
    if steps is None:  # a side diverged: no common level
        n_rule = n_adamw = t_rule = t_adamw = None
        step_speedup = wall_speedup = paced = 0.0
    else:  # the seconds until the end of each side's step at the level
        n_rule, n_adamw = steps
        t_rule, t_adamw = rule["seconds"][n_rule - 1], adamw["seconds"][n_adamw - 1]
        step_speedup, wall_speedup = round(n_adamw / n_rule, 4), round(t_adamw / t_rule, 4)
        # the rule's steps at AdamW's cost: AdamW's own clock after the rule's step count
        # (None where AdamW's run ended, non-finite, before that many steps)
        clock = adamw["seconds"]
        paced = round(t_adamw / clock[n_rule - 1], 4) if n_rule <= len(clock) else None
        t_rule, t_adamw = round(t_rule, 3), round(t_adamw, 3)
    return {
        "task": row["task"], "horizon": h, "side": row["side"], "adamw": row["adamw"],
        "steps_rule": n_rule, "steps_adamw": n_adamw, "speedup": step_speedup,
        "seconds_rule": t_rule, "seconds_adamw": t_adamw, "wall_speedup": wall_speedup,
        "adamw_paced_wall_speedup": paced,
        "first_step_seconds": rule["seconds"][0],
        "kernel_ready_step": rule["ready_step"],
        **({"kernel_ready_steps": rule["ready_steps"]}
           if len(rule.get("ready_steps", ())) > 1 else {}),  # fmt: skip
        "recorded_speedup": row["recorded_speedup"],
        "recorded_wall_speedup": row["recorded_wall_speedup"],
    }  # fmt: skip


def run_keys(row: dict) -> tuple[tuple, tuple]:
    """The row's two runs: the rule's (one per task, held multiplier) and AdamW's (one per
    rate and schedule; a cosine run belongs to its horizon)."""
    a = row["adamw"]
    horizon = None if a["schedule"] == "constant" else row["horizon"]
    rule = ("rule", row["task"], row["side"])
    return rule, ("adamw", row["task"], a["lr"], a["schedule"], horizon)


def median_run(runs: list[dict]) -> dict:
    """One side's repeated runs as one: the first run's loss curve, at every step the median
    of the runs' seconds, and the earliest step after which a run had its kernel."""
    ready = [r["ready_step"] for r in runs]
    seconds = [statistics.median(s) for s in zip(*(r["seconds"] for r in runs))]
    return {"curve": runs[0]["curve"], "seconds": seconds,
            "ready_step": min((x for x in ready if x is not None), default=None),
            "ready_steps": ready}  # fmt: skip


def measure(rows: list[dict], log=print, repeats: int = 1, cache: str = "machine") -> list[dict]:
    """Run every row's two sides in fresh processes and score them: a task's rule once, to
    its longest horizon, AdamW once per rate and schedule; with ``repeats`` every run is
    repeated, the repeats taking turns, each side timed by :func:`median_run`. ``cache``:
    see the module."""
    runs: dict[tuple, dict] = {}

    def need(key: tuple, steps: int) -> None:
        runs[key] = {"steps": max(steps, runs.get(key, {}).get("steps", 0)), "runs": []}

    for r in rows:
        for key in run_keys(r):
            need(key, r["horizon"])
    with tempfile.TemporaryDirectory() as root:
        machine_cache = tempfile.mkdtemp(dir=root)
        for key, job in runs.items() if cache == "machine" else ():
            if key[0] == "rule":  # fill the machine's cache, untimed
                start = time.perf_counter()
                spec = {"task": key[1], "side": key[2], "schedule": "constant", "fill": True}
                run_fresh({**spec, "steps": job["steps"]}, machine_cache)
                log(f"  filled the compile cache with {key[1]}'s rule run in "
                    f"{time.perf_counter() - start:.1f} s")  # fmt: skip
        for repeat in range(repeats):
            for key, job in runs.items():
                if key[0] == "rule":
                    spec = {"task": key[1], "side": key[2], "schedule": "constant"}
                else:
                    spec = {"task": key[1], "side": "adamw", "lr": key[2], "schedule": key[3]}
                start = time.perf_counter()
                folder = tempfile.mkdtemp(dir=root)  # each run its own copy: none sees another's
                if key[0] == "rule" and cache == "machine":
                    shutil.copytree(machine_cache, folder, dirs_exist_ok=True)
                job["runs"].append(run_fresh({**spec, "steps": job["steps"]}, folder))
                log(f"  [{repeat + 1}/{repeats}] {key}: {job['steps']} steps in "
                    f"{time.perf_counter() - start:.1f} s (kernel ready after step "
                    f"{job['runs'][-1].get('ready_step')})")  # fmt: skip
    merged = {key: median_run(job["runs"]) for key, job in runs.items()}
    return [score(r, *(merged[key] for key in run_keys(r))) for r in rows]


def summarise(scored: list[dict]) -> dict:
    def med(key):
        return round(statistics.median(s[key] for s in scored), 4) if scored else None

    paced = [s["adamw_paced_wall_speedup"] for s in scored
             if s.get("adamw_paced_wall_speedup") is not None]  # fmt: skip
    return {"median_speedup": med("speedup"), "median_wall_speedup": med("wall_speedup"),
            "median_recorded_wall_speedup": med("recorded_wall_speedup"),
            "median_adamw_paced_wall_speedup":
                round(statistics.median(paced), 4) if paced else None,
            "rows": len(scored)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="heldout")
    parser.add_argument("--tasks", nargs="*", help="only these tasks (default: all rows)")
    parser.add_argument(
        "--repeats", type=int, default=1, metavar="N",
        help="run every side N times, taking turns, and time it by the median (default 1)",
    )  # fmt: skip
    parser.add_argument("--cache", choices=("machine", "empty"), default="machine",
                        help="the rule's compile cache: filled once beforehand (a machine that "
                        "has built before; the default) or empty (see the module)")  # fmt: skip
    parser.add_argument("--out", help="result name (default: wallclock_<suite>)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    rows = rows_of(args.suite, args.tasks)
    if not rows:
        parser.error(f"no rows of {SUITES[args.suite]} match --tasks {args.tasks}")
    start = time.perf_counter()
    print(f"wallclock: {len(rows)} rows of {SUITES[args.suite]}, one fresh process per side")
    scored = measure(rows, repeats=args.repeats, cache=args.cache)
    import torch

    from learned_opt import kernel

    payload = {
        "benchmark": "wallclock", "suite": args.suite, "source": SUITES[args.suite],
        "cache": args.cache, "threads": 1,
        "kernel_route": "aot_package",  # built by a child, loaded by the training process
        "compile_after_seconds": kernel.COMPILE_AFTER_SECONDS,
        "timing_seed": TIMING_SEED, "repeats": args.repeats, "rows": scored,
        "summary": summarise(scored),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": command_line("python -m benchmarks.wallclock", argv),
        **machine(), "torch": torch.__version__, "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    path = write_json(args.out or f"wallclock_{args.suite}", payload)
    s = payload["summary"]
    print(f"median step speedup {s['median_speedup']}x, compile-included wall-clock "
          f"{s['median_wall_speedup']}x (recorded steady-state {s['median_recorded_wall_speedup']}x)"
          f" -> {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
