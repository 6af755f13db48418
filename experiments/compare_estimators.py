"""Truncated backprop vs antithetic PES on the same wall-clock budget.

Runs ``meta_train/configs/default.yaml`` twice, side by side, once per estimator, each on
one CPU thread for the same ``--minutes``; then measures each result's validation (the
same tasks, horizon and tuned-Adam baselines as meta-training) and writes
``experiments/results/estimators.json``.

    python experiments/compare_estimators.py --minutes 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--out", default=str(RESULTS / "estimators.json"))
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    budget = time.strftime("%H:%M:%S", time.gmtime(args.minutes * 60))
    procs, dirs = {}, {}
    for name in ("tbptt", "pes"):
        dirs[name] = ROOT / "runs" / "estimators" / name
        cmd = [
            sys.executable, "-m", "learned_opt.meta_train.cli_entry", "fit",
            "--config", str(ROOT / "meta_train/configs/default.yaml"),
            f"--model.estimator={name}", f"--trainer.max_time=00:{budget}",
            "--trainer.val_check_interval=100000", f"--trainer.default_root_dir={dirs[name]}",
            "--trainer.enable_progress_bar=false",
        ]  # fmt: skip
        dirs[name].parent.mkdir(parents=True, exist_ok=True)
        log = open(dirs[name].with_suffix(".log"), "w")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"started {name}: log {dirs[name].with_suffix('.log')}", flush=True)
    results = {}
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{name} run failed; see {dirs[name].with_suffix('.log')}")
    from learned_opt.meta_train.cli import export

    for name in procs:
        last = sorted(dirs[name].glob("lightning_logs/version_*/checkpoints/last.ckpt"))[-1]
        out = export(str(last), str(dirs[name] / f"{name}.pt"))
        import torch

        card = torch.load(out, weights_only=True)["card"]
        results[name] = {
            "meta_steps": card["meta_steps"],
            "train_seconds": card["wall_time_s"],
            "median_speedup_adam": card["validation"]["median_speedup_adam"],
            "median_speedup_dadam": card["validation"]["median_speedup_dadam"],
            "single": card["validation"]["single"],
            "decentralized": card["validation"]["decentralized"],
        }
        print(
            name,
            json.dumps(
                {k: v for k, v in results[name].items() if "median" in k or k == "meta_steps"}
            ),
        )
    better = max(
        results,
        key=lambda k: results[k]["median_speedup_adam"] + results[k]["median_speedup_dadam"],
    )
    payload = {
        "budget_minutes_each": args.minutes,
        "threads_each": 1,
        "config": "meta_train/configs/default.yaml",
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
        "better": better,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2))
    print(f"better: {better}; wrote {args.out}")


if __name__ == "__main__":
    main()
