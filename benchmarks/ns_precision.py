"""Newton-Schulz in bfloat16 on this CPU: its time against float32, and what it does to
the orthogonalisation, in about a minute.

Run: ``python -m benchmarks.ns_precision`` (``--threads``). Writes
``benchmarks/results/ns_precision.json``.

:func:`learned_opt.orthogonal.newton_schulz` (Muon's five quintic iterations) is timed per
matrix shape in float32 and in bfloat16, on the matrix itself (``plain``) and on its Gram
matrix (``gram``, what the rule uses for a matrix at least
:data:`~learned_opt.orthogonal.GRAM_RATIO` times wider than tall), median of 15 calls
after 3 warm-up calls, the variants taking turns. Quality: the singular values of the
result (the iteration should bring them into about [0.7, 1.2]) and its relative distance
to the float32 result of the same path, for a 256 x 1024 input that is random, close to
rank four (a momentum of consistent gradients), and of a decaying spectrum (1 to 1e-4).
The validation family rejected bfloat16 products before (``validation_ns_bf16.json``);
this records why it cannot come back as the cheap path: where it is fast, on the Gram
iteration, it breaks on ill-conditioned momenta.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import command_line, machine, write_json  # noqa: E402
from learned_opt import orthogonal  # noqa: E402

SHAPES = [(256, 1024), (128, 512), (512, 128), (128, 128), (64, 256)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STEPS = 5


def _ns(x: torch.Tensor, path: str) -> torch.Tensor:
    """Newton-Schulz on ``path`` (``gram`` or ``plain``), whatever the shape's ratio."""
    keep = orthogonal.GRAM_RATIO
    orthogonal.GRAM_RATIO = 0 if path == "gram" else 10**9
    try:
        return orthogonal.newton_schulz(x, STEPS)
    finally:
        orthogonal.GRAM_RATIO = keep


def timings(repeats: int = 15) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        inputs = {(p, d): torch.randn(1, *shape, generator=gen).to(DTYPES[d])
                  for p in ("plain", "gram") for d in DTYPES}  # fmt: skip
        times: dict = {k: [] for k in inputs}
        for i in range(repeats + 3):
            for (path, dtype), x in inputs.items():
                t0 = time.perf_counter()
                _ns(x, path)
                if i >= 3:
                    times[(path, dtype)].append(time.perf_counter() - t0)
        for (path, dtype), ts in times.items():
            ms = 1e3 * sorted(ts)[len(ts) // 2]
            rows.append({"shape": list(shape), "path": path, "dtype": dtype, "ms": round(ms, 3)})
    return rows


def quality() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    r, c = 256, 1024

    def randn(*s):
        return torch.randn(*s, generator=gen)

    inputs = {
        "random": randn(1, r, c),
        "near rank 4": randn(1, r, 4) @ randn(1, 4, c) + 0.01 * randn(1, r, c),
        "spectrum 1 to 1e-4": randn(1, r, r)
        @ torch.diag(torch.logspace(0, -4, r))
        @ randn(1, r, c),
    }
    rows = []
    for name, x in inputs.items():
        for path in ("plain", "gram"):
            ref = _ns(x, path)
            for dtype in DTYPES:
                out = _ns(x.to(DTYPES[dtype]), path).float()
                sv = torch.linalg.svdvals(out[0].double())
                rows.append({
                    "input": name, "path": path, "dtype": dtype,
                    "sv_min": round(float(sv.min()), 4), "sv_max": round(float(sv.max()), 4),
                    "rel_to_float32": round(float((out - ref).norm() / ref.norm()), 4),
                })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {**machine(), "command": command_line("python -m benchmarks.ns_precision")}
    result["timings"] = timings()
    result["quality"] = quality()
    for row in result["timings"]:
        print(
            f"{str(tuple(row['shape'])):>12} {row['path']:>5} {row['dtype']:>8} {row['ms']:8.2f} ms"
        )
    for row in result["quality"]:
        print(f"{row['input']:>20} {row['path']:>5} {row['dtype']:>8} singular values "
              f"[{row['sv_min']:.3g}, {row['sv_max']:.3g}], {row['rel_to_float32']:.3g} from float32")  # fmt: skip
    write_json("ns_precision", result)


if __name__ == "__main__":
    main()
