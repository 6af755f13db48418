"""Meta-training throughput: the single-worker gradient by plain autograd against the
vmapped transform, side by side.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.meta_throughput`` (``--config``,
``--steps``). Writes ``benchmarks/results/meta_throughput.json``.

Meta-training spends most of its time in the inner steps' task gradients. A trajectory of
one worker (every single-worker stage) takes them with plain autograd
(``learned_opt.meta_train.inner._one_worker_grad``); ``vmap(grad_and_value(...))`` over a
worker dimension of one, which gossip trajectories of several workers use, gives the same
values (up to rounding) at more cost. Two meta-training modules built from the stage's
YAML (``default.yaml`` and ``--config``), one per side, advance the same tasks (the same
seeds) by ``--steps`` meta-steps each, taking turns step by step; the gradient is
estimated and not applied, so both sides see the same theta throughout. Recorded: the
median seconds per meta-step, the inner steps per second, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml
from torch.func import grad_and_value, vmap

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks.common import command_line, machine, write_json  # noqa: E402
from learned_opt.meta_train import inner  # noqa: E402
from learned_opt.meta_train.data import step_seeds  # noqa: E402
from learned_opt.meta_train.inner import make_inner_optimizer  # noqa: E402
from learned_opt.meta_train.module import MetaTrainModule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "meta_train/configs/adapt2x_tensor_stage8.yaml"
SIDES = ("autograd", "vmap")


def _vmapped(loss_fn, params, batch, second_order):
    """The transform the single-worker path replaces (first order, as PES runs)."""
    return vmap(grad_and_value(loss_fn))(params, batch)


def _module(config: str) -> MetaTrainModule:
    model: dict = {}
    for path in (ROOT / "meta_train/configs/default.yaml", ROOT / config):
        model.update((yaml.safe_load(path.read_text()) or {}).get("model", {}))
    model["baseline_cache"] = None
    return MetaTrainModule(**model)


def meta_step(module: MetaTrainModule, k: int) -> tuple[int, float]:
    """Meta-step ``k``'s estimate as ``training_step`` takes it (its task seeds, its
    persistent trajectories, the networks it unrolls), without the outer update, so theta
    stays as it is: the inner steps times workers it ran, and the estimate's seconds."""
    s = module.settings
    seeds = step_seeds(0, k, s.tasks_per_step)
    module.slots += [None] * (s.tasks_per_step - len(module.slots))
    for i in range(s.tasks_per_step):
        if module.slots[i] is None or module.slots[i][0].done:
            module.slots[i] = module.estimator.particles(module.sampler.sample(int(seeds[i]) + i))
    opt = make_inner_optimizer(
        "learned", net=module.net, mixing="learned", parts=module.unroll_parts()
    )
    infos: list = []
    start = time.perf_counter()
    module.estimator.estimate(module.net, opt, module.slots, s.unroll_length, infos)
    return sum(info["num_workers"] for info in infos), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CONFIG, help="a stage's YAML under the checkout")
    parser.add_argument("--steps", type=int, default=12, help="meta-steps per side")
    parser.add_argument("--out", default="meta_throughput")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    load = [round(x, 2) for x in os.getloadavg()]
    modules = {side: _module(args.config) for side in SIDES}
    if any(w != 1 for w in modules["autograd"].settings.worker_counts):
        parser.error("the stage must train single-worker trajectories (worker_counts: [1])")
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    steps = dict.fromkeys(SIDES, 0)
    one_worker = inner._one_worker_grad
    started = time.perf_counter()
    try:
        for step in range(args.steps):
            for side in SIDES:
                inner._one_worker_grad = one_worker if side == "autograd" else _vmapped
                n, t = meta_step(modules[side], step)
                seconds[side].append(t)
                steps[side] += n
            print(f"meta-step {step + 1}/{args.steps}: "
                  + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()), flush=True)  # fmt: skip
    finally:
        inner._one_worker_grad = one_worker
    med = {side: statistics.median(v) for side, v in seconds.items()}
    payload = {
        "benchmark": "meta_throughput",
        "command": command_line("OMP_NUM_THREADS=1 python -m benchmarks.meta_throughput", argv),
        **machine(),
        "load_average_before": load,
        "config": args.config,
        "meta_steps_per_side": args.steps,
        "seconds_per_meta_step": {k: round(v, 3) for k, v in med.items()},
        "inner_steps_per_second": {
            k: round(steps[k] / sum(seconds[k]), 1) for k in SIDES
        },  # fmt: skip
        "speedup": round(med["vmap"] / med["autograd"], 3),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_json(args.out, payload)
    print(f"autograd {med['autograd']:.2f} s, vmap {med['vmap']:.2f} s per meta-step: "
          f"{payload['speedup']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
