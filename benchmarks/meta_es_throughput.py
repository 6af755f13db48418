"""Meta-steps per hour of the es estimator at 1 and 2 processes (Lightning DDP, gloo on CPU).

Run: ``OMP_NUM_THREADS=1 python benchmarks/meta_es_throughput.py`` (``--steps``, ``--pairs``,
``--draws``, ``--horizon``, ``--processes``). Writes
``benchmarks/results/meta_es_throughput.json`` (``--out NAME``: ``NAME.json``).

Each process count runs ``learned-opt-meta fit --config es_smoke`` with the population and
draws given here (every kind of the task distribution), ``--trainer.devices N
--trainer.strategy ddp`` above one process, each process at one thread, validation off.
A meta-step's seconds are those rank 0 logs (``meta/seconds_per_step``): its own runs, the
gather (which waits for the slowest rank) and the outer step. The meta-steps differ in cost
(each draws its own jobs), and every count trains the same draws with the same population,
so meta-steps per hour are 3600 times the steps over their total seconds, the process start
excluded; the constants each count ends with must agree (``same_update``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks.common import command_line, machine, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _scalars(root: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = sorted(root.glob("lightning_logs/version_*"))[-1]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def _theta_c(root: Path) -> list[float]:
    ckpt = sorted(root.glob("lightning_logs/version_*/checkpoints/last.ckpt"))[-1]
    return torch.load(ckpt, weights_only=True)["state_dict"]["theta_c"].tolist()


def measure(processes: int, args, folder: Path) -> dict:
    root = folder / f"p{processes}"
    cmd = [
        sys.executable, "-m", "learned_opt.meta_train.cli_entry", "fit", "--config", "es_smoke",
        f"--trainer.default_root_dir={root}", f"--trainer.max_steps={args.steps}",
        "--trainer.limit_val_batches=0", f"--trainer.devices={processes}",
        f"--trainer.strategy={'ddp' if processes > 1 else 'auto'}",
        f"--model.es_pairs={args.pairs}", f"--model.es_draws={args.draws}",
        f"--model.es_horizon={args.horizon}", "--model.es_kinds=null",
    ]  # fmt: skip
    launcher = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    seconds = _scalars(root, "meta/seconds_per_step")
    balance = _scalars(root, "meta/es_rank_balance")
    return {
        "processes": processes,
        "step_seconds": [round(s, 2) for s in seconds],
        "median_step_seconds": round(statistics.median(seconds), 2),
        "meta_steps_per_hour": round(3600 * len(seconds) / sum(seconds), 1),
        "wall_seconds": round(wall, 1),
        # each step's mean over max of the ranks' seconds of runs (1: an even split)
        "rank_balance": [round(b, 3) for b in balance],
        "theta_c": _theta_c(root),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="meta-steps per process count")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--horizon", type=int, default=100, help="cap on a run's steps")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="meta_es_throughput", help="name under results/")
    args = parser.parse_args(argv)
    load = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for n in args.processes:
            rows.append(measure(n, args, Path(tmp)))
            print(f"{n} process(es): {rows[-1]['meta_steps_per_hour']} meta-steps/h "
                  f"(steps {rows[-1]['step_seconds']} s)", flush=True)  # fmt: skip
    one = rows[0]["meta_steps_per_hour"]
    result = {
        "machine": machine(),
        # other work on the cores: the loads before and after
        "load_average_1min": [load, round(os.getloadavg()[0], 2)],
        "command": command_line("OMP_NUM_THREADS=1 python benchmarks/meta_es_throughput.py", argv),
        "setting": {
            "pairs": args.pairs,
            "draws": args.draws,
            "horizon_cap": args.horizon,
            "steps": args.steps,
            "runs_per_step": args.draws * (2 * args.pairs + 1),
            "kinds": "every kind of the task distribution",
            "threads_per_process": 1,
        },  # fmt: skip
        "rows": [{k: v for k, v in r.items() if k != "theta_c"} for r in rows],
        "speedup_over_one_process": {
            str(r["processes"]): round(r["meta_steps_per_hour"] / one, 2) for r in rows
        },
        "same_update": all(
            torch.allclose(torch.tensor(r["theta_c"]), torch.tensor(rows[0]["theta_c"]))
            for r in rows
        ),
    }
    path = write_json(args.out, result)
    print(f"wrote {path}: {result['speedup_over_one_process']}")
    return result


if __name__ == "__main__":
    main()
