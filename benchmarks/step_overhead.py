"""Time ``LearnedOptimizer.step()`` against ``torch.optim.AdamW`` on transformer-like shapes.

Run: ``OMP_NUM_THREADS=2 python benchmarks/step_overhead.py`` (``--quick`` for 1M only).
Writes ``benchmarks/results/step_overhead.json`` and prints a table. AdamW is timed with
``foreach=True`` and ``foreach=False`` and the faster of the two is the baseline. The
optimizers take turns step by step; the median and the fastest step are both reported
(on a shared machine the fastest is the least disturbed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from learned_opt import LearnedOptimizer, LearnedOptimizerNet, NetConfig
from learned_opt.config import NUM_ELEMENT_FEATURES

RESULTS = Path(__file__).parent / "results" / "step_overhead.json"
THREADS = 2

#: size label -> (vocab, d_model, layers); about 1M and 10M parameters.
SIZES = {"1M": (2000, 128, 4), "10M": (8000, 256, 10)}


def transformer_shapes(vocab: int, d: int, layers: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a small GPT-like model: embeddings, attention, 4x MLP, layernorms."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (256, d)]  # token and position embeddings
    for _ in range(layers):
        shapes += [(d,), (d,)]  # layernorm 1
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,)]  # attention qkv and output
        shapes += [(d,), (d,)]  # layernorm 2
        shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # MLP
    shapes += [(d,), (d,)]  # final layernorm
    return shapes


def make_params(shapes, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append(p)
    return params


def time_interleaved(opts: dict, warmup: int, repeats: int) -> dict:
    """``{name: (median, best)}`` wall time of one ``step()`` per optimizer, in ms. The
    optimizers take turns step by step, so a busy machine slows them all alike."""
    for opt in opts.values():
        for _ in range(warmup):
            opt.step()
    times: dict = {name: [] for name in opts}
    for _ in range(repeats):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def state_bytes_per_param(opt: torch.optim.Optimizer, n: int) -> float:
    total = 0
    for s in opt.state.values():
        total += sum(
            v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
        )
    return total / n


def flops_per_element(width: int) -> int:
    """Multiply-adds of the per-element MLP counted as 2 FLOPs: 2*(F*H + H*H + 2*H)."""
    return 2 * (NUM_ELEMENT_FEATURES * width + width * width + 2 * width)


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def run(sizes: list[str], widths: list[int], warmup: int, repeats: int) -> dict:
    rows = []
    for size in sizes:
        shapes = transformer_shapes(*SIZES[size])
        n = sum(torch.Size(s).numel() for s in shapes)
        opts = {
            f"adamw_foreach={fe}": torch.optim.AdamW(make_params(shapes), lr=1e-3, foreach=fe)
            for fe in (True, False)
        }
        for width in widths:
            net = LearnedOptimizerNet(NetConfig(width=width))
            opts[f"learned_w{width}"] = LearnedOptimizer(make_params(shapes), net=net)
        ms = time_interleaved(opts, warmup, repeats)
        adam = {fe: ms[f"adamw_foreach={fe}"] for fe in (True, False)}
        adam_best = min(adam.values())  # the faster of foreach and for-loop, by median
        adam_bytes = state_bytes_per_param(opts["adamw_foreach=True"], n)
        for width in widths:
            learned = ms[f"learned_w{width}"]
            adam_min = min(t[1] for t in adam.values())
            rows.append(
                {
                    "size": size,
                    "params": n,
                    "tensors": len(shapes),
                    "width": width,
                    "learned_ms": round(learned[0], 2),
                    "adamw_ms": round(adam_best[0], 2),
                    "adamw_foreach_ms": round(adam[True][0], 2),
                    "adamw_forloop_ms": round(adam[False][0], 2),
                    "ratio": round(learned[0] / adam_best[0], 2),
                    "learned_best_ms": round(learned[1], 2),
                    "adamw_best_ms": round(adam_min, 2),
                    "ratio_of_best": round(learned[1] / adam_min, 2),
                    "flops_per_element": flops_per_element(width),
                    "learned_state_bytes_per_param": state_bytes_per_param(
                        opts[f"learned_w{width}"], n
                    ),
                    "adamw_state_bytes_per_param": adam_bytes,
                }
            )
            print_row(rows[-1])
        del opts
    return {
        "benchmark": "step_overhead",
        "command": "OMP_NUM_THREADS=2 python benchmarks/step_overhead.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "warmup": warmup,
        "repeats": repeats,
        "target": "ratio < 10 at 10M parameters, width 8",
        "rows": rows,
    }


HEADER = (
    f"{'size':>5} {'width':>5} {'learned ms':>11} {'AdamW ms':>9} {'ratio':>6} "
    f"{'best-of ratio':>13} {'FLOPs/el':>8} {'B/param':>8}"
)


def print_row(r: dict) -> None:
    print(
        f"{r['size']:>5} {r['width']:>5} {r['learned_ms']:>11.1f} {r['adamw_ms']:>9.1f} "
        f"{r['ratio']:>6.1f} {r['ratio_of_best']:>13.1f} {r['flops_per_element']:>8} "
        f"{r['learned_state_bytes_per_param']:>8.0f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--widths", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    print(HEADER)
    result = run(args.sizes, args.widths, args.warmup, args.repeats)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
