"""``make bench``: run every benchmark, then regenerate the README's result sections.

Order and rough duration on 2 CPU cores (measured 2026-11-29):
step_overhead (~2 min), gossip_throughput (~2 min), gossip_step (~1 min),
gossip_compression (~8 min per partition, loaded machine), meta_train_throughput (~2 min),
quality_single (~25 min), quality_decentralized (~15 min), quality_heldout (the held-out
suite, the README's headline table, every row over three seeds, the two shipped rules:
about 70 min with the committed baseline cache, learned runs only; about 2 hours cold),
then report.py.
``compare_estimators.py`` (about 15 minutes) is not part of it: run it on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = [
    ["benchmarks/step_overhead.py"],
    ["benchmarks/gossip_throughput.py"],
    ["benchmarks/gossip_step.py"],
    ["benchmarks/gossip_compression.py", "--partition", "dirichlet"],
    [
        "benchmarks/gossip_compression.py",
        "--partition",
        "iid",
        "--specs",
        "topk:0.01",
        "topk:0.04",
        "sign",
    ],
    ["-m", "benchmarks.meta_train_throughput"],
    ["-m", "benchmarks.quality_single"],
    ["-m", "benchmarks.quality_decentralized"],
    [
        "-m",
        "benchmarks.quality_heldout",
        "--checkpoint",
        "adapt_init_2x",
        "gossip_adapt",
        "--record-cards",
    ],
    ["benchmarks/report.py"],
]


def main() -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    total = time.perf_counter()
    for args in STEPS:
        start = time.perf_counter()
        print(f"== {' '.join(args)}", flush=True)
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env)
        if proc.returncode != 0:
            print(f"failed: {' '.join(args)} (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        print(f"== done in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"all benchmarks done in {(time.perf_counter() - total) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
