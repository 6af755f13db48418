"""The benchmark suite: ``python -m benchmarks --list`` says what each entry point answers and
how long it takes; ``python -m benchmarks NAME [ARGS]`` runs one (its own ``--help`` lists
its arguments); ``python -m benchmarks --all`` (``make bench``) runs the CPU suite, then
regenerates the pages (``benchmarks/report.py``).

Each entry point writes one current result file under ``benchmarks/results/``, which the
results page and the README render. Durations are rough, on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Entry(NamedTuple):
    module: str
    question: str
    duration: str
    #: ``(flag, module, replacement)``: with ``flag`` the entry runs ``module`` instead,
    #: ``flag`` replaced by ``replacement`` (``None``: dropped).
    variant: tuple[str, str, str | None] | None = None


ENTRIES = {
    "heldout": Entry(
        "quality_heldout",
        "Does the shipped rule, untuned, beat tuned AdamW (one worker) and tuned D-SGD, D-Adam "
        "and DSGT (gossip) on jobs meta-training never saw? --anchors: the zero-tuning anchors "
        "(schedule-free AdamW, Prodigy, Muon) on the same rows.",
        "about 13 min with the committed baseline cache, 2 h cold; --anchors 25 min",
        ("--anchors", "heldout_anchors", None),
    ),
    "report_draw": Entry(
        "report_draw",
        "How does the shipped rule do against tuned AdamW and the zero-tuning anchors on a "
        "fixed reporting draw of the task distribution, overall and per kind of job (seeds "
        "that never chose anything)?",
        "grows with --draws (150 by default); tuned AdamW and the anchors are cached per "
        "draw, so a new rule runs only its own side",
    ),
    "decide": Entry(
        "decide",
        "Does rule A beat rule B? Both train the same freshly drawn jobs of the task "
        "distribution (seeds from the ledger, never drawn twice); the verdict reads the "
        "geometric mean's bootstrap interval, overall and per kind.",
        "grows with --draws: each draw trains both rules once",
    ),
    "step_cost": Entry(
        "step_overhead",
        "What does a step cost against AdamW, the optimizer step and the training step, on "
        "models from 0.5M to 10M parameters? --against REV: this checkout's step against "
        "another revision's, in turns in one process.",
        "about 15 min (--quick 3 min); --against 5 min",
        ("--against", "step_ab", "--base"),
    ),
    "cold_start": Entry(
        "wallclock",
        "How much sooner than tuned AdamW does a new process reach the loss level, the "
        "compile included?",
        "about 17 min",
    ),
    "gossip_step": Entry(
        "gossip_step",
        "What does one decentralized training step cost on local gloo workers, against "
        "all-reduce and Decent-DP?",
        "a few minutes",
    ),
    "local_steps": Entry(
        "local_steps",
        "On long runs, how many fewer bytes do local steps with one compressed outer step "
        "send, and at what loss, against exact per-step gossip? (local_steps_real K: one "
        "held-out setting on real gloo ranks)",
        "about 35 min on one thread (--quick seconds)",
    ),
    "robust": Entry(
        "robust_gossip",
        "Does robust mixing keep the honest ranks' loss when one neighbour attacks, and what "
        "does it cost when nobody does?",
        "about 2 min, plus the step timing",
    ),
    "stragglers": Entry(
        "stragglers",
        "What does one slow rank of 8 do to the others' throughput and to the model, with and "
        "without a step deadline?",
        "about 10 min (--quick 2 min)",
    ),
    "device": Entry(
        "cuda_check",
        "Does the CUDA path work on this GPU, and what do its steps cost?",
        "about 5 min on a GPU machine",
    ),
}

#: ``--all``: the CPU suite, in order (``make bench``), then the pages.
SUITE = (
    ["heldout", "--checkpoint", "adapt_init_2x", "--out", "quality_heldout"],
    ["heldout", "--checkpoint", "adapt_init_2x", "--schedule", "wsd_half",
     "--out", "quality_heldout_wsd_half"],
    ["heldout", "--anchors"],
    ["report_draw"],
    ["cold_start", "--suite", "heldout", "--repeats", "3"],
    ["step_cost"],
    ["gossip_step", "--rounds", "4"],
    ["local_steps"],
    ["robust"],
    ["stragglers"],
)  # fmt: skip


def listing() -> str:
    lines = []
    for name, e in ENTRIES.items():
        lines += [f"{name}  (benchmarks/{e.module}.py; {e.duration})", f"    {e.question}"]
    return "\n".join(lines)


def run(name: str, args: list[str]) -> None:
    """Run entry point ``name`` with ``args`` in this process, as ``python -m`` would."""
    entry = ENTRIES[name]
    module = entry.module
    if entry.variant and entry.variant[0] in args:
        flag, module, replacement = entry.variant
        i = args.index(flag)
        args = args[:i] + ([replacement] if replacement else []) + args[i + 1 :]
    sys.argv = [f"benchmarks/{module}.py", *args]
    runpy.run_module(f"benchmarks.{module}", run_name="__main__", alter_sys=True)


def run_all(dry_run: bool) -> int:
    total = time.perf_counter()
    for step in (*SUITE, None):
        cmd = ["benchmarks/report.py"] if step is None else ["-m", "benchmarks", *step]
        print(" ".join(["python", *cmd]), flush=True)
        if dry_run:
            continue
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT)
        if proc.returncode != 0:
            print(f"failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
    if not dry_run:
        print(f"all benchmarks done in {(time.perf_counter() - total) / 60:.1f} min")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ENTRIES:
        run(argv[0], argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="what each entry point answers")
    parser.add_argument("--all", action="store_true", help="run the CPU suite, then report.py")
    parser.add_argument("--dry-run", action="store_true", help="with --all: print, run nothing")
    args = parser.parse_args(argv)
    if args.all:
        return run_all(args.dry_run)
    print(listing() if args.list else parser.format_help())
    return 0


if __name__ == "__main__":
    sys.exit(main())
