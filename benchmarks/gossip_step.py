"""Full decentralized step time: forward, backward, local step, exchange and mix.

4 local gloo processes each train their own copy of an MLP (784-1024-256-10, batches of 64
random samples); the rows are :func:`_configs`'s, Decent-DP's where it is importable
(:mod:`benchmarks.gossip_common`). The configurations take turns, ``--steps`` steps each (a
multiple of 4, so every round holds the same state exchanges for every k); a time is the
median over rounds of the mean step in the round, the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from learned_opt import LearnedOptimizer
from learned_opt.distributed import (
    GossipOptimizer,
    ProcessGroupCommunicator,
    dadam,
    get_topology,
    launch_local,
)
from learned_opt.distributed.distance_kernel import Distances
from learned_opt.kernel import COMPILE_AFTER, compile_after_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or with -m
from benchmarks.gossip_common import (  # noqa: E402
    DecentDPStep,
    decent_dp,
    gossip_run_info,
    time_in_turns,
)

RESULTS = Path(__file__).parent / "results" / "gossip_step.json"
WORLD = 4
BATCH = 64
POOL = 64  # random batches per rank, cycled (4,096 samples with random labels)
FUSED_DECENT_DP = "Decent-DP fused Adam one-peer ring"
BASE = "allreduce + Adam"  # the row every other is set against


def mlp(seed: int) -> torch.nn.Module:
    """The MLP every rank trains (784-1024-256-10), initialised from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


class _AllReduceAdam:
    """Data parallel: average the gradients with one all_reduce, then Adam."""

    def __init__(self, params, comm: ProcessGroupCommunicator):
        self.params, self.comm = list(params), comm
        self.adam = torch.optim.Adam(self.params, lr=1e-3, fused=True)

    def zero_grad(self):
        self.adam.zero_grad()

    def step(self, loss=None):
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.comm.all_reduce(flat, 0, "gradient all_reduce").div_(self.comm.world_size)
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in self.params])
        self.adam.step()


def _configs(rank: int) -> dict:
    """Every row's ``(model, optimizer)``, in the order of the table."""
    out = {}

    def add(name: str, make_opt) -> None:  # a fresh model of this rank, its optimizer
        model = mlp(rank)
        out[name] = (model, make_opt(model.parameters()))

    def learned(graph, mixing="learned", **options):
        return lambda ps: GossipOptimizer(
            LearnedOptimizer(ps), graph, mixing, metrics_every=0, **options
        )

    def d_adam(graph, **options):
        return lambda ps: dadam(ps, 1e-3, graph, metrics_every=0, **options)

    comm = ProcessGroupCommunicator(get_topology("ring", WORLD))
    add(BASE, lambda ps: _AllReduceAdam(ps, comm))
    for topo in ("ring", "one_peer_ring"):
        graph = get_topology(topo, WORLD)
        for overlap in (False, True):
            suffix = f" {topo}" + (" overlap" if overlap else "")
            add("D-Adam" + suffix, d_adam(graph, overlap=overlap))
            add("learned + learned mixing" + suffix, learned(graph, overlap=overlap))
    # robust mixing when nobody attacks (a ring: one neighbour has nothing to clip
    # against), the distances compiled, then eager (as before their kernel is built)
    graph = get_topology("ring", WORLD)
    for suffix in ("", ", eager distances"):
        robust = {"overlap": True, "robust": "clip"}
        add("D-Adam ring overlap, robust clip" + suffix, d_adam(graph, **robust))
        name = "learned + learned mixing ring overlap, robust clip" + suffix
        add(name, learned(graph, **robust))
        if suffix:
            for row in ("D-Adam ring overlap, robust clip" + suffix, name):
                out[row][1].communicator.distances = Distances(compile=False)
    graph = get_topology("one_peer_ring", WORLD)
    # the price of a per-step deadline for stragglers (store round trips, waiting threads)
    add("D-Adam one_peer_ring deadline", d_adam(graph, step_deadline=10.0))
    # where the learned configuration's time goes: its optimizer, or its mixing
    add("learned + Metropolis one_peer_ring overlap", learned(graph, "metropolis", overlap=True))
    # the shared moments in one exchange of every k (the default k = 2: the plain row above)
    sharing = {
        "state every 1": {"share_state_every": 1},
        "state every 4": {"share_state_every": 4},
        "no shared state": {"share_state": False},
    }
    for label, options in sharing.items():
        name = f"learned + learned mixing one_peer_ring overlap, {label}"
        add(name, learned(graph, overlap=True, **options))
    net = out[name][1].local.optimizer.net  # the shipped mixing network, as the rows above
    add(
        "Adam + learned mixing one_peer_ring overlap",
        lambda ps: GossipOptimizer(
            torch.optim.Adam(ps, lr=1e-3, fused=True),
            graph,
            "learned",
            overlap=True,
            net=net,
            metrics_every=0,
        ),
    )
    for fused, label in ((False, "Decent-DP Adam one-peer ring"), (True, FUSED_DECENT_DP)):
        peer, _ = decent_dp(lambda: mlp(rank), WORLD, fused)
        if peer is not None:
            out[label] = (peer, DecentDPStep())
    return out


def selected(name: str, only: tuple[str, ...]) -> bool:
    """Whether ``--only`` (its texts ``only``) times the row ``name``: all-reduce always."""
    return not only or name == BASE or any(text in name for text in only)


def _bench(rank: int, world: int, rounds: int, steps: int, only: tuple[str, ...] = ()) -> dict:
    configs = {name: cfg for name, cfg in _configs(rank).items() if selected(name, only)}
    gen = torch.Generator().manual_seed(rank)
    # a pool of random batches, cycled: trained on one fixed batch, a model that fits it
    # (the learned rule does, within the rounds) gets gradients of about 1e-38, and its
    # backward pass on those subnormal numbers took 10x longer
    xs = torch.randn(POOL, BATCH, 784, generator=gen)
    ys = torch.randint(0, 10, (POOL, BATCH), generator=gen)
    turn = {}

    def train_step(model, opt):
        k = turn[id(model)] = (turn.get(id(model), -1) + 1) % POOL
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[k]), ys[k])
        loss.backward()
        opt.step(loss=loss.detach())

    # queue the learned step's and the robust distances' compiles, then time their kernels
    with compile_after_seconds(0):
        for _ in range(2 * COMPILE_AFTER + 2):
            for model, opt in configs.values():
                train_step(model, opt)
    for _, opt in configs.values():
        inner = getattr(getattr(opt, "local", None), "optimizer", None)
        if isinstance(inner, LearnedOptimizer) and not inner.wait_compiled(timeout=900):
            raise SystemExit(f"rank {rank}: the learned step's kernel did not compile in 900 s")
        distances = getattr(getattr(opt, "communicator", None), "distances", None)
        if distances is not None and distances.compile and not distances.wait(timeout=900):
            raise SystemExit(f"rank {rank}: the robust distances did not compile in 900 s")
    out = {}
    for name, ms in time_in_turns(configs, train_step, rounds, steps).items():
        med = torch.tensor([ms], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        out[name] = float(med)
    for _, opt in configs.values():
        if isinstance(opt, GossipOptimizer):
            opt.flush()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8,
                        help="steps per configuration per round (a multiple of 4)")  # fmt: skip
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="time only the rows whose names contain TEXT (repeatable), "
                        f"and '{BASE}'")  # fmt: skip
    parser.add_argument("--out", default="gossip_step",
                        help="results/<OUT>.json, or a path ending in .json")  # fmt: skip
    args = parser.parse_args()
    if args.steps < 4 or args.steps % 4:
        parser.error(f"--steps must be a positive multiple of 4, got {args.steps}")
    load = os.getloadavg()[0]
    res = launch_local(
        _bench, WORLD, args.rounds, args.steps, tuple(args.only), timeout=1800, pg_timeout=120
    )[0]
    base = res[BASE]
    results = {
        **gossip_run_info(
            " ".join(["OMP_NUM_THREADS=1 python benchmarks/gossip_step.py", *sys.argv[1:]]),
            load,
            "at start",
        ),
        "setup": f"{WORLD} ranks, MLP 784-1024-256-10 (1,068,810 parameters), batch {BATCH}, "
        f"median over {args.rounds} rounds of the mean of {args.steps} steps per configuration, "
        "taking turns",
        "step_ms": res,
        "vs_allreduce": {k: v / base for k, v in res.items()},
    }
    # robust mixing when nobody attacks: its share of the full step (issue target: <= 5%)
    robust = {}
    for name in ("D-Adam ring overlap", "learned + learned mixing ring overlap"):
        for suffix in (", robust clip", ", robust clip, eager distances"):
            if name in res and name + suffix in res:
                robust[name + suffix.replace(", robust clip", "")] = (
                    res[name + suffix] / res[name] - 1
                )
    results["robust_overhead"] = robust
    peer = res.get("Decent-DP Adam one-peer ring")
    if peer is not None:
        results["vs_decent_dp"] = {k: v / peer for k, v in res.items()}
    fused_peer = res.get(FUSED_DECENT_DP)
    if fused_peer is not None:  # the engines alone: the same fused Adam on both sides
        results["vs_decent_dp_fused"] = {k: v / fused_peer for k, v in res.items()}
    for name, ms in res.items():
        print(f"{name:<32}{ms:>9.1f} ms {ms / base:>6.2f}x")
    out = Path(args.out) if args.out.endswith(".json") else RESULTS.with_name(f"{args.out}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
