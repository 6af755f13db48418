"""This checkout's optimizer step against another revision's, side by side in one process.

A step's time moves by a third from run to run on a shared machine; timed in turns within
one process, the ratio holds. On each task's model at seed 0, with one fixed gradient, the
eager reference of each revision (``compile=False``) and AdamW each step their own copy,
taking turns for ``--rounds`` rounds of ``--steps`` steps at one thread; each side's fastest
round is kept. Also recorded: how far apart the two revisions' parameters end (0: bitwise).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks import rules  # noqa: E402
from benchmarks.common import command_line, machine, write_json  # noqa: E402
from benchmarks.common import commit as this_commit  # noqa: E402

#: Small models of the validation family and the held-out suite (the runs that end before
#: a kernel is built), and one larger transformer.
TASKS = (
    "heldout_autoencoder", "val_friedman_mlp", "val_mf_recsys", "val_resmlp_ln",
    "val_lstm_lm", "heldout_convnet_bn", "heldout_char_lm",
)  # fmt: skip


def import_revision(ref: str):
    """The ``optimizer`` module of ``learned_opt`` at git revision ``ref``, imported apart
    (:func:`benchmarks.rules.import_revision`), and the commit."""
    commit = rules.resolve_commit(ref)
    package = rules.import_revision(commit)
    return importlib.import_module(f"{package.__name__}.optimizer"), commit


def base_checkpoint(base_optimizer) -> Path:
    """The base revision's own default checkpoint (extracted beside its package)."""
    package = base_optimizer.__name__.rsplit(".", 1)[0]
    name = importlib.import_module(f"{package}.checkpoint").DEFAULT_CHECKPOINT
    return Path(base_optimizer.__file__).parent / "checkpoints" / f"{name}.pt"


def measure(task_name: str, base_optimizer, steps: int, rounds: int) -> dict:
    """Fastest-round ms per step of AdamW, the base revision's rule and this one's."""
    from learned_opt import LearnedOptimizer
    from learned_opt.tasks import get_task

    task = get_task(task_name)
    base_ckpt = base_checkpoint(base_optimizer)
    makers = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "base": lambda ps: base_optimizer.LearnedOptimizer(ps, checkpoint=base_ckpt, compile=False),
        "this": lambda ps: LearnedOptimizer(ps, compile=False),
    }
    sides = {}
    for side, make in makers.items():
        torch.manual_seed(0)
        model, loss_fn, batches = task.workload(seed=0)
        loss_fn(next(iter(batches))).backward()
        opt = make(list(model.parameters()))
        for _ in range(4):  # state created, packs built
            opt.step()
        sides[side] = (model, opt)
    best = {side: float("inf") for side in sides}
    for _ in range(rounds):
        for side, (_, opt) in sides.items():
            start = time.perf_counter()
            for _ in range(steps):
                opt.step()
            best[side] = min(best[side], (time.perf_counter() - start) / steps * 1e3)
    pairs = [
        (p.detach(), q.detach())
        for p, q in zip(*(sides[s][0].parameters() for s in ("this", "base")))
    ]
    diff = max(float((p - q).abs().max() / (q.abs().max() + 1e-12)) for p, q in pairs)
    return {
        "parameters": sum(p.numel() for p in sides["adamw"][0].parameters()),
        "ms": {side: round(ms, 4) for side, ms in best.items()},
        "x_adamw": {side: round(best[side] / best["adamw"], 3) for side in ("base", "this")},
        "this_over_base": round(best["this"] / best["base"], 3),
        "max_rel_diff": float(f"{diff:.2g}"),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--out", default="step_ab", help="result name under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = {}
    base_optimizer, commit = import_revision(args.base)
    for name in args.tasks:
        rows[name] = r = measure(name, base_optimizer, args.steps, args.rounds)
        print(f"{name}: AdamW {r['ms']['adamw']:.3f} ms, base {r['x_adamw']['base']:.2f}x, "
              f"this {r['x_adamw']['this']:.2f}x, this / base {r['this_over_base']:.2f}",
              flush=True)  # fmt: skip
    payload = {
        "benchmark": "step_ab",
        **machine(),
        "load_average_end": round(os.getloadavg()[0], 1),
        "command": command_line("OMP_NUM_THREADS=1 python -m benchmarks.step_ab", argv),
        "base": commit,
        "this": this_commit(),
        "steps": args.steps,
        "rounds": args.rounds,
        "param_groups": "one",
        "path": "eager reference",
        "rows": rows,
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
