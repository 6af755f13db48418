"""NCCL gossip on every GPU of one machine: the full training step against all-reduce DDP
and Decent-DP.

Run from the repository root on a machine with two or more GPUs::

    PYTHONUNBUFFERED=1 python3 benchmarks/nccl_check.py --out $OUT

The package is laid out from the checkout into a temporary folder first on the path (as
``cuda_check.py`` does). One process per GPU (``launch_local``), backend NCCL. Per model
size (``speed_common.GPT``, about 10M and 110M parameters, ``--batch`` sequences of 64
tokens; fresh processes per size) every rank trains its own copy under DDP AdamW (the
baseline), D-Adam, and the learned optimizer with learned mixing (blocking and overlapped;
its kernel compiled first), on a ring and the exponential graph, and Decent-DP's ring when
``decent_dp`` is importable. Times: ``gossip_common.time_in_turns``, each rank's and the
slowest's. Writes ``<out>/nccl_check.json`` after every size. Without two GPUs it prints
one line and exits with 2; 1 when a size failed. ``--backend gloo --device cpu --quick``
is the CPU dry run the tests run.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.append(str(ROOT))  # after the laid-out package
from benchmarks.device_harness import build_installed_layout, sync, use_layout  # noqa: E402
from benchmarks.gossip_common import (  # noqa: E402
    DecentDPStep,
    decent_dp,
    gossip_run_info,
    time_in_turns,
)

#: size label -> (vocab, d_model, layers) of ``speed_common.GPT`` (sequences of 64 tokens)
SIZES = {"10M": (4000, 256, 12), "100M": (16000, 768, 12), "tiny": (500, 32, 2)}
GPU_SIZES, QUICK_SIZES = ["10M", "100M"], ["tiny"]
TOPOLOGIES = ("ring", "exponential")
BASELINE, PEER = "DDP AdamW", "Decent-DP Adam ring"


# ----------------------------------------------------------------------------- one rank


class _LossOf(torch.nn.Module):
    """``forward(x, y)`` is the GPT's loss: DDP and Decent-DP act in the wrapped forward."""

    def __init__(self, gpt: torch.nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss((x, y))


def _configs(rank: int, world: int, spec: dict, device: torch.device):
    """``(configs, learned, skipped)``: ``name: (model, optimizer)``, the learned local
    optimizers (whose kernels get compiled) and ``name: reason`` of those left out."""
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.speed_common import GPT
    from learned_opt import LearnedOptimizer
    from learned_opt.distributed import GossipOptimizer, dadam, get_topology

    def model():
        torch.manual_seed(rank)
        with device:
            return _LossOf(GPT(*SIZES[spec["size"]]))

    cuda, timeout = device.type == "cuda", spec["pg_timeout"]
    net = model()
    ddp = DistributedDataParallel(net, device_ids=[device.index] if cuda else None)
    kind = {"fused": True} if cuda else {"foreach": True}
    configs = {BASELINE: (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, **kind))}
    learned = {}
    for topo in TOPOLOGIES:
        graph = get_topology(topo, world)
        net = model()
        opt = dadam(net.parameters(), 1e-3, graph, timeout=timeout, metrics_every=0)
        configs[f"D-Adam {topo}"] = (net, opt)
        for overlap in (False, True):
            name = f"learned + learned mixing {topo}" + (" overlap" if overlap else "")
            net = model()
            learned[name] = LearnedOptimizer(net.parameters())
            opt = GossipOptimizer(learned[name], graph, "learned", timeout=timeout,
                                  overlap=overlap, metrics_every=0)  # fmt: skip
            configs[name] = (net, opt)
    peer, reason = decent_dp(model, world)
    if peer is not None:
        configs[PEER] = (peer, DecentDPStep())
    return configs, learned, {PEER: reason} if reason else {}


def _train_step(x: torch.Tensor, y: torch.Tensor):
    """One full step: forward, backward, optimizer step (with the exchange)."""
    from learned_opt.distributed import GossipOptimizer

    def step(model, opt):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if isinstance(opt, GossipOptimizer):
            opt.step(loss=loss.detach())  # the learned mixing's loss features
        else:
            opt.step()

    return step


def _bench(rank: int, world: int, spec: dict) -> dict:
    """One rank (under ``launch_local``): every configuration of one size, timed in turns."""
    from benchmarks.speed_common import compile_kernels
    from learned_opt.distributed import GossipOptimizer
    from learned_opt.kernel import compiling_enabled

    device = torch.device("cpu")
    if spec["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)

    def say(msg: str) -> None:
        if rank == 0:
            print(f"nccl_check: [rank 0] {spec['size']}: {msg}", flush=True)

    configs, learned, skipped = _configs(rank, world, spec, device)
    params = sum(p.numel() for p in configs[BASELINE][0].parameters())
    say(f"{len(configs)} configurations of {params:,} parameters; warming up")
    gen = torch.Generator().manual_seed(rank)
    vocab, seq = SIZES[spec["size"]][0], 64
    batch = torch.randint(vocab, (spec["batch"], seq + 1), generator=gen).to(device)
    step = _train_step(batch[:, :-1], batch[:, 1:])
    kernel: dict = {"compile": compiling_enabled()}
    t0 = time.perf_counter()
    try:  # steps every configuration COMPILE_AFTER times, then waits for the kernels
        calls = {n: functools.partial(step, *c) for n, c in configs.items()}
        wait = learned if kernel["compile"] else {}
        kernel["waited_s"] = compile_kernels(calls, wait, timeout=spec["compile_timeout"])
    except RuntimeError as exc:  # the reference path steps on; recorded, not fatal
        kernel["error"] = str(exc)
    kernel["seconds"] = round(time.perf_counter() - t0, 1)
    say(f"timing {spec['rounds']} rounds of {spec['steps']} steps per configuration")
    synced = functools.partial(sync, device)
    ms = time_in_turns(configs, step, spec["rounds"], spec["steps"], synced)
    for _, opt in configs.values():
        if isinstance(opt, GossipOptimizer):
            opt.flush()
    names = list(ms)
    mine = torch.tensor([ms[n] for n in names], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    out = {"params": params, "kernel": kernel, "skipped": skipped}
    out["rank_step_ms"] = {n: [float(t[i]) for t in every] for i, n in enumerate(names)}
    if device.type == "cuda":
        out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out


# ----------------------------------------------------------------------------- parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                    help="folder for nccl_check.json")  # fmt: skip
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--world", type=int, help="ranks (default: every GPU; 2 on the CPU)")
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help="model sizes")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model, a few steps, the learned step not compiled")  # fmt: skip
    ap.add_argument("--rounds", type=int, help="timed rounds (default 4; --quick 1)")
    ap.add_argument("--steps", type=int, help="steps per turn (default 8; --quick 2)")
    ap.add_argument("--batch", type=int, help="sequences per step (default 16; --quick 2)")
    ap.add_argument("--pg-timeout", type=float, default=60.0,
                    help="seconds before a collective or an exchange fails (at least "
                    "--compile-timeout + 30 unless --quick)")  # fmt: skip
    ap.add_argument("--compile-timeout", type=float, default=90.0,
                    help="seconds to wait for the learned step's kernel")  # fmt: skip
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for every size")
    args = ap.parse_args(argv)
    quick = args.quick
    args.sizes = args.sizes or (QUICK_SIZES if quick else GPU_SIZES)
    args.rounds = args.rounds or (1 if quick else 4)
    args.steps = args.steps or (2 if quick else 8)
    args.batch = args.batch or (2 if quick else 16)
    if not quick:  # one rank may wait for its kernel that much longer than another
        args.pg_timeout = max(args.pg_timeout, args.compile_timeout + 30)
    return args


def device_problem(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the check as asked (``None`` when it can)."""
    dry_run = "a CPU dry run: --backend gloo --device cpu --quick"
    if args.device == "cpu":
        if args.backend == "nccl":
            return f"NCCL needs GPUs; {dry_run}"
        return f"--world {args.world}: 2 or more ranks" if (args.world or 2) < 2 else None
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}); "
                f"this check needs 2 or more GPUs ({dry_run})")  # fmt: skip
    count = torch.cuda.device_count()
    if count < 2:
        return f"found {count} GPU; this check needs 2 or more ({dry_run})"
    if args.backend == "nccl" and not dist.is_nccl_available():
        return f"this torch ({torch.__version__}) was built without NCCL"
    if args.world is not None and not 2 <= args.world <= count:
        return f"--world {args.world}: between 2 and the {count} GPUs (one rank per GPU)"
    return None


def versions(args: argparse.Namespace) -> dict:
    """torch, CUDA, NCCL and Decent-DP versions, and the GPUs."""
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": None, "decent_dp": None}  # fmt: skip
    try:
        info["decent_dp"] = importlib.metadata.version("decent-dp")
    except importlib.metadata.PackageNotFoundError:
        pass
    gpus = {"gpu": None, "gpu_count": 0}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int before
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        gpus = {"gpu": props.name, "gpu_count": torch.cuda.device_count(),
                "gpu_memory_gb": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}"}  # fmt: skip
    return {"versions": info, **gpus}


def summarise(size: str, out: dict, batch: int) -> dict:
    """One size's row: the slowest rank's times, ratios to DDP (and to Decent-DP)."""
    step_ms = {n: max(ms) for n, ms in out["rank_step_ms"].items()}
    base = step_ms[BASELINE]
    vocab, d, layers = SIZES[size]
    row = {"size": size, "model": f"GPT(vocab={vocab}, d_model={d}, layers={layers})",
           "params": out["params"], "batch": f"{batch} x 64 tokens", "step_ms": step_ms,
           "vs_ddp": {n: ms / base for n, ms in step_ms.items()}}  # fmt: skip
    if PEER in step_ms:
        row["vs_decent_dp"] = {n: ms / step_ms[PEER] for n, ms in step_ms.items()}
    row.update({k: v for k, v in out.items() if k not in ("params",)})
    return row


def run_size(args: argparse.Namespace, size: str, world: int, timeout: float) -> dict:
    """One size on ``world`` fresh ranks; its row, printed."""
    from learned_opt.distributed import RankFailure, launch_local

    spec = {"size": size, "device": args.device, "batch": args.batch, "rounds": args.rounds,
            "steps": args.steps, "pg_timeout": args.pg_timeout,
            "compile_timeout": args.compile_timeout}  # fmt: skip
    outs = launch_local(_bench, world, spec, timeout=timeout, pg_timeout=args.pg_timeout,
                        backend=args.backend, raise_on_error=False)  # fmt: skip
    failed = [f"rank {o.rank}: {o.message.strip()[-2000:]}" for o in outs
              if isinstance(o, RankFailure)]  # fmt: skip
    for line in failed:
        print(f"  {size:>5} FAILED {line.splitlines()[-1]}", flush=True)
    if failed:
        return {"size": size, "error": failed}
    row = summarise(size, outs[0], args.batch)
    for name, ms in row["step_ms"].items():
        print(f"  {size:>5} {name:<48}{ms:>9.2f} ms {row['vs_ddp'][name]:>6.2f}x DDP")
    for name, why in row["skipped"].items():
        print(f"  {size:>5} {name:<48} skipped: {why}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = device_problem(args)
    if problem:
        print(f"nccl_check: {problem}", file=sys.stderr)
        return 2
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    t_start, deadline = time.monotonic(), time.monotonic() + args.budget
    out_file = args.out / "nccl_check.json"
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    if args.quick:  # inherited by the ranks: the reference step, no compile to wait for
        os.environ.setdefault("LEARNED_OPT_COMPILE", "0")
    transport = ("NCCL, one GPU per rank" if args.backend == "nccl" else
                 f"{args.backend} on {args.device}")  # fmt: skip
    command = " ".join(["python benchmarks/nccl_check.py", *(argv or sys.argv[1:])])
    results = {"script": "benchmarks/nccl_check.py",
               **gossip_run_info(command, os.getloadavg()[0], "at start", transport),
               **versions(args), "backend": args.backend, "device": args.device,
               "world_size": world,
               "setup": f"{world} ranks, one process each, median over {args.rounds} rounds "
               f"of the mean of {args.steps} full steps per configuration, taking turns; "
               "step_ms is the slowest rank's",
               "settings": {k: getattr(args, k) for k in ("rounds", "steps", "batch", "pg_timeout",
                                                          "compile_timeout", "budget")},
               "sizes": []}  # fmt: skip

    def write() -> None:
        results["wall_seconds"] = round(time.monotonic() - t_start, 1)
        out_file.write_text(json.dumps(results, indent=2) + "\n")

    print(f"nccl_check: {world} ranks, {transport}, sizes {' '.join(args.sizes)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nccl_check_") as tmp:
        use_layout(build_installed_layout(Path(tmp) / "site"))
        for size in args.sizes:
            left = deadline - time.monotonic()
            row = run_size(args, size, world, left) if left >= 30 else None
            results["sizes"].append(row or {"size": size, "error": ["skipped: budget spent"]})
            write()
    write()
    print(f"nccl_check: wrote {out_file}", flush=True)
    return 1 if any("error" in row for row in results["sizes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
