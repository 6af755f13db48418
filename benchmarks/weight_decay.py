"""What ``weight_decay`` does on small problems that overfit: the learned rule and AdamW,
each at decay 0, 0.1 and 1 on the weight matrices (none on the biases, the usual groups).

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.weight_decay`` (``--steps``, ``--seeds``).
Writes ``benchmarks/results/weight_decay.json``.

The problems are offline data that no suite of the project uses: 300 training examples
of ``sklearn.datasets.make_gaussian_quantiles`` (10 features, 4 classes in nested
shells) and of ``make_hastie_10_2`` (10 features, 2 classes), the rest of 2000 held out,
standardised on the training split. The model is an MLP 10-128-128-classes trained on
batches of 64 for ``--steps`` steps (1000). Sides: ``LearnedOptimizer()`` (the shipped
rule, its multiplier 1) and ``AdamW(lr=1e-3)``, each with ``weight_decay`` 0, 0.1 and 1
on the matrices, untuned: the same settings for both problems. Each row is the mean over
``--seeds`` (initialisation and batches) of the final loss on the training split, the
loss and accuracy on the held-out split, and the Frobenius norm of the weight matrices.

The family's measure is training loss (``validation_weight_decay.json``), which decay
costs; this is the other side of it: decay is for the held-out loss and the size of the
weights.
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

os.environ.setdefault("LEARNED_OPT_COMPILE", "0")  # runs of a few seconds: the reference
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import command_line, machine, write_json  # noqa: E402
from learned_opt import LearnedOptimizer  # noqa: E402

DECAYS = (0.0, 0.1, 1.0)
TRAIN, TOTAL, BATCH, WIDTH = 300, 2000, 64, 128


def problems() -> dict:
    """``{name: (x_train, y_train, x_test, y_test, classes)}``, standardised on the
    training split (fixed data seeds, so every side and seed sees the same split)."""
    from sklearn.datasets import make_gaussian_quantiles, make_hastie_10_2

    x1, y1 = make_gaussian_quantiles(n_samples=TOTAL, n_features=10, n_classes=4, random_state=7)
    x2, y2 = make_hastie_10_2(n_samples=TOTAL, random_state=7)
    out = {}
    for name, x, y in (("gaussian_quantiles", x1, y1), ("hastie_10_2", x2, (y2 > 0))):
        x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
        mean, std = x[:TRAIN].mean(0), x[:TRAIN].std(0)
        x = (x - mean) / std
        out[name] = (x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:], int(y.max()) + 1)
    return out


def train(data, side: str, decay: float, seed: int, steps: int) -> dict:
    """One run: the final training loss, held-out loss and accuracy, and matrix norm."""
    x, y, x_test, y_test, classes = data
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(x.shape[1], WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, classes),
    )  # fmt: skip
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    groups = [
        {"params": matrices, "weight_decay": decay},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = LearnedOptimizer(groups) if side == "learned" else torch.optim.AdamW(groups, lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        idx = torch.randint(len(x), (BATCH,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = model(x_test)
        return {
            "train_loss": nn.functional.cross_entropy(model(x), y).item(),
            "test_loss": nn.functional.cross_entropy(out, y_test).item(),
            "test_accuracy": (out.argmax(1) == y_test).float().mean().item(),
            "matrix_norm": torch.sqrt(sum(p.square().sum() for p in matrices)).item(),
        }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="weight_decay")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        parser.error("--steps and --seeds must be at least 1")
    start, rows = time.perf_counter(), []
    for name, data in problems().items():
        for side in ("learned", "adamw"):
            for decay in DECAYS:
                runs = [train(data, side, decay, s, args.steps) for s in range(args.seeds)]
                row = {"problem": name, "side": side, "weight_decay": decay}
                row |= {k: round(statistics.mean(r[k] for r in runs), 4) for k in runs[0]}
                rows.append(row)
                print(
                    f"{name} {side} weight_decay={decay}: train {row['train_loss']:.4f}, "
                    f"held-out {row['test_loss']:.4f} ({row['test_accuracy']:.3f}), "
                    f"|W| {row['matrix_norm']:.1f}",
                    flush=True,
                )
    payload = {
        "benchmark": "weight_decay",
        "steps": args.steps,
        "seeds": args.seeds,
        "setup": f"MLP 10-{WIDTH}-{WIDTH}-classes, {TRAIN} training examples of {TOTAL}, "
        f"batch {BATCH}; decay on the weight matrices only; AdamW lr 1e-3; the learned rule "
        "at its defaults (multiplier 1); the mean over seeds",
        "rows": rows,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": command_line("OMP_NUM_THREADS=1 python -m benchmarks.weight_decay", argv),
        **machine(),
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
