"""What calling a loaded kernel costs, by how its inputs are handed over.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.kernel_call`` (``--workloads`` to choose).
Writes ``benchmarks/results/kernel_call.json``.

A package built by AOTInductor is callable (``aoti_load_package(path)(*args)``); that call
parses the package's call spec (JSON) and flattens the arguments with ``torch``'s pytree on
every call. Three routes step the same kernel (the shipped rule on one bucket of a small
model of the validation family, where the optimizer step is a large share of the
training step), taking turns call by call, beside AdamW's ``step()`` on the same model:

- ``flat_loader``: the optimizer's route (:func:`learned_opt.kernel.load_package`): the
  package's loader runs :func:`learned_opt.kernel.flat_inputs`' list directly;
- ``flat_package_call``: the same list through the package's own call (the route where a
  torch has no such loader);
- ``nested_package_call``: the route before: a package exported on the structured
  arguments (theta by name, lists of parameters and gradients, a dict per tensor's state),
  called with them.

Reported: the median ms of one call (of AdamW's ``step()``), and the ratios to AdamW. The
packages are built in this process first, and not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, write_json
from learned_opt import LearnedOptimizer
from learned_opt.kernel import (
    BUCKET,
    build_package,
    flat_inputs,
    kernel_state,
    load_package,
    step_tensors,
    theta_inputs,
)
from learned_opt.tasks import get_task

WORKLOADS = ("val_friedman_mlp", "val_synth40_mlp", "val_gru_majority", "val_resmlp_ln")


class NestedStep(torch.nn.Module):
    """The route before: :func:`~learned_opt.kernel.step_tensors` on structured arguments."""

    def __init__(self, cfg, parts):
        super().__init__()
        self.cfg, self.parts = cfg, parts

    def forward(self, theta, params, grads, states, lr, decay):
        return step_tensors(theta, self.cfg, self.parts, params, grads, states, lr, decay=decay)


def bucket_args(task: str) -> tuple[tuple, torch.optim.Optimizer]:
    """The kernel arguments of the first :data:`BUCKET` tensors of ``task``'s model under the
    shipped rule (its state after one eager step), and AdamW on another copy, both with
    one gradient (AdamW steps the same tensors)."""
    model, loss_fn, batches = get_task(task).workload(0)
    params = list(model.parameters())[:BUCKET]
    opt = LearnedOptimizer(params, compile=False)
    loss_fn(next(batches)).backward()
    opt.step()
    states = [kernel_state(opt.state[p]) for p in params]
    theta = opt.theta(params[0].device, states[0]["v"].dtype)
    lr = torch.ones(len(params), dtype=states[0]["v"].dtype)  # one per tensor, as a kernel's
    decay = torch.zeros_like(lr)
    grads = [p.grad.detach() for p in params]
    args = (theta, opt.config, opt.parts, [p.detach() for p in params], grads, states, lr, decay)
    other, loss_other, batches_other = get_task(task).workload(0)
    adamw = torch.optim.AdamW(list(other.parameters())[:BUCKET], lr=1e-3, foreach=True)
    loss_other(next(batches_other)).backward()
    return args, adamw


def routes(args: tuple, folder: Path) -> dict:
    """The three calls of one kernel (see the module doc), each a function of no arguments."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    theta, cfg, parts, params, grads, states, lr, decay = args
    flat_path = folder / "flat.pt2"
    build_package(args, flat_path)
    flat_kernel, flat_runner = load_package(flat_path), aoti_load_package(str(flat_path))
    nested_path = folder / "nested.pt2"
    sorted_theta = {name: theta[name] for name in sorted(theta)}
    nested_args = (sorted_theta, params, grads, states, lr, decay)
    with torch.no_grad():
        program = torch.export.export(NestedStep(cfg, parts), nested_args)
        aoti_compile_and_package(program, package_path=str(nested_path))
    nested_runner = aoti_load_package(str(nested_path))
    theta_list = theta_inputs(theta)  # as the optimizer's route keeps it
    return {
        "flat_loader": lambda: flat_kernel(*args),
        "flat_package_call": lambda: flat_runner(
            flat_inputs(theta_list, params, grads, states, lr, decay)
        ),
        "nested_package_call": lambda: nested_runner(*nested_args),
    }


def time_calls(calls: dict, steps: int, warmup: int = 20) -> dict:
    """Median ms per call, the calls taking turns."""
    times: dict = {name: [] for name in calls}
    with torch.no_grad():
        for i in range(warmup + steps):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="kernel_call")
    args = parser.parse_args(argv)
    rows = {}
    for task in args.workloads:
        kernel_args, adamw = bucket_args(task)
        with tempfile.TemporaryDirectory() as folder:
            calls = {"adamw_step": adamw.step, **routes(kernel_args, Path(folder))}
            ms = time_calls(calls, args.steps)
        rows[task] = {
            "tensors": len(kernel_args[3]),
            "parameters": sum(p.numel() for p in kernel_args[3]),
            "ms": {k: round(v, 4) for k, v in ms.items()},
            "vs_adamw": {k: round(v / ms["adamw_step"], 3) for k, v in ms.items()},
        }
        print(f"{task:>18}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
    payload = {
        "benchmark": "kernel_call",
        "command": " ".join(
            [
                "OMP_NUM_THREADS=1 python -m benchmarks.kernel_call",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
        "setup": f"{torch.get_num_threads()} thread(s); per workload the first {BUCKET} "
        f"tensors as one kernel call, {args.steps} calls timed after 20, taking turns",
        **machine(),
        "rows": rows,
    }
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
