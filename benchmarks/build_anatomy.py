"""Where a kernel build's time goes: export, inductor's Python, and each C++ compile.

Run: ``python -m benchmarks.build_anatomy`` (``--variants``, ``--threads``). Writes
``benchmarks/results/build_anatomy.json``. Run it on a quiet machine.

The 0.5M transformer of :mod:`benchmarks.step_overhead` steps eagerly until its kinds of
bucket are due to compile (:func:`learned_opt.kernel.compile_after_seconds` at 0), and the
packages they would queue are then built in turn by :func:`learned_opt.kernel.build_package`,
in a new process with an empty compile cache (``TORCHINDUCTOR_CACHE_DIR`` a fresh temporary
folder) and at the priority of this process (the shipped child runs niced beside training;
this times the work itself). Each build is split into ``torch.export``, the compiler's
subprocesses by what they compile (inductor's vector-ISA probes, which run once per cache;
the package's C++ wrapper; its kernels; linking and the rest), and inductor's own Python
(lowering and code generation: the remainder).

Variants, each in a new process with a cache of its own:

- ``shipped``: the build as the kernel's child runs it (``TORCHINDUCTOR_VEC_ISA_OK=1``,
  inductor trusting the CPU's flags for its vector ISA);
- ``isa_probes``: inductor compiling a probe for each vector ISA instead (the child's
  build before 2026-12-07);
- ``wrapper_O0``: ``AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL=O0``, the wrapper at ``-O0``;
- ``no_precompiled_headers``: AOTInductor compiling its headers with each package instead
  of once per cache (``aot_inductor.precompile_headers`` off);
- ``one_package``: every tensor in one package instead of one per kind of bucket.

Every variant but ``isa_probes`` trusts the CPU's flags, as shipped.
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
from benchmarks.step_overhead import PROBED_ENV
from learned_opt.kernel import ISA_ENV

ROOT = Path(__file__).resolve().parents[1]
TRUSTED = {ISA_ENV: "1"}
VARIANTS = {
    "shipped": TRUSTED,
    "isa_probes": PROBED_ENV,
    "wrapper_O0": {**TRUSTED, "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL": "O0"},
    "no_precompiled_headers": TRUSTED,
    "one_package": TRUSTED,
}
#: The compiler's subprocesses by what they compile (the first kind whose mark is in the
#: command line): the ISA probes load their library in a Python child.
KINDS = (
    ("wrapper", ("wrapper.cpp",)),
    ("kernels", ("kernel.cpp",)),
    ("isa_probes", ("cdll.LoadLibrary", ".cpp ")),
)


def kind_of(command) -> str:
    """What one compiler subprocess compiles, from its command line (see :data:`KINDS`)."""
    line = command if isinstance(command, str) else " ".join(map(str, command))
    for kind, marks in KINDS:
        if any(mark in line for mark in marks):
            return kind
    return "link_and_other"


def queued_builds(model, batch) -> list[tuple]:
    """The step kernels' arguments that training ``model`` (its ``loss(batch)``) queues
    for building, recorded instead of built (the compile worker's ``submit`` replaced
    meanwhile)."""
    from learned_opt import LearnedOptimizer, kernel

    queued: list[tuple] = []
    submit = kernel._Worker.submit
    kernel._Worker.submit = lambda self, entry, args, recipe=None: queued.append(args)
    try:
        opt = LearnedOptimizer(model.parameters())
        with kernel.compile_after_seconds(0):
            for _ in range(kernel.COMPILE_AFTER + 1):
                opt.zero_grad()
                model.loss(batch).backward()
                opt.step()
    finally:
        kernel._Worker.submit = submit
    return queued


def anatomy(merge: bool) -> list[dict]:
    """In this process: the packages of the 0.5M transformer's kinds of bucket, built in
    turn, each build's seconds split by phase."""
    import torch

    from benchmarks.step_overhead import MODELS
    from learned_opt import kernel

    torch.manual_seed(0)
    model = MODELS["transformer-0.5M"]()
    queued = queued_builds(model, model.batch(torch.Generator().manual_seed(0)))
    if merge:
        first = queued[0]
        joined = [sum((list(args[i]) for args in queued), []) for i in (3, 4, 5)]
        lr, decay = (torch.cat([args[i] for args in queued]) for i in (6, 7))
        queued = [(*first[:3], *joined, lr, decay)]
    timed: dict[str, float] = {}
    run, export = subprocess.run, torch.export.export

    def timed_run(command, *a, **k):
        start = time.perf_counter()
        try:
            return run(command, *a, **k)
        finally:
            kind = kind_of(command)
            timed[kind] = timed.get(kind, 0.0) + time.perf_counter() - start

    def timed_export(*a, **k):
        start = time.perf_counter()
        try:
            return export(*a, **k)
        finally:
            timed["export"] = timed.get("export", 0.0) + time.perf_counter() - start

    subprocess.run, torch.export.export = timed_run, timed_export
    builds = []
    with tempfile.TemporaryDirectory() as folder:
        for i, args in enumerate(queued):
            timed.clear()
            start = time.perf_counter()
            kernel.build_package(args, Path(folder) / f"{i}.pt2")
            seconds = time.perf_counter() - start
            parts = {k: round(v, 2) for k, v in timed.items()}
            parts["inductor_python"] = round(seconds - sum(timed.values()), 2)
            builds.append({"tensors": len(args[3]), "seconds": round(seconds, 2), **parts})
            print(json.dumps(builds[-1]), file=sys.stderr, flush=True)
    return builds


def run_variant(name: str, threads: int) -> dict:
    """One variant in a new process with an empty compile cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**compile_env(cache, threads), **VARIANTS[name]}
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.build_anatomy", "--child", name], env=env,
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
    builds = json.loads(out.stdout.strip().splitlines()[-1])
    phases = sorted({k for b in builds for k in b} - {"tensors", "seconds"})
    total = {k: round(sum(b.get(k, 0.0) for b in builds), 2) for k in ("seconds", *phases)}
    return {"builds": builds, "total": total}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the build")
    ap.add_argument("--out", default="build_anatomy")
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if args.child == "no_precompiled_headers":
            from torch._inductor import config

            config.aot_inductor.precompile_headers = False
        print(json.dumps(anatomy(merge=args.child == "one_package")))
        return
    start, load = time.perf_counter(), os.getloadavg()[0]
    variants = {}
    for name in args.variants:
        variants[name] = run_variant(name, args.threads)
        print(name, variants[name]["total"], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "build_anatomy",
            "command": command_line("python -m benchmarks.build_anatomy", argv),
            "workload": "transformer-0.5M",
            "threads": args.threads,
            "load_average_before": load,
            "variants": variants,
            "wall_seconds": round(time.perf_counter() - start, 1),
            **machine(),
        },
    )


if __name__ == "__main__":
    main()
