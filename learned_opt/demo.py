"""``make demo``: train a small MLP on scikit-learn's digits with ``LearnedOptimizer``.

Run: ``python -m learned_opt.demo [--steps 300] [--checkpoint default]``. Prints the
training loss every 25 steps and the test accuracy; takes a few seconds on a laptop CPU.
The data ship with scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from . import LearnedOptimizer, list_pretrained, load_checkpoint


def load_digits_split(seed: int = 0, test_fraction: float = 0.25):
    """Standardised 8x8 digits as float tensors: ``(x_train, y_train, x_test, y_test)``."""
    from sklearn.datasets import load_digits  # only the demo needs scikit-learn

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--checkpoint", default="default", help=f"one of {list_pretrained()} or a path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and fair on a busy machine
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = LearnedOptimizer(model.parameters(), checkpoint=args.checkpoint)
    card = opt.card or load_checkpoint(args.checkpoint)[1]
    trained = "meta-trained" if card.get("trained") else "hand-initialised (exactly Adam, lr 1e-3)"
    print(f"learned optimizer: {args.checkpoint!r}, {trained}")
    print(f"task: MLP 64-128-10 on digits, {len(x_train)} train / {len(x_test)} test examples")

    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    running = None
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(x_train), (args.batch_size,), generator=gen)
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = float(loss.detach())
        running = value if running is None else 0.9 * running + 0.1 * value
        if step == 1 or step % 25 == 0:
            print(f"step {step:4d}  loss {value:.4f}  (smoothed {running:.4f})")
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    print(
        f"test accuracy {accuracy:.3f} after {args.steps} steps in {time.perf_counter() - start:.1f}s"
    )
    if opt.nonfinite_skips:
        print(f"skipped {opt.nonfinite_skips} tensor updates with NaN/Inf gradients")
    return accuracy


if __name__ == "__main__":
    main()
