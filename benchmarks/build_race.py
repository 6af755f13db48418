"""Training while the kernel builds: steps done over time with and without yielding a thread.

Run: ``python -m benchmarks.build_race`` (``--seconds``, ``--threads``). Writes
``benchmarks/results/build_race.json``.

While a kernel builds, a CPU training process steps and trains with
:data:`learned_opt.kernel.YIELD_THREADS` fewer intra-op threads, so that the build (a child
process at niceness 10) has a core of its own. This measures what that buys and costs: the
0.5M transformer of ``benchmarks/step_overhead.py`` trains for ``--seconds`` in a new
process with an empty compile cache (``TORCHINDUCTOR_CACHE_DIR`` a fresh temporary folder,
which holds the kernel folder), once with the shipped setting and once with
``YIELD_THREADS = 0``, one process at a time. Recorded for each: the steps done at
30, 60, 90, 120, 180, 240, 300, 420 and 600 s, and the second and step at which the
kernel was ready (None: not within the run). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import command_line, compile_env, machine, write_json

ROOT = Path(__file__).resolve().parents[1]
MARKS = (30, 60, 90, 120, 180, 240, 300, 420, 600)

_RUN = """
import json, sys, time, torch
from benchmarks.step_overhead import MODELS
from learned_opt import LearnedOptimizer, kernel
kernel.YIELD_THREADS = int(sys.argv[1])
seconds, marks = float(sys.argv[2]), [int(m) for m in sys.argv[3].split(",") if m]
torch.manual_seed(0)
model = MODELS["transformer-0.5M"]()
batch = model.batch(torch.Generator().manual_seed(0))
opt = LearnedOptimizer(model.parameters())
done, ready, steps, t0 = {}, None, 0, time.perf_counter()
while True:
    opt.zero_grad()
    model.loss(batch).backward()
    opt.step()
    steps += 1
    now = time.perf_counter() - t0
    if ready is None and opt.wait_compiled(timeout=0):
        ready = {"seconds": round(now, 1), "step": steps}
    while marks and now >= marks[0]:
        done[marks.pop(0)] = steps
    if now >= seconds:
        break
print(json.dumps({"kernel_ready": ready, "steps_at": done}))
"""


def run(yield_threads: int, seconds: float, threads: int) -> dict:
    """One training run in a new process with an empty compile cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = compile_env(cache, threads)
        marks = ",".join(str(m) for m in MARKS if m <= seconds)
        out = subprocess.run(
            [sys.executable, "-c", _RUN, str(yield_threads), str(seconds), marks], env=env,
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    from learned_opt.kernel import YIELD_THREADS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="training time of each run")
    ap.add_argument("--threads", type=int, default=2, help="the training's torch threads")
    ap.add_argument("--out", default="build_race")
    args = ap.parse_args(argv)
    start, load = time.perf_counter(), os.getloadavg()[0]
    runs = {}
    for name, value in ((f"yield {YIELD_THREADS} (shipped)", YIELD_THREADS), ("yield 0", 0)):
        runs[name] = run(value, args.seconds, args.threads)
        print(name, runs[name], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "build_race",
            "command": command_line("python -m benchmarks.build_race", argv),
            "workload": "transformer-0.5M",
            "threads": args.threads,
            "seconds": args.seconds,
            "load_average_before": load,
            "runs": runs,
            "wall_seconds": round(time.perf_counter() - start, 1),
            **machine(),
        },
    )


if __name__ == "__main__":
    main()
