"""Local steps with a compressed outer exchange against exact per-step gossip.

Run: ``OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.local_steps`` (``--quick``: a
smoke run to ``local_steps_quick.json``). Writes ``benchmarks/results/local_steps.json``.

The held-out decentralized suite's simulator and settings (Dirichlet label skew, 200 steps,
seed 0); the inner optimizer is Adam at the rate tuned for D-Adam on each setting. Exact
gossip (D-Adam every step) against ``H`` local steps between rounds of
:class:`~learned_opt.distributed.local_steps.SimulatedLocalSteps` (outer Nesterov SGD, the
shipped learned optimizer, or plain SGD at lr 1; top-k with error feedback). Scored: the
averaged model's final loss on the whole training set, and the bytes each rank sent.
Target (issue 33): at least 100x fewer bytes, loss ratio at most 1.05. ``H``, density and
outer rates are chosen over :data:`GRID` on the validation settings (:data:`VALIDATION`)
before any held-out run, which then runs the chosen variants, ``H`` at the chosen density,
and the *frontier*: at each reduction of :data:`FRONTIER`, the best validation variant.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks import heldout_decentralized as dec
from benchmarks.common import RESULTS, Cache, command_line, machine, write_json
from benchmarks.quality_heldout import CACHE as HELDOUT_CACHE
from benchmarks.quality_heldout import DEC_FULL
from learned_opt import LearnedOptimizer, load_checkpoint
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.distributed.local_steps import SimulatedLocalSteps, nesterov
from learned_opt.distributed.topology import get_topology
from learned_opt.meta_train.inner import (
    InnerOptimizer,
    consensus_distance,
    inner_step,
    new_trajectory,
)
from learned_opt.tasks import check_not_held_out, get_task

#: Targets of the issue: bytes reduction against exact gossip, and loss ratio.
BYTES_TARGET, LOSS_TARGET = 100.0, 1.05
#: Validation settings the choice is made on (tasks of the meta-training registry).
VALIDATION = [
    dict(task=task, workers=workers, topology=topology, alpha=alpha, horizon=200, every=every,
         seed=0)
    for task, workers, topology, alpha, every in (
        ("digits_mlp", 16, "ring", 0.1, 1), ("wine_autoencoder", 8, "torus", 0.3, 1),
        ("logreg_wine_l2", 16, "torus", 0.1, 1), ("digits_cnn", 4, "ring", 0.3, 5),
    )
]  # fmt: skip
#: Tuned D-Adam runs of the validation settings (the inner rate of each).
VALIDATION_CACHE = RESULTS / "local_steps_baselines.json.gz"
#: The choice grid: local steps, top-k density, outer Nesterov lr, outer learned
#: multiplier; and the local steps of the plain outer rule, SGD at lr 1 (the anchor moves
#: by the tracked mean pseudo-gradient: the ranks' average, as FedAvg's; at ``H = 1``
#: compressed per-step gossip with gradient tracking).
GRID = {"H": (2, 4, 16, 32), "density": (0.01, 0.02, 0.05, 0.1), "nesterov_lr": (0.3, 0.7),
        "learned_lr": (0.3, 1.0), "sgd_H": (1, 2, 4)}  # fmt: skip
#: Outer rules, in the order they are chosen and reported.
OUTERS = ("nesterov", "learned", "sgd")
#: Bytes reductions at which the frontier records the best validation variant.
FRONTIER = (5.0, 10.0, 30.0, 100.0)
#: Inner Adam rate where no tuned D-Adam rate is cached.
FALLBACK_LR = 0.03


def inner_lr(setting: dict, cache: Cache) -> float:
    """The setting's tuned D-Adam rate (or :data:`FALLBACK_LR`)."""
    entry = cache.data.get(dec.setting_key(setting))
    return float(entry["D-Adam"]["lr"]) if entry else FALLBACK_LR


def exact_bytes(task, setting: dict) -> float:
    """Bytes per rank of exact per-step gossip: float32 parameters to every neighbour."""
    topo = get_topology(setting["topology"], setting["workers"])
    params = sum(t.numel() for t in task.init(torch.Generator().manual_seed(0)).values())
    degree = statistics.mean(topo.degree(i) for i in range(topo.world_size))
    return setting["horizon"] * degree * 4 * params


_NET = {}


def outer_factory(kind: str, lr: float):
    if kind == "nesterov":
        return nesterov(lr)
    if kind == "sgd":
        return lambda anchors: torch.optim.SGD(anchors, lr=lr)
    if kind != "learned":
        raise ValueError(f"unknown outer rule {kind!r}")
    if "net" not in _NET:
        _NET["net"] = load_checkpoint(DEFAULT_CHECKPOINT)[0]
    return lambda anchors: LearnedOptimizer(anchors, net=_NET["net"], lr=lr, compile=False)


@torch.no_grad()
def run(setting: dict, lr: float, variant: dict | None) -> dict:
    """One run: exact per-step D-Adam gossip (``variant`` None) or local steps
    (``variant``: H, density, outer, outer_lr). Scored at the end."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    task = get_task(setting["task"])
    steps = setting["horizon"]
    traj = new_trajectory(task, setting["workers"], setting["topology"], dec.partition_of(setting),
                          setting["alpha"], setting.get("seed", 0), steps)  # fmt: skip
    opt = InnerOptimizer("adam", lr, "metropolis" if variant is None else "none")
    sim = None
    if variant is not None:
        sim = SimulatedLocalSteps(
            traj.tensors(), outer_factory(variant["outer"], variant["outer_lr"]),
            local_steps=variant["H"], topology=get_topology(setting["topology"], setting["workers"]),
            compression=f"topk:{variant['density']}", tracking=variant.get("tracking", True),
        )  # fmt: skip
    diverged = False
    for _ in range(steps):
        losses, _ = inner_step(traj, opt)
        if not bool(torch.isfinite(losses).all()):
            diverged = True
            break
        if sim is not None:
            sim.step(traj.tensors())
    if sim is not None and not diverged and sim.count % sim.local_steps:
        sim.round(traj.tensors())  # a last, shorter round
    final = math.inf if diverged else dec.averaged_train_loss(task, traj)
    sent = exact_bytes(task, setting) if sim is None else sim.bytes_per_rank
    return {"final": final, "bytes_per_rank": sent, "consensus": consensus_distance(traj),
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def label(v: dict) -> str:
    return f"H={v['H']} topk:{v['density']} {v['outer']} lr={v['outer_lr']}"


def compare(setting: dict, exact: dict, v: dict, got: dict) -> dict:
    """A variant's row, side by side with the exact run."""
    ratio = got["final"] / exact["final"] if exact["final"] > 0 else math.inf
    reduction = exact["bytes_per_rank"] / got["bytes_per_rank"]
    return {
        **{k: setting[k] for k in ("task", "workers", "topology", "alpha")},
        **v, "final": got["final"], "exact_final": exact["final"], "loss_ratio": ratio,
        "bytes_per_rank": got["bytes_per_rank"], "exact_bytes_per_rank": exact["bytes_per_rank"],
        "bytes_reduction_x": reduction, "consensus": got["consensus"],
        "passes": bool(reduction >= BYTES_TARGET and ratio <= LOSS_TARGET),
        "seconds": got["seconds"],
    }  # fmt: skip


def sweep(pool, settings: list[dict], cache: Cache, variants: list[dict]) -> list[dict]:
    """Exact run and every variant on every setting; one row per (setting, variant)."""
    jobs = {}
    for i, s in enumerate(settings):
        lr = inner_lr(s, cache)
        jobs[i, None] = pool.submit(run, s, lr, None)
        for k, v in enumerate(variants):
            jobs[i, k] = pool.submit(run, s, lr, v)
    rows = []
    for i, s in enumerate(settings):
        exact = jobs[i, None].result()
        for k, v in enumerate(variants):
            row = compare(s, exact, v, jobs[i, k].result())
            row["inner_lr"] = inner_lr(s, cache)
            rows.append(row)
            print(f"{s['task']:>20} {s['workers']:>2}w {s['topology']:>11} {label(v):<36} "
                  f"loss {row['final']:.4g} ({row['loss_ratio']:.3f}x exact) bytes "
                  f"{row['bytes_reduction_x']:.0f}x fewer", flush=True)  # fmt: skip
    return rows


def choose(rows: list[dict], outer: str) -> tuple[dict | None, list[dict]]:
    """The ``outer`` variant with the lowest median loss ratio among those sending >=
    :data:`BYTES_TARGET` x fewer bytes on every setting (among all of them when none
    does: ``meets_bytes_target`` False); and the table of all of them."""
    keys = sorted({(r["H"], r["density"], r["outer_lr"]) for r in rows if r["outer"] == outer})
    table = []
    for h, d, olr in keys:
        mine = [r for r in rows if (r["outer"], r["H"], r["density"], r["outer_lr"]) ==
                (outer, h, d, olr)]  # fmt: skip
        table.append({
            "outer": outer, "H": h, "density": d, "outer_lr": olr,
            "median_loss_ratio": statistics.median(r["loss_ratio"] for r in mine),
            "max_loss_ratio": max(r["loss_ratio"] for r in mine),
            "min_bytes_reduction_x": min(r["bytes_reduction_x"] for r in mine),
        })  # fmt: skip
    ok = [t for t in table if t["min_bytes_reduction_x"] >= BYTES_TARGET] or table
    best = min(ok, key=lambda t: (t["median_loss_ratio"], t["max_loss_ratio"]), default=None)
    if best is not None:
        best = {**best, "meets_bytes_target": best["min_bytes_reduction_x"] >= BYTES_TARGET}
    return best, table


def variants_of(grid: dict) -> list[dict]:
    out = []
    for h in grid["H"]:
        for d in grid["density"]:
            out += [dict(H=h, density=d, outer="nesterov", outer_lr=x) for x in grid["nesterov_lr"]]
            out += [dict(H=h, density=d, outer="learned", outer_lr=x) for x in grid["learned_lr"]]
    out += [dict(H=h, density=d, outer="sgd", outer_lr=1.0)
            for h in grid.get("sgd_H", ()) for d in grid["density"]]  # fmt: skip
    return out


def variant(d: dict) -> dict:
    """The variant a row or a validation table entry is about: its ``H``, density, outer
    rule and outer lr."""
    return {k: d[k] for k in ("H", "density", "outer", "outer_lr")}


def frontier(tables: list[dict]) -> list[dict]:
    """Per bytes reduction of :data:`FRONTIER`: the validation variant (any outer rule)
    with the lowest median loss ratio among those sending at least that many times fewer
    bytes on every setting (None where none does)."""
    out = []
    for least in FRONTIER:
        ok = [t for t in tables if t["min_bytes_reduction_x"] >= least]
        best = min(ok, key=lambda t: (t["median_loss_ratio"], t["max_loss_ratio"]), default=None)
        out.append({"min_bytes_reduction_x": least, "best": best})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", default=None, help="result name under benchmarks/results")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    validation, heldout, grid = VALIDATION, DEC_FULL, GRID
    if args.quick:
        validation = [dict(s, horizon=16) for s in VALIDATION if s["task"] == "logreg_wine_l2"]
        heldout = [dict(DEC_FULL[2], horizon=16)]
        grid = {"H": (4,), "density": (0.1,), "nesterov_lr": (0.7,), "learned_lr": (1.0,),
                "sgd_H": (1,)}  # fmt: skip
    check_not_held_out([s["task"] for s in validation])
    out = args.out or ("local_steps_quick" if args.quick else "local_steps")
    payload = {
        "benchmark": "local_steps",
        "targets": {"bytes_reduction_x": BYTES_TARGET, "loss_ratio": LOSS_TARGET},
        "grid": grid,
        "command": command_line(
            "OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.local_steps", argv
        ),
        **machine(),
    }
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = sweep(pool, validation, Cache(VALIDATION_CACHE), variants_of(grid))
        chosen, tables = {}, []
        for outer in OUTERS:
            best, table = choose(rows, outer)
            chosen[outer], tables = best, tables + table
        front = frontier(tables)
        payload["validation"] = {"rows": rows, "table": tables, "chosen": chosen,
                                 "frontier": front}  # fmt: skip
        write_json(out, payload, quiet=True)  # the choice is recorded before any held-out run
        print(f"chosen: {chosen}", flush=True)
        picked = [variant(c) for c in chosen.values() if c is not None]
        extra = []
        if chosen["nesterov"] is not None:  # H at the chosen density, for the record
            c = chosen["nesterov"]
            extra = [variant({**c, "H": h}) for h in grid["H"] if h != c["H"]]
        for f in front:  # the frontier's variants, measured on the held-out settings too
            v = f["best"] and variant(f["best"])
            if v and v not in picked + extra:
                extra.append(v)
        held = sweep(pool, heldout, Cache(HELDOUT_CACHE), picked + extra)
    for row in held:
        row["chosen"] = variant(row) in picked
        row["frontier"] = [f["min_bytes_reduction_x"] for f in front
                           if f["best"] and variant(f["best"]) == variant(row)]  # fmt: skip
    payload["heldout"] = {"rows": held, "summary": {
        o: {"passes": sum(r["passes"] for r in held if r["chosen"] and r["outer"] == o),
            "of": sum(1 for r in held if r["chosen"] and r["outer"] == o)}
        for o in OUTERS}}  # fmt: skip
    payload["wall_seconds"] = round(time.perf_counter() - start, 1)
    write_json(out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
