"""Time ``LearnedOptimizer.step()`` against ``torch.optim.AdamW`` on realistic models.

Workloads: :data:`~benchmarks.speed_common.MODELS` (optimizer and training step) and
:data:`~benchmarks.speed_common.SHAPES` (random gradients, optimizer step), each optimizer on
its own copy, taking turns. Also the start of a new process with an empty cache
(``cold_start``), and :data:`CONTENDED` again beside two busy processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from learned_opt import LearnedOptimizer

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # after the laid-out package
from benchmarks.common import command_line, compile_env  # noqa: E402
from benchmarks.speed_common import (  # noqa: E402
    MODELS,
    PERIOD,
    SHAPES,
    compile_kernels,
    make_params,
    muon_adamw,
    time_turns,
    transformer_shapes,
)

RESULTS = Path(__file__).parent / "results" / "step_overhead.json"
THREADS = 2
QUICK = ["transformer-0.5M", "convnet-bn", "shapes-10M"]
#: workloads measured again with two busy background processes
CONTENDED = ["transformer-0.5M", "shapes-10M"]
#: workloads where the eager reference is not timed (a step takes seconds)
NO_EAGER = ["shapes-100M"]


def optimizers(params_of, eager: bool = True) -> dict:
    """Every optimizer compared, each on its own copy of the parameters (see the module)."""
    opts = {"adamw_foreach": torch.optim.AdamW(params_of(), lr=1e-3, foreach=True)}
    opts["learned_default"] = LearnedOptimizer(params_of())
    if eager:
        opts["learned_reference"] = LearnedOptimizer(params_of(), compile=False)
    opts["muon_adamw"] = muon_adamw(params_of(), opts["learned_default"].config)
    return opts


def workload(name: str):
    """``(params, tensors, steps)``: per optimizer a callable timing one step of it."""
    if name in SHAPES:
        shapes = transformer_shapes(*SHAPES[name])
        opts = optimizers(lambda: make_params(shapes), eager=name not in NO_EAGER)

        def opt_step(opt):
            def run():
                t0 = time.perf_counter()
                opt.step()
                return {"step": time.perf_counter() - t0}

            return run

        n = sum(torch.Size(s).numel() for s in shapes)
        return n, len(shapes), opts, {k: opt_step(o) for k, o in opts.items()}
    models = {}

    def params_of():
        torch.manual_seed(0)
        model = MODELS[name]()
        models[len(models)] = model
        return model.parameters()

    opts = optimizers(params_of)
    gen = torch.Generator().manual_seed(0)
    batches = [models[0].batch(gen) for _ in range(4)]

    def train_step(model, opt):
        count = iter(range(1 << 30))

        def run():
            t0 = time.perf_counter()
            opt.zero_grad()
            model.loss(batches[next(count) % len(batches)]).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            return {"step": t2 - t1, "train": t2 - t0}

        return run

    model = models[0]
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    steps = {k: train_step(models[i], o) for i, (k, o) in enumerate(opts.items())}
    return n, tensors, opts, steps


def measure(names, warmup, repeats, label="", rows=None, save=None):
    """Measure ``names``; append each row to ``rows`` and call ``save()`` after each."""
    rows = [] if rows is None else rows
    for name in names:
        n, tensors, opts, steps = workload(name)
        waited = compile_kernels(steps, opts)
        ms = time_turns(steps, warmup, repeats)
        base = ms["adamw_foreach"]
        row = {"workload": name, "params": n, "tensors": tensors, "load": label}
        row["threads"] = torch.get_num_threads()
        for opt, t in ms.items():
            row[f"{opt}_step_ms"] = round(t["step"], 2)
            if "train" in t:
                row[f"{opt}_train_ms"] = round(t["train"], 2)
            if opt != "adamw_foreach":
                row[f"{opt}_step_ratio"] = round(t["step"] / base["step"], 2)
                if "train" in t:
                    row[f"{opt}_train_ratio"] = round(t["train"] / base["train"], 2)
        row["compile_wait_seconds"] = waited
        rows.append(row)
        print_row(row)
        if save is not None:
            save()
        del steps, opts
    return rows


def median_row(block_rows: list[dict]) -> dict:
    """One row from the rows of several blocks of the same workload: each time and ratio
    the median over the blocks, and each block's step ratio under ``blocks``."""
    row = dict(block_rows[0])
    for key, value in row.items():
        if key.endswith(("_ms", "_ratio")) and isinstance(value, float):
            row[key] = round(statistics.median(r[key] for r in block_rows), 2)
    row["blocks"] = [r["learned_default_step_ratio"] for r in block_rows]
    return row


def busy_processes(count: int = 2) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


#: Run in a fresh process by :func:`cold_start`: the shipped rule on the 0.5M transformer,
#: training steps until its kernel is compiled.
_COLD_START = """
import time, torch
t_import = time.perf_counter()
from benchmarks.speed_common import MODELS
from learned_opt import LearnedOptimizer
torch.manual_seed(0)
model = MODELS["transformer-0.5M"]()
batch = model.batch(torch.Generator().manual_seed(0))
opt = LearnedOptimizer(model.parameters())
times, t0, first_kernel = [], time.perf_counter(), None
while True:
    t = time.perf_counter()
    opt.zero_grad()
    model.loss(batch).backward()
    opt.step()
    times.append(time.perf_counter() - t)
    if first_kernel is None and any(e.fn for e in opt._kernels._entries.values()):
        first_kernel = time.perf_counter() - t0
    if opt.wait_compiled(timeout=0):
        break
print(times[0], first_kernel, time.perf_counter() - t0, len(times), max(times))
"""


def cold_start(threads: int, env: dict[str, str] | None = None) -> dict:
    """The shipped rule's start on the 0.5M transformer in a new process with an empty
    compile cache: the first step, the seconds and steps until the kernel was ready, and
    the slowest step; then (``warm_*``) a second process on that cache, as a later run or
    another rank starts. ``env``: more environment variables of both processes."""
    root = Path(__file__).resolve().parent.parent
    result = {"workload": "transformer-0.5M", "threads": threads}
    with tempfile.TemporaryDirectory() as cache:
        child_env = compile_env(cache, threads) | (env or {})
        for prefix in ("", "warm_"):
            out = subprocess.run(
                [sys.executable, "-c", _COLD_START], env=child_env, cwd=root, capture_output=True,
                text=True, check=True,
            )  # fmt: skip
            first, first_kernel, ready, steps, slowest = out.stdout.split()[-5:]
            result |= {
                f"{prefix}first_step_seconds": round(float(first), 2),
                f"{prefix}first_kernel_seconds": round(float(first_kernel), 1),
                f"{prefix}kernel_ready_seconds": round(float(ready), 1),
                f"{prefix}steps_until_ready": int(steps),
                f"{prefix}slowest_step_seconds": round(float(slowest), 2),
            }
    return result


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def print_row(r: dict) -> None:
    ratios = {k.removesuffix("_ratio"): v for k, v in r.items() if k.endswith("_ratio")}
    print(
        f"{r['workload']} ({r['load']}): AdamW {r['adamw_foreach_step_ms']} ms, {ratios}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small workloads only")
    ap.add_argument("--workloads", nargs="+", choices=[*MODELS, *SHAPES])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-contention", action="store_true")
    ap.add_argument(
        "--contention-blocks", type=int, default=3,
        help="blocks measured with two busy processes, each with fresh ones (the median is "
        "reported: under load, how the scheduler slices a short and a long step swings "
        "from block to block)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=THREADS, help="torch threads (default 2)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--cold-start-only",
        action="store_true",
        help="only time the start with an empty inductor cache and record it in --out",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    command = command_line(
        f"OMP_NUM_THREADS={args.threads} python benchmarks/step_overhead.py", argv
    )
    today = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.cold_start_only:
        result = json.loads(args.out.read_text())
        stamp = {"load_average_before": load_before, "command": command, "date": today}
        result["cold_start"] = {**cold_start(args.threads), **stamp}
        print(f"cold start: {result['cold_start']}")
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    names = args.workloads or (QUICK if args.quick else [*MODELS, *SHAPES])
    t0 = time.perf_counter()
    rows: list = []

    def save() -> None:  # after every workload, so an interrupted run keeps what it measured
        result = {
            "benchmark": "step_overhead",
            "command": command,
            "date": today,
            "machine": machine_info(),
            "load_average_before": load_before,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "period": PERIOD,
            "compile_route": "torch.export (dynamic sizes) and AOTInductor, one package per "
            "kind of tensor, built by a child process (here queued at once: the kernel is timed)",
            "targets": "optimizer step <= 3x AdamW on the 0.5M transformer, <= 2x at 10M; "
            "full training step <= 1.3x on both; <= 6x with 2 busy processes; first step "
            "<= 2 s with an empty cache",
            "wall_seconds": round(time.perf_counter() - t0, 1),
            "rows": rows,
            "cold_start": cold,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    cold = cold_start(args.threads)
    print(f"cold start: {cold}")
    measure(names, args.warmup, args.repeats, "as is", rows, save)
    if not args.no_contention:
        contended = [n for n in CONTENDED if n in names]
        blocks = []
        for _ in range(args.contention_blocks):  # fresh busy processes for each block
            busy = busy_processes(2)
            try:
                time.sleep(1.0)
                blocks.append(measure(contended, args.warmup, args.repeats, "+2 busy"))
            finally:
                for proc in busy:
                    proc.kill()
                    proc.wait()
        rows += [median_row(list(same)) for same in zip(*blocks)]
        save()
        for r in rows[-len(contended) :]:
            print(f"{r['workload']}: +2 busy, median of {len(r['blocks'])} blocks: step "
                  f"{r['learned_default_step_ratio']}x (blocks {r['blocks']})")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
