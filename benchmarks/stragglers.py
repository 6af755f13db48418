"""One slow rank of 8 (a straggler) on real gloo processes, with and without a step deadline.

8 local processes train ``digits_mlp`` with D-Adam; a step's compute is emulated by a sleep
of ``--compute-ms`` after the backward pass, :data:`SLOW_FACTOR` times as long on
:data:`SLOW_RANK`. Runs per topology: ``clean``, ``slow`` (plain gossip) and
``slow_deadline_<ms>`` (``step_deadline``). Goal: the fast ranks at most 20% below the
clean throughput, and the slow rank's updates still mixed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from learned_opt.distributed import GossipOptimizer, launch_local
from learned_opt.tasks import get_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or with -m
from benchmarks.common import command_line  # noqa: E402
from benchmarks.gossip_common import gossip_run_info  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "stragglers.json"
WORKERS = 8
SLOW_RANK = 3
SLOW_FACTOR = 5.0
TASK = "digits_mlp"
LR = 3e-3
TIMEOUT = 120.0  # seconds: a neighbour silent for that long is a failure (never, here)
MAX_DROP = 0.20  # the fast ranks' throughput at most 20% below the clean run's


def worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank's run; returns its clock, its exchanges and its final parameters."""
    task = get_task(cfg["task"])
    module = task.module(torch.Generator().manual_seed(0))  # one initial model for all
    data = task.batches(worker=rank, num_workers=world, partition="iid", seed=0)
    opt = GossipOptimizer(
        torch.optim.Adam(module.parameters(), lr=cfg["lr"]),
        cfg["topology"],
        "metropolis",
        timeout=cfg["timeout"],
        step_deadline=cfg["deadline"],
        metrics_every=0,  # its all_reduce would make every rank wait for the slowest
    )
    slow = cfg["slow_rank"]
    compute = cfg["compute_s"] * (cfg["slow_factor"] if rank == slow else 1.0)
    mixed = skipped = mixed_slow = skipped_slow = 0
    dist.barrier()
    start = time.perf_counter()
    for step in range(cfg["steps"]):
        if step == cfg["warmup"]:
            start = time.perf_counter()
        opt.zero_grad()
        task.module_loss(module, next(data)).backward()
        time.sleep(compute)  # the emulated rest of the forward and backward pass
        opt.step()
        late = set(opt.communicator.skipped)
        mixed += len(opt.neighbors)  # this step's and (with a deadline) late ones
        skipped += len(late)
        mixed_slow += slow in opt.neighbors
        skipped_slow += slow in late
    seconds = time.perf_counter() - start
    opt.flush()  # with a deadline: end the exchanges in flight (waits for the slow rank)
    dist.barrier()
    return {
        "rank": rank,
        "steps_per_s": (cfg["steps"] - cfg["warmup"]) / seconds,
        "edges_mixed": mixed,
        "edges_skipped": skipped,
        "slow_rank_exchanges_mixed": mixed_slow,
        "slow_rank_exchanges_skipped": skipped_slow,
        "params": torch.cat([p.detach().flatten() for p in module.parameters()]),
    }


def evaluate(task_name: str, outs: list[dict]) -> dict:
    """The averaged model's training loss and each rank's distance to the average."""
    task = get_task(task_name)
    module = task.module(torch.Generator().manual_seed(0))
    flat = torch.stack([o["params"] for o in outs])
    avg = flat.mean(0)
    torch.nn.utils.vector_to_parameters(avg, module.parameters())
    with torch.no_grad():
        loss = float(task.module_loss(module, (task.data.x_train, task.data.y_train)))
    dist_to_avg = (flat - avg).norm(dim=1) / avg.norm()
    return {"averaged_model_train_loss": loss, "distance_to_average": dist_to_avg.tolist()}


def run(topology: str, slow: bool, deadline: float | None, args) -> dict:
    cfg = {
        "task": TASK,
        "lr": LR,
        "topology": topology,
        "deadline": deadline,
        "timeout": TIMEOUT,
        "slow_rank": SLOW_RANK if slow else -1,
        "slow_factor": SLOW_FACTOR,
        "compute_s": args.compute_ms / 1000,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    t0 = time.perf_counter()
    outs = launch_local(worker, args.workers, cfg, timeout=TIMEOUT + 600, pg_timeout=TIMEOUT)
    res = {"wall_s": round(time.perf_counter() - t0, 1), **evaluate(TASK, outs)}
    for key in ("steps_per_s", "edges_mixed", "edges_skipped"):
        res[key] = [o[key] for o in outs]
    others = [o for o in outs if o["rank"] != SLOW_RANK]
    for key in ("slow_rank_exchanges_mixed", "slow_rank_exchanges_skipped"):
        res[key] = sum(o[key] for o in others)  # counted on the slow rank's neighbours
    # exchanges between two fast ranks, counted on both ends
    fast_mixed = sum(o["edges_mixed"] - o["slow_rank_exchanges_mixed"] for o in others)
    fast_skipped = sum(o["edges_skipped"] - o["slow_rank_exchanges_skipped"] for o in others)
    res["fast_edges_skipped_fraction"] = fast_skipped / max(1, fast_mixed + fast_skipped)
    return res


def summarise(runs: dict) -> dict:
    """Per run, against the clean run: the fast ranks' throughput drop and the loss; for the
    runs with a slow rank, the goal's two parts."""
    clean = runs["clean"]
    fast = [r for r in range(len(clean["steps_per_s"])) if r != SLOW_RANK]
    for name, res in runs.items():
        drops = [1 - res["steps_per_s"][r] / clean["steps_per_s"][r] for r in fast]
        res["fast_ranks_drop_mean"] = statistics.fmean(drops)
        res["fast_ranks_drop_max"] = max(drops)
        res["loss_vs_clean"] = res["averaged_model_train_loss"] / clean["averaged_model_train_loss"]
        if name.startswith("slow"):
            res["throughput_met"] = res["fast_ranks_drop_max"] <= MAX_DROP
            res["slow_rank_counted"] = res["slow_rank_exchanges_mixed"] > 0
            res["met"] = res["throughput_met"] and res["slow_rank_counted"]
    return runs


def ms(seconds: float) -> str:
    return f"{seconds * 1000:g}ms"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--deadlines", type=float, nargs="+", default=[0.005, 0.02],
                        help="step_deadline values in seconds, one run each")  # fmt: skip
    parser.add_argument("--topologies", nargs="+", default=["ring", "exponential"])
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument(
        "--quick", action="store_true", help="a test: 4 ranks, ring, 30 steps, one deadline"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.steps, args.warmup, args.topologies = 4, 30, 5, ["ring"]
        args.deadlines = args.deadlines[:1]
    results = {}
    for topo in args.topologies:
        runs = {"clean": run(topo, False, None, args)}
        if not args.quick:  # does the deadline cost anything when no rank is slow?
            d = args.deadlines[0]
            runs[f"clean_deadline_{ms(d)}"] = run(topo, False, d, args)
        runs["slow"] = run(topo, True, None, args)
        for d in args.deadlines:
            runs[f"slow_deadline_{ms(d)}"] = run(topo, True, d, args)
        results[topo] = summarise(runs)
        for name, r in runs.items():
            print(f"{topo} {name}: steps/s {[round(x, 1) for x in r['steps_per_s']]}, drop "
                  f"{r['fast_ranks_drop_mean']:.2f} (max {r['fast_ranks_drop_max']:.2f}), slow "
                  f"mixed/skipped {r['slow_rank_exchanges_mixed']}/"
                  f"{r['slow_rank_exchanges_skipped']}, fast-fast skipped "
                  f"{r['fast_edges_skipped_fraction']:.2f}, loss "
                  f"{r['averaged_model_train_loss']:.4f}, wall {r['wall_s']} s", flush=True)  # fmt: skip
    given = sys.argv[1:] if argv is None else argv
    command = command_line("nice -n 5 python benchmarks/stragglers.py", given)
    payload = {
        **gossip_run_info(command.strip(), os.getloadavg()[0], "at the end"),
        "setup": f"{args.workers} processes, {TASK} (IID shards), D-Adam (Adam lr {LR:g}, Metropolis "
        f"weights), {args.steps} steps each ({args.warmup} warm-up steps not timed); compute "
        f"emulated by a sleep of {args.compute_ms:g} ms per step, {SLOW_FACTOR:g}x that on "
        f"the slow rank {SLOW_RANK}; timeout {TIMEOUT:g} s",
        "goal": f"with step_deadline and rank {SLOW_RANK} {SLOW_FACTOR:g}x slower: every fast "
        f"rank's steps/s at most {MAX_DROP:.0%} below the clean run's (throughput_met), and "
        "the slow rank's neighbours mix some of its exchanges (slow_rank_counted)",
        "slow_rank": SLOW_RANK,
        "slow_factor": SLOW_FACTOR,
        "compute_ms": args.compute_ms,
        "steps": args.steps,
        "deadlines_s": args.deadlines,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
