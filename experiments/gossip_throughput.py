"""Gossip throughput on local processes, and learned-vs-Metropolis consensus in simulation.

Run: ``OMP_NUM_THREADS=1 python experiments/gossip_throughput.py`` (``--quick``: 1M only,
``--skip-consensus``). Writes ``experiments/results/gossip_throughput.json``.

Part 1 (gloo, ring topology, 2 and 4 local processes, 1M and 10M float32 parameters in
10 tensors), median ms per step of:

- ``exchange+mix``: ``ProcessGroupCommunicator.mix`` with Metropolis weights, in place
  into the parameters (pack, exchange, NaN check, mix);
- ``exchange+mix (learned)``: the same with the learned rule and the shipped checkpoint;
- ``raw send/recv``: the same bytes, same peer rounds, preallocated buffers, nothing else;
- ``all_reduce``: one all_reduce of the same number of bytes.

The goal is ``exchange+mix / raw send/recv < 1.1``.

Part 2: 8 simulated workers on a ring train ``digits_mlp`` (Dirichlet alpha 0.1) with the
learned optimizer from ``checkpoints/default.pt``, mixing with the checkpoint's learned
edge head versus Metropolis-Hastings weights, and report the consensus distance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from learned_opt import LearnedOptimizer
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.distributed import (
    ProcessGroupCommunicator,
    SimulatedCommunicator,
    get_topology,
    launch_local,
)
from learned_opt.tasks import get_task

RESULTS = Path(__file__).parent / "results" / "gossip_throughput.json"
SIZES = {"1M": 1_000_000, "10M": 10_000_000}
NUM_TENSORS = 10


def _timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, each started after a barrier."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    out = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(out)


def _raw_exchange(topo, rank: int, send: torch.Tensor, recvs: list[torch.Tensor]) -> None:
    peers = topo.neighbors(rank)
    for matching in topo.rounds():
        for i, j in matching:
            if rank in (i, j):
                peer = j if rank == i else i
                works = [dist.isend(send, peer), dist.irecv(recvs[peers.index(peer)], peer)]
                for w in works:
                    w.wait()


def _measure(comm, rank: int, numel: int, reps: int, theta, cfg) -> dict:
    topo = comm.topology
    gen = torch.Generator().manual_seed(rank)
    ys = [torch.randn(numel // NUM_TENSORS, generator=gen) for _ in range(NUM_TENSORS)]
    step = iter(range(10**6))
    nbytes = sum(y.numel() * 4 for y in ys) + 16  # the buffer also carries the header
    send = torch.zeros(nbytes, dtype=torch.uint8)
    recvs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in topo.neighbors(rank)]
    flat = torch.randn(numel)
    row = {
        "exchange+mix": _timed(lambda: comm.mix(ys, next(step), out=ys), reps),
        "exchange+mix (learned)": _timed(
            lambda: comm.mix(ys, next(step), "learned", theta, cfg, 1.0, out=ys), reps
        ),
        "raw send/recv": _timed(lambda: _raw_exchange(topo, rank, send, recvs), reps),
        "all_reduce": _timed(lambda: dist.all_reduce(flat), reps),
        "bytes_sent_per_step": comm.bytes_sent,
    }
    row["mix_overhead_x"] = row["exchange+mix"] / row["raw send/recv"]
    return row


def _throughput(rank: int, world: int, sizes: dict[str, int], reps: int) -> dict:
    comm = ProcessGroupCommunicator(get_topology("ring", world), timeout=120)
    opt = LearnedOptimizer([torch.zeros(1)], checkpoint=DEFAULT_CHECKPOINT)
    theta, cfg = opt.theta(torch.device("cpu"), torch.float32), opt.config
    return {label: _measure(comm, rank, n, reps, theta, cfg) for label, n in sizes.items()}


def consensus_study(steps: int = 200, workers: int = 8, seed: int = 0) -> dict:
    """Learned (checkpoint edge head) vs Metropolis mixing with the shipped checkpoint."""
    task = get_task("digits_mlp")
    data = task.worker_batches(seed=seed, num_workers=workers, partition="dirichlet", alpha=0.1)
    sim = SimulatedCommunicator(get_topology("ring", workers))
    out = {}
    for rule in ("learned", "metropolis"):
        init = task.init(torch.Generator().manual_seed(seed))
        params = [
            {k: v.clone().requires_grad_(True) for k, v in init.items()} for _ in range(workers)
        ]
        opts = [LearnedOptimizer(list(p.values()), checkpoint=DEFAULT_CHECKPOINT) for p in params]
        theta = opts[0].theta(torch.device("cpu"), torch.float32)
        curve, losses = {}, []
        for step in range(steps):
            inputs, targets = data.get(step)
            batch_losses = []
            for i in range(workers):
                opts[i].zero_grad()
                loss = task.loss(params[i], (inputs[i], targets[i]))
                loss.backward()
                opts[i].step()
                batch_losses.append(loss.detach())
            with torch.no_grad():
                names = list(init)
                ys = [torch.stack([params[i][k] for i in range(workers)]) for k in names]
                mixed, info = sim.mix(
                    ys, step, rule, theta, opts[0].config, torch.stack(batch_losses)
                )
                for k, m in zip(names, mixed):
                    for i in range(workers):
                        params[i][k].copy_(m[i])
                losses.append(float(torch.stack(batch_losses).mean()))
                if (step + 1) % 25 == 0:
                    curve[step + 1] = float(sim.consensus_distance(mixed))
        avg = {k: torch.stack([p[k] for p in params]).mean(0).detach() for k in init}
        out[rule] = {
            "consensus_distance": curve,
            "final_consensus_distance": curve[max(curve)],
            "train_loss_last20": sum(losses[-20:]) / 20,
            "mean_edge_weight_last_step": float(
                torch.stack([w.mean() for w in info["weights"]]).mean()
            ),
            **{f"averaged_model_test_{k}": v for k, v in task.evaluate(avg).items()},
        }
    out["setup"] = (
        f"{workers} simulated workers, ring, digits_mlp, dirichlet alpha=0.1, {steps} steps, "
        "LearnedOptimizer(checkpoints/default.pt) locally, losses fed to the edge head"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M parameters only")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip-consensus", action="store_true")
    args = parser.parse_args()
    sizes = {"1M": SIZES["1M"]} if args.quick else SIZES
    results = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads in the parent, "
        "OMP_NUM_THREADS=1 per worker, gloo over loopback, ring topology",
        "torch": torch.__version__,
        "goal": "mix_overhead_x = exchange+mix / raw send/recv < 1.1",
        "note": "exchange+mix includes packing the tensors into the send buffer (one copy), "
        "the finite check and the in-place mix; none of it is overlapped with the transfer yet",
        "throughput_ms": {},
    }
    for world in (2, 4):
        res = launch_local(_throughput, world, sizes, args.reps, timeout=900, pg_timeout=120)
        results["throughput_ms"][f"{world} processes"] = res[0]
    print(
        f"{'setup':<16}{'size':>5}{'mix ms':>10}{'learned':>10}{'raw ms':>10}{'allred':>10}{'ratio':>8}"
    )
    for setup, rows in results["throughput_ms"].items():
        for label, r in rows.items():
            print(
                f"{setup:<16}{label:>5}{r['exchange+mix']:>10.1f}{r['exchange+mix (learned)']:>10.1f}"
                f"{r['raw send/recv']:>10.1f}{r['all_reduce']:>10.1f}{r['mix_overhead_x']:>8.2f}"
            )
    if not args.skip_consensus:
        results["consensus_8_workers"] = consensus_study()
        for rule in ("learned", "metropolis"):
            c = results["consensus_8_workers"][rule]
            print(
                f"{rule:<11} consensus {c['consensus_distance']}  loss {c['train_loss_last20']:.4f}"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
