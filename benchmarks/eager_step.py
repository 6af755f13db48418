"""The eager reference step (what steps until the kernel is compiled): reading the finite
mask on the host, and packing small tensors into one call, against AdamW.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.eager_step`` (``--repeats``; ``--tasks``
times registered tasks' models instead). Writes ``benchmarks/results/eager_step.json``.

Most runs on a small CPU end before their kernel is compiled, so the reference's step sets
their pace. The step leaves a tensor whose gradient or parameter holds NaN or Inf
unchanged, which the reference writes as five ``torch.where`` passes over the elements. On
CPU, outside tracing, ``learned_opt.kernel.step_tensors`` passes ``read_mask=True``: the
host reads the tensor's finite flag and leaves the passes out where it is finite. Each
eager call also costs about 120 torch ops whatever the tensor's size, so the tensors of at
most ``learned_opt.kernel.PACK_NUMEL`` elements are stepped together as the segments of
one flat vector. Sides, each a ``LearnedOptimizer(compile=False)`` on its own copy of the
model, taking turns with AdamW (``foreach=True``) round by round in one process at one
thread:

- ``masked``: every step masks (``read_mask=False``), one call per tensor;
- ``mask_read``: the mask read on the host, one call per tensor;
- ``packed``: the default (the mask read, small tensors packed); ``--pack-numel`` adds a
  side per other bound (``packed_4096``, ...), as measured to choose ``PACK_NUMEL``;
- ``default``: ``LearnedOptimizer()`` as a user builds it (``compile=True``) before its
  kernels exist (none is queued or loaded here): the reference behind the kernel
  buckets' bookkeeping, which is what a run pays until its kernels are ready.

The models: a 3-layer MLP (26k parameters), a 2-layer transformer encoder (0.4M, its
matrices orthogonalised) and a wide MLP (1.9M, 1024-wide matrices, which take the Adam
form). Every side starts from the same model and gradients, and the JSON records the
largest relative difference of the parameters from ``masked`` after the timed steps:
rounding for every other side (since 2026-12-06 an eager call that reads the mask also
reads the step count on the host and computes the bias corrections there; before, zero
for ``mask_read``), and the rounding of the per-tensor sums for the packed sides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from learned_opt import LearnedOptimizer, kernel

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks.common import command_line, machine, write_json  # noqa: E402


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


def _transformer() -> nn.Module:
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 512, batch_first=True), 2)


def _wide() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


#: name -> (model factory, optimizer steps per timed round)
MODELS = {"mlp-26k": (_mlp, 20), "transformer-0.4M": (_transformer, 5), "wide-mlp-1.9M": (_wide, 4)}
SIDES = ("masked", "mask_read", "packed", "default")


def _side(name: str):
    """Patch the step for side ``name``; returns a function that undoes it."""
    step, stack_key, pack_numel = kernel._step_stacked, kernel._stack_key, kernel.PACK_NUMEL
    is_built, after = kernel._is_built, kernel.COMPILE_AFTER_SECONDS
    if name == "default":  # no package is built or loaded: the reference steps throughout
        kernel._is_built, kernel.COMPILE_AFTER_SECONDS = (lambda args: False), float("inf")
    if name == "masked":

        def masked(*args, **kw):
            return step(*args, **{**kw, "read_mask": False})

        kernel._step_stacked = masked
    if name in ("masked", "mask_read"):
        kernel.PACK_NUMEL = 0
        kernel._stack_key = lambda p, g, s: id(p)  # one call per tensor: no stacks
    elif name.startswith("packed_"):
        kernel.PACK_NUMEL = int(name.removeprefix("packed_"))

    def undo():
        kernel._step_stacked, kernel._stack_key, kernel.PACK_NUMEL = step, stack_key, pack_numel
        kernel._is_built, kernel.COMPILE_AFTER_SECONDS = is_built, after

    return undo


def _task_model(name: str):
    """A factory of the model of registered task ``name`` at seed 0."""
    from learned_opt.tasks import get_task

    task = get_task(name)
    return lambda: task.workload(seed=0)[0]


def _model(factory) -> nn.Module:
    torch.manual_seed(0)
    model = factory()
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
    return model


def measure(factory, steps: int, repeats: int, sides=SIDES) -> dict:
    """Median ms per step of each side and of AdamW, taking turns for ``repeats`` rounds
    (the first is a warm-up)."""
    models = {s: _model(factory) for s in sides}
    opts = {s: LearnedOptimizer(m.parameters(), compile=s == "default") for s, m in models.items()}
    adamw_model = _model(factory)
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-3, foreach=True)
    times: dict[str, list[float]] = {s: [] for s in [*sides, "adamw"]}
    for _ in range(repeats + 1):
        for side in sides:
            undo = _side(side)
            try:
                start = time.perf_counter()
                for _ in range(steps):
                    opts[side].step()
                times[side].append((time.perf_counter() - start) / steps * 1e3)
            finally:
                undo()
        start = time.perf_counter()
        for _ in range(steps):
            adamw.step()
        times["adamw"].append((time.perf_counter() - start) / steps * 1e3)
    ms = {k: statistics.median(v[1:]) for k, v in times.items()}
    ref = [p.detach() for p in models["masked"].parameters()]
    diff = {
        s: max(
            float(((p.detach() - r).abs() / (r.abs() + 1e-6)).max())
            for p, r in zip(models[s].parameters(), ref)
        )
        for s in sides
    }
    return {
        "parameters": sum(p.numel() for p in adamw_model.parameters()),
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "x_adamw": {s: round(ms[s] / ms["adamw"], 2) for s in sides},
        "speedup_vs_masked": {s: round(ms["masked"] / ms[s], 2) for s in sides},
        "max_rel_diff_vs_masked": {s: float(f"{d:.2g}") for s, d in diff.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--tasks", nargs="+", default=[],
        help="registered tasks whose models to time instead (the model of seed 0)",
    )  # fmt: skip
    ap.add_argument(
        "--pack-numel",
        type=int,
        nargs="*",
        default=[],
        help="other bounds on the packed tensors' size to measure, as more sides",
    )
    ap.add_argument("--out", default="eager_step", help="result name under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sides = (*SIDES, *(f"packed_{n}" for n in args.pack_numel))
    rows = {}
    models = {name: MODELS[name] for name in args.models}
    if args.tasks:
        models = {name: (_task_model(name), 10) for name in args.tasks}
    for name, (factory, steps) in models.items():
        rows[name] = measure(factory, steps, args.repeats, sides)
        r = rows[name]
        print(f"{name}: " + ", ".join(f"{s} {r['ms'][s]} ms ({r['x_adamw'][s]}x AdamW)"
                                      for s in sides) + f", AdamW {r['ms']['adamw']} ms",
              flush=True)  # fmt: skip
    payload = {
        "benchmark": "eager_step",
        **machine(),
        "load_average_end": round(os.getloadavg()[0], 1),
        "command": command_line("OMP_NUM_THREADS=1 python -m benchmarks.eager_step", argv),
        "sides": list(sides),
        "pack_numel": kernel.PACK_NUMEL,
        "rows": rows,
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
