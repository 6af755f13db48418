"""``make bench``: the benchmark suite, then the generated pages (``report.py``).

Each step writes one result file under ``benchmarks/results/``, which the docs' results
page and the README show (see docs/benchmarks.md). Rough durations on 2 CPU cores:

- ``quality_heldout``: the held-out suite for the two shipped rules, every row over three
  seeds (about 70 min with the committed baseline cache, about 2 hours cold);
- ``quality_heldout --seeds 3 4``: the single-worker rule at two further seeds;
- ``quality_heldout --schedule wsd``: the single-worker rule with ``wsd_schedule``
  (about 25 min);
- ``heldout_anchors``: the zero-tuning anchors on the single-worker rows, three seeds
  (about 20 min);
- ``wallclock``: the held-out single-worker rows trained in new processes, the compile
  included (about 20 min);
- ``step_overhead``: step cost against AdamW (about 15 min);
- ``eager_step``: the eager reference step, with and without reading its mask (1 min);
- ``gossip_step``: one full decentralized step on local gloo workers (a few minutes);
- ``gossip_compression``: the compressed exchange, two partitions (about 15 min).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = [
    ["-m", "benchmarks.quality_heldout", "--checkpoint", "adapt_init_2x", "--out", "quality_heldout"],
    ["-m", "benchmarks.quality_heldout", "--checkpoint", "--factory", "benchmarks.heldout_single:shipped_default",
     "--seeds", "3", "4", "--out", "quality_heldout_seeds34"],
    ["-m", "benchmarks.quality_heldout", "--checkpoint", "adapt_init_2x", "--schedule", "wsd",
     "--out", "quality_heldout_wsd"],
    ["-m", "benchmarks.heldout_anchors"],
    ["-m", "benchmarks.wallclock", "--suite", "heldout"],
    ["benchmarks/step_overhead.py"],
    ["-m", "benchmarks.eager_step"],
    ["benchmarks/gossip_step.py", "--rounds", "4"],
    ["benchmarks/gossip_compression.py", "--partition", "dirichlet"],
    ["benchmarks/gossip_compression.py", "--partition", "iid", "--specs", "topk:0.01",
     "topk:0.04", "sign"],
    ["benchmarks/report.py"],
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    dry_run = parser.parse_args(argv).dry_run
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    total = time.perf_counter()
    for args in STEPS:
        if dry_run:
            print(" ".join(["python", *args]))
            continue
        start = time.perf_counter()
        print(f"== {' '.join(args)}", flush=True)
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env)
        if proc.returncode != 0:
            print(f"failed: {' '.join(args)} (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        print(f"== done in {time.perf_counter() - start:.0f} s", flush=True)
    if not dry_run:
        print(f"all benchmarks done in {(time.perf_counter() - total) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
