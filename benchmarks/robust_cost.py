"""What robust mixing costs one rank when nobody attacks: eagerly, and with its distances
compiled.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.robust_cost`` (``--rounds``, ``--no-compiled``).
Writes ``benchmarks/results/robust_cost.json``.

One rank's mix of the 1M-parameter MLP of ``benchmarks/gossip_step.py`` (784-1024-256-10:
six tensors) with two neighbours, as :class:`~learned_opt.distributed.ProcessGroupCommunicator`
does it, at one thread, in one process (no exchange: the neighbours' tensors are there).
Sides, taking turns round after round, each the median over rounds of the mean of
``--calls`` calls:

- ``plain``: :func:`~learned_opt.distributed.mixing.mix` of every tensor in place;
- ``robust``: ``robust="clip"`` with eager distances: the distances to every neighbour
  (:func:`~learned_opt.distributed.mixing.distance_lists`), the clipped weights, then the
  same mix;
- ``robust_compiled`` (unless ``--no-compiled``): the same with the distances of the
  compiled kernel that a communicator switches to
  (:class:`~learned_opt.distributed.distance_kernel.Distances`, built before the timing);
- ``distances`` and ``compiled_distances``: the distances alone, eager and compiled;
- ``state_distances`` and ``state_compiled_distances``: the distances of the learned
  rule's shared moments (``v`` and ``m`` of every tensor, float32 here, their neighbours'
  copies bfloat16 as they travel), which an exchange that carries them adds.

The JSON records the milliseconds, ``robust`` over ``plain``, the extra milliseconds of
``robust`` and ``robust_compiled``, and these over a rank's share of a step of
``gossip_step.json``'s D-Adam ring overlap row (4 ranks on 2 cores: the step's
milliseconds times 2 / 4). The target of issue 33 is at most 5% of the step when nobody
attacks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gossip_step  # noqa: E402
from benchmarks.common import RESULTS, machine, write_json  # noqa: E402
from learned_opt.distributed.distance_kernel import Distances  # noqa: E402
from learned_opt.distributed.mixing import (  # noqa: E402
    CLIP_MULTIPLE,
    distance_lists,
    mix,
    robust_weight_lists,
)
from learned_opt.distributed.packing import STATE_WIRE_DTYPE  # noqa: E402
from learned_opt.kernel import COMPILE_AFTER, compile_after_seconds  # noqa: E402

#: The tensors of gossip_step.py's MLP, weights and biases (built with the global random
#: state forked, which that builder seeds).
with torch.random.fork_rng():
    SHAPES = [tuple(p.shape) for p in gossip_step.mlp(0).parameters()]
NEIGHBOURS = 2
#: The gossip_step.json row whose step time the costs are set against.
STEP_ROW = "D-Adam ring overlap"
#: Seconds the distance kernels may take to build before the benchmark gives up.
BUILD_TIMEOUT = 900


def tensors(seed: int = 0):
    """A rank's tensors, its neighbours' (close to them, as after gossip), and Metropolis
    weights for a ring (1/3 each)."""
    gen = torch.Generator().manual_seed(seed)
    ys = [torch.randn(s, generator=gen) * 0.05 for s in SHAPES]
    nbs = [[y + 1e-3 * torch.randn(y.shape, generator=gen) for _ in range(NEIGHBOURS)] for y in ys]
    weights = [[1.0 / 3.0] * NEIGHBOURS for _ in ys]
    return ys, nbs, weights


def moments(seed: int = 1):
    """The learned rule's shared moments as a rank mixes them: its own ``v`` then ``m`` of
    every tensor (float32) and each neighbour's copy in the wire dtype."""
    gen = torch.Generator().manual_seed(seed)
    own = [torch.rand(s, generator=gen) * 1e-4 for s in SHAPES]
    own += [torch.randn(s, generator=gen) * 1e-2 for s in SHAPES]
    nbs = [[(x * (1 + 0.01 * torch.randn(x.shape, generator=gen))).to(STATE_WIRE_DTYPE)
            for _ in range(NEIGHBOURS)] for x in own]  # fmt: skip
    return own, nbs


def sides(ys, nbs, weights, compiled: bool) -> tuple[dict, dict]:
    """The functions timed, and the tensors that ``plain`` and the robust sides mix into
    (each its own copies of the rank's tensors). With ``compiled`` the distance kernels
    are built first (a child process; minutes on a busy machine)."""
    names = ("plain", "robust") + (("robust_compiled",) if compiled else ())
    targets = {name: [y.clone() for y in ys] for name in names}
    state, state_nbs = moments()

    def plain():
        for y, t, nb, w in zip(ys, targets["plain"], nbs, weights):
            mix(y, nb, w, out=t)

    def robust_with(distances, name):
        def run():
            dist = distances(ys, nbs)
            clipped = robust_weight_lists(ys, nbs, weights, CLIP_MULTIPLE, dist)
            for y, t, nb, w in zip(ys, targets[name], nbs, clipped):
                mix(y, nb, w, out=t)

        return run

    out = {
        "plain": plain,
        "robust": robust_with(distance_lists, "robust"),
        "distances": lambda: distance_lists(ys, nbs),
        "state_distances": lambda: distance_lists(state, state_nbs),
    }
    if compiled:
        kernels = Distances()
        with compile_after_seconds(0):
            for _ in range(COMPILE_AFTER):
                kernels(ys, nbs)
                kernels(state, state_nbs)
        if not kernels.wait(BUILD_TIMEOUT):
            raise SystemExit(f"the distance kernels were not built within {BUILD_TIMEOUT} s")
        out["robust_compiled"] = robust_with(kernels, "robust_compiled")
        out["compiled_distances"] = lambda: kernels(ys, nbs)
        out["state_compiled_distances"] = lambda: kernels(state, state_nbs)
    return out, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--no-compiled", action="store_true",
                        help="leave out the compiled distances (no build)")  # fmt: skip
    parser.add_argument("--out", default="robust_cost")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    torch.set_num_threads(1)
    ys, nbs, weights = tensors()
    fns, _ = sides(ys, nbs, weights, compiled=not args.no_compiled)
    for fn in fns.values():  # warm up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    ms = {name: round(statistics.median(t), 3) for name, t in times.items()}
    step = None
    gossip = RESULTS / "gossip_step.json"
    if gossip.exists():
        step = json.loads(gossip.read_text()).get("step_ms", {}).get(STEP_ROW)
    extra = {k: round(ms[k] - ms["plain"], 3) for k in ("robust", "robust_compiled") if k in ms}
    # a rank's share of the machine in gossip_step.py: 4 ranks on 2 cores
    share = None if step is None else step * 2 / 4
    of_step = {k: round(v / share, 3) for k, v in extra.items()} if share else None
    payload = {
        "benchmark": "robust_cost",
        "setup": f"one rank's mix of {len(SHAPES)} tensors "
        f"({sum(torch.Size(s).numel() for s in SHAPES):,} parameters) with {NEIGHBOURS} "
        f"neighbours, 1 thread, median of {args.rounds} rounds of {args.calls} calls",
        "ms": ms,
        "robust_over_plain": round(ms["robust"] / ms["plain"], 3),
        "extra_ms": extra,
        "step_row": STEP_ROW,
        "step_ms": step,
        "rank_share_ms": share,
        "extra_of_step": of_step,
        "command": " ".join(
            [
                "OMP_NUM_THREADS=1 python -m benchmarks.robust_cost",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),  # fmt: skip
        **machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    write_json(args.out, payload)
    print(json.dumps({k: payload[k] for k in ("ms", "robust_over_plain", "extra_ms",
                                              "extra_of_step")}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
