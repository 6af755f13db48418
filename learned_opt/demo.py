"""``make demo``: decentralized training on 4 local worker processes, three ways.

Trains ``digits_mlp`` on a ring of 4 gloo workers with label-skewed data (Dirichlet 0.1):

1. the shipped learned optimizer with learned mixing;
2. D-Adam with Metropolis mixing, at :data:`DADAM_LR`, the rate the decentralized
   benchmark tuned for a ring with Dirichlet data (``--dadam-lr`` changes it);
3. all-reduce Adam (plain data parallel) at the same learning rate.

Prints a table and writes TensorBoard logs under ``runs/demo/``. Run:
``python -m learned_opt.demo`` (no torchrun needed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

#: D-Adam's learning rate: the best of the decentralized benchmark's grid for digits_mlp
#: on a ring of 8 workers with Dirichlet(0.1) label skew (a source checkout's
#: ``benchmarks/quality_decentralized.py``, in git at ``c2adf13``). The package never reads
#: benchmark results.
DADAM_LR = 0.03


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits_mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--logdir", default="runs/demo")
    parser.add_argument("--dadam-lr", type=float, default=DADAM_LR, help="D-Adam's rate")
    args = parser.parse_args(argv)

    from learned_opt.distributed.launch import launch_local
    from learned_opt.distributed.train import launched

    lr = args.dadam_lr
    lr_source = "tuned by the benchmark" if lr == DADAM_LR else "--dadam-lr"
    common = ["--task", args.task, "--topology", "ring", "--partition", "dirichlet",
              "--alpha", "0.1", "--steps", str(args.steps)]  # fmt: skip
    runs = {
        "learned + learned mixing": ["--optimizer", "learned", "--mixing", "learned"],
        f"D-Adam (lr {lr:g}, Metropolis)": ["--optimizer", "adam", "--lr", str(lr), "--mixing", "metropolis"],
        f"all-reduce Adam (lr {lr:g})": ["--optimizer", "adam", "--lr", str(lr), "--mixing", "allreduce"],
    }  # fmt: skip
    print(f"{args.workers} gloo workers, ring, Dirichlet(0.1) label skew, {args.task}, "
          f"{args.steps} steps; D-Adam lr: {lr_source}", flush=True)  # fmt: skip
    rows = []
    for i, (label, extra) in enumerate(runs.items(), 1):
        logdir = str(Path(args.logdir) / f"run{i}")
        print(f"[{i}/{len(runs)}] {label} ...", flush=True)
        start = time.perf_counter()
        summaries = launch_local(
            launched, args.workers, [*common, *extra, "--logdir", logdir], timeout=600,
            pg_timeout=120,  # starting 4 interpreters on a busy machine takes a while
        )  # fmt: skip
        s = summaries[0]
        rows.append((label, s, time.perf_counter() - start))
        print(f"      done in {rows[-1][2]:.1f} s: train loss {s['train_loss']:.4f}, "
              f"test accuracy {s.get('test_accuracy', float('nan')):.4f}", flush=True)  # fmt: skip
    header = (
        f"{'method':<34} {'train loss':>10} {'avg-model':>10} {'test loss':>9} {'test acc':>9} "
        f"{'consensus':>10} {'bytes/step':>11} {'wall s':>7}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for label, s, wall in rows:
        print(f"{label:<34} {s['train_loss']:>10.4f} {s['averaged_model_train_loss']:>10.4f} "
              f"{s['test_loss']:>9.4f} {s.get('test_accuracy', float('nan')):>9.4f} "
              f"{s['consensus_distance']:>10.3g} {s['bytes_per_step']:>11,.0f} {wall:>7.1f}")  # fmt: skip
    print("\ntrain loss: mean of each worker's last 10 batch losses on its own shard; avg-model: "
          "the averaged model's loss on the whole training set; test loss and acc: the averaged "
          "model on the held-out test set; "
          "bytes/step: sent per worker per step (all-reduce: ring estimate).")  # fmt: skip
    print(f"TensorBoard: tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
