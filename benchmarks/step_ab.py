"""This checkout's optimizer step against another revision's, side by side in one process.

On the shared 2-core machine a step's time moves by a third from run to run, more than most
changes to the step: two runs of a step benchmark, before and after, cannot tell a 15%
gain from the noise. Timed in turns within one process, their ratio holds. The other
revision's ``learned_opt`` is taken from git (``git archive``) into a temporary folder and
imported under another name (its modules import one another relatively).

For each workload (a registered task's model at seed 0, with one fixed gradient), the
rule of each revision (``LearnedOptimizer(compile=False)``: the eager reference, which
steps every run until its kernels are ready, and every run too short to build them) and
AdamW (``foreach=True``) each step their own copy of the model, taking turns for
``--rounds`` rounds of ``--steps`` steps at one thread; each side's fastest round is kept
(interference only adds time). The JSON also records how far apart the two revisions'
parameters are after the timed steps (0: the same step, bitwise). ``--kernel`` times the
compiled kernels instead: each rule's are built first (in a child process, at
:func:`~learned_opt.kernel.compile_after_seconds` 0), and the kinds each built are recorded.

    OMP_NUM_THREADS=1 python -m benchmarks.step_ab --base HEAD~1
    OMP_NUM_THREADS=1 python -m benchmarks.step_ab --base abb5949 --tasks val_resmlp_ln

Writes ``benchmarks/results/step_ab.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks.common import command_line, machine, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Small models of the validation family and the held-out suite (the runs that end before
#: a kernel is built), and one larger transformer.
TASKS = (
    "heldout_autoencoder", "val_friedman_mlp", "val_mf_recsys", "val_resmlp_ln",
    "val_lstm_lm", "heldout_convnet_bn", "heldout_char_lm",
)  # fmt: skip
BASE_NAME = "learned_opt_base"
#: How revisions from 482aa8a to a597db0 checked a build job's module (by the literal
#: package name, so that the base revision's build process refused its own recipes).
_OLD_GUARD = 'job["module"].startswith("learned_opt.")'


def import_revision(ref: str, folder: Path):
    """``learned_opt`` at git revision ``ref``, extracted into ``folder`` and imported as
    :data:`BASE_NAME`; returns its ``optimizer`` module and the commit it resolved to. Its
    kernels' build processes import it under that name too (``folder`` is on their path).
    The revision's shipped checkpoints are extracted beside it (:func:`base_checkpoint`):
    a checkpoint of this checkout may hold config fields that the revision does not
    know."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", commit, "learned_opt", "checkpoints"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    for name in [n for n in sys.modules if n.split(".")[0] == BASE_NAME]:
        del sys.modules[name]  # a revision imported before
    (folder / "learned_opt").rename(folder / BASE_NAME)
    # a revision of one kernel module that checks a build job's module by the literal
    # package name would refuse its own recipes under BASE_NAME (the kernel package
    # reads its own name)
    kernel_py = folder / BASE_NAME / "kernel.py"
    if kernel_py.exists():
        renamed = _OLD_GUARD.replace("learned_opt.", f"{BASE_NAME}.")
        kernel_py.write_text(kernel_py.read_text().replace(_OLD_GUARD, renamed))
    sys.path.insert(0, str(folder))
    try:
        optimizer = importlib.import_module(f"{BASE_NAME}.optimizer")
    finally:
        sys.path.remove(str(folder))
    kernel = importlib.import_module(f"{BASE_NAME}.kernel")
    if BASE_NAME not in getattr(kernel, "_CHILD", BASE_NAME):
        kernel._CHILD = (
            f"import sys; sys.path.insert(0, {str(folder)!r}); "
            + kernel._CHILD.replace("learned_opt.kernel", f"{BASE_NAME}.kernel")
        )
    return optimizer, commit


def base_checkpoint(folder: Path) -> Path:
    """The base revision's own default checkpoint, as :func:`import_revision` extracted it
    into ``folder``."""
    name = importlib.import_module(f"{BASE_NAME}.checkpoint").DEFAULT_CHECKPOINT
    return folder / "checkpoints" / f"{name}.pt"


#: ``--split``'s groups: AdamW's usual weight decay on the matrices, none on the rest.
SPLIT_DECAY = 0.1


def param_groups(params: list, split: bool) -> list:
    """``params`` as one group, or (``split``) as the usual two: the tensors of two or
    more dimensions with weight decay :data:`SPLIT_DECAY`, the others (biases, norms)
    without."""
    if not split:
        return params
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": SPLIT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def measure(
    task_name: str, base_optimizer, steps: int, rounds: int, split: bool = False,
    kernel: bool = False,
) -> dict:  # fmt: skip
    """Fastest-round ms per step of AdamW, the base revision's rule and this one's, every
    side on :func:`param_groups` of the model's parameters; with ``kernel``, each rule's
    compiled kernels, built before the timing (and how many kinds each built)."""
    from learned_opt import LearnedOptimizer
    from learned_opt.kernel import compile_after_seconds
    from learned_opt.tasks import get_task

    task = get_task(task_name)
    base_kernel = importlib.import_module(f"{BASE_NAME}.kernel")
    base_ckpt = base_checkpoint(Path(base_optimizer.__file__).parents[1])
    makers = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "base": lambda ps: base_optimizer.LearnedOptimizer(
            ps, checkpoint=base_ckpt, compile=kernel
        ),
        "this": lambda ps: LearnedOptimizer(ps, compile=kernel),
    }
    sides, kinds = {}, {}
    with compile_after_seconds(0), base_kernel.compile_after_seconds(0):
        for side, make in makers.items():
            torch.manual_seed(0)
            model, loss_fn, batches = task.workload(seed=0)
            loss_fn(next(iter(batches))).backward()
            opt = make(param_groups(list(model.parameters()), split))
            for _ in range(4):  # state created, packs built (with kernel: compiles queued)
                opt.step()
            if kernel and side != "adamw":
                if not opt.wait_compiled(timeout=1800):
                    raise RuntimeError(f"{task_name}: the {side} side's kernels did not build")
                kinds[side] = len(opt._kernels._entries)
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
        **({"kernel_kinds": kinds} if kernel else {}),
        "ms": {side: round(ms, 4) for side, ms in best.items()},
        "x_adamw": {side: round(best[side] / best["adamw"], 3) for side in ("base", "this")},
        "this_over_base": round(best["this"] / best["base"], 3),
        "max_rel_diff": float(f"{diff:.2g}"),
    }


def this_commit() -> str:
    """This checkout's commit (``+dirty`` with uncommitted changes to the rule's code)."""
    from benchmarks.validation import commit

    return commit()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--out", default="step_ab", help="result name under benchmarks/results/")
    ap.add_argument(
        "--split", action="store_true",
        help=f"two param groups on every side: weight decay {SPLIT_DECAY} on the matrices, "
        "none on the rest (AdamW's usual split)",
    )  # fmt: skip
    ap.add_argument(
        "--kernel", action="store_true",
        help="time the compiled kernels (built first, in a child process each) instead of "
        "the eager reference",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.kernel:
        os.environ["LEARNED_OPT_COMPILE"] = "1"
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        base_optimizer, commit = import_revision(args.base, Path(folder))
        for name in args.tasks:
            rows[name] = r = measure(
                name, base_optimizer, args.steps, args.rounds, args.split, args.kernel
            )
            print(
                f"{name}: AdamW {r['ms']['adamw']:.3f} ms, base {r['x_adamw']['base']:.2f}x, "
                f"this {r['x_adamw']['this']:.2f}x, this / base {r['this_over_base']:.2f}",
                flush=True,
            )
    payload = {
        "benchmark": "step_ab",
        **machine(),
        "load_average_end": round(os.getloadavg()[0], 1),
        "command": command_line("OMP_NUM_THREADS=1 python -m benchmarks.step_ab", argv),
        "base": commit,
        "this": this_commit(),
        "steps": args.steps,
        "rounds": args.rounds,
        "param_groups": "split" if args.split else "one",
        "path": "kernel" if args.kernel else "eager reference",
        "rows": rows,
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
