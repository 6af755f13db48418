"""Long runs of local steps with a compressed outer step, against exact per-step gossip.

Exact gossip mixes the parameters after every Adam step; the mode
(:mod:`learned_opt.distributed.outer`) takes ``H`` local steps, then one compressed outer
step shared by all ranks, by each outer rule. Scored: the averaged model's test loss and
the bytes each rank sent. ``H``, the compressor and each rule's outer lr are chosen on
:data:`VALIDATION` first (:func:`choose`); :data:`HELDOUT` then runs once. Writes
``local_steps.png`` too: loss against bytes per rank, one panel per held-out setting.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from benchmarks.common import RESULTS, command_line, machine, write_json
from learned_opt.distributed.local_steps import SimulatedLocalSteps
from learned_opt.distributed.outer import OUTER_RULES, OuterStep, outer_rule
from learned_opt.distributed.topology import get_topology
from learned_opt.meta_train.inner import InnerOptimizer, inner_step, new_trajectory
from learned_opt.tasks import get_task

#: Targets of the issue: bytes reduction against exact gossip, loss ratio, and the bytes
#: reduction one setting reaches within the loss ratio.
BYTES_TARGET, LOSS_TARGET, BYTES_STRETCH = 100.0, 1.05, 300.0
#: Adam's rate on every rank, in both arms.
INNER_LR = 3e-3


def _s(task, workers, topology, partition, alpha, horizon, seed):
    return dict(task=task, workers=workers, topology=topology, partition=partition,
                alpha=alpha, horizon=horizon, seed=seed)  # fmt: skip


#: Where the choices are made.
VALIDATION = [
    _s("char_transformer", 4, "ring", "iid", 1.0, 2000, 0),
    _s("digits_cnn", 8, "ring", "dirichlet", 0.3, 2000, 0),
    _s("digits_mlp", 16, "torus", "dirichlet", 0.1, 2000, 0),
]
#: Measured once, after the choice: other tasks, worker counts, topologies and seeds.
HELDOUT = [
    _s("char_transformer", 4, "ring", "iid", 1.0, 2000, 1),
    _s("digits_cnn_bn", 8, "torus", "dirichlet", 0.3, 2000, 1),
    _s("heldout_autoencoder", 16, "ring", "dirichlet", 0.1, 3000, 1),
]
#: The choice grid: local steps and compressors (with :data:`FIRST`), then each rule's lr
#: (the learned rule's 1 is its untuned default, see ``AdaptedOuter``).
GRID = {
    "H": (10, 25),
    "compression": ("topk:0.05:4", "topk:0.02:4"),
    "lr": {"nesterov": (0.1, 0.3, 0.7), "learned": (1.0,), "demo": (1.0,)},
}
#: The rule and lr ``H`` and the compressor are chosen with: DeMo's decoupled momentum, the
#: closest to exact gossip in exploratory runs on the validation LM.
FIRST = ("demo", 1.0)


def exact_bytes(task, setting: dict) -> float:
    """Bytes per rank of exact per-step gossip: float32 parameters to every neighbour."""
    topo = get_topology(setting["topology"], setting["workers"])
    params = sum(t.numel() for t in task.init(torch.Generator().manual_seed(0)).values())
    degree = statistics.mean(topo.degree(i) for i in range(topo.world_size))
    return setting["horizon"] * degree * 4 * params


def _scores(task, traj) -> dict:
    avg = {k: v.mean(0) for k, v in traj.layout.unflatten(traj.params).items()}
    test = task.evaluate(avg, split="test", max_examples=4096)["loss"]
    train = task.evaluate(avg, split="train", max_examples=4096)["loss"]
    return {"final": test if math.isfinite(test) else math.inf, "train_final": train}


@torch.no_grad()
def run(setting: dict, variant: dict | None) -> dict:
    """Exact per-step gossip (``variant`` None) or the mode (``variant``: rule, lr, H,
    compression). Scored at the end."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    task = get_task(setting["task"])
    steps = setting["horizon"]
    traj = new_trajectory(task, setting["workers"], setting["topology"], setting["partition"],
                          setting["alpha"], setting["seed"], steps)  # fmt: skip
    opt = InnerOptimizer("adam", INNER_LR, "metropolis" if variant is None else "none")
    sim = None
    if variant is not None:
        factory, decay = outer_rule(variant["rule"], variant["lr"])
        sim = SimulatedLocalSteps(
            traj.tensors(), factory, kind=OuterStep, local_steps=variant["H"],
            topology=get_topology(setting["topology"], setting["workers"]),
            compression=variant["compression"], decay=decay,
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
        sim.round(traj.tensors())
    scores = {"final": math.inf, "train_final": math.inf} if diverged else _scores(task, traj)
    sent = exact_bytes(task, setting) if sim is None else sim.bytes_per_rank
    return {**scores, "bytes_per_rank": sent, "seconds": round(time.perf_counter() - start, 1)}


def label(v: dict) -> str:
    return f"{v['rule']} lr={v['lr']:g} H={v['H']} {v['compression']}"


def row(setting: dict, exact: dict, v: dict, got: dict) -> dict:
    """A variant's row, side by side with the exact run."""
    ratio = got["final"] / exact["final"] if exact["final"] > 0 else math.inf
    reduction = exact["bytes_per_rank"] / got["bytes_per_rank"]
    return {
        **setting, **v, "final": got["final"], "train_final": got["train_final"],
        "exact_final": exact["final"], "exact_train_final": exact["train_final"],
        "loss_ratio": ratio, "bytes_per_rank": got["bytes_per_rank"],
        "exact_bytes_per_rank": exact["bytes_per_rank"], "bytes_reduction_x": reduction,
        "passes": bool(reduction >= BYTES_TARGET and ratio <= LOSS_TARGET),
        "seconds": got["seconds"],
    }  # fmt: skip


def sweep(settings: list[dict], variants: list[dict], exacts: dict) -> list[dict]:
    """Every variant on every setting (the exact runs cached in ``exacts`` by setting)."""
    rows = []
    for s in settings:
        key = str(sorted(s.items()))
        if key not in exacts:
            exacts[key] = run(s, None)
            print(f"{s['task']:>20} exact: loss {exacts[key]['final']:.4g} "
                  f"({exacts[key]['seconds']} s)", flush=True)  # fmt: skip
        for v in variants:
            r = row(s, exacts[key], v, run(s, v))
            rows.append(r)
            print(f"{s['task']:>20} {s['workers']:>2}w {label(v):<40} loss {r['final']:.4g} "
                  f"({r['loss_ratio']:.3f}x exact) bytes {r['bytes_reduction_x']:.0f}x fewer "
                  f"({r['seconds']} s)", flush=True)  # fmt: skip
    return rows


def choose(rows: list[dict], keys: tuple[str, ...]) -> dict | None:
    """Among the variants (grouped by ``keys``) sending >= :data:`BYTES_TARGET` x fewer
    bytes on every setting, the one with the lowest worst loss ratio (then median)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    table = [{**dict(zip(keys, g)), "max_loss_ratio": max(r["loss_ratio"] for r in rs),
              "median_loss_ratio": statistics.median(r["loss_ratio"] for r in rs),
              "min_bytes_reduction_x": min(r["bytes_reduction_x"] for r in rs)}
             for g, rs in groups.items()]  # fmt: skip
    ok = [t for t in table if t["min_bytes_reduction_x"] >= BYTES_TARGET]
    return min(ok, key=lambda t: (t["max_loss_ratio"], t["median_loss_ratio"]), default=None)


def summary(rows: list[dict], chosen: dict) -> dict:
    """Per rule at the chosen default: settings passing, and whether one reaches the
    stretch target; and the learned rule against Nesterov at the same bytes."""
    out = {}
    for rule in OUTER_RULES:
        mine = [r for r in rows if r["rule"] == rule and r["H"] == chosen["H"]]
        out[rule] = {
            "passes": sum(r["passes"] for r in mine), "of": len(mine),
            "stretch": any(r["bytes_reduction_x"] >= BYTES_STRETCH and r["loss_ratio"] <=
                           LOSS_TARGET for r in rows if r["rule"] == rule),
        }  # fmt: skip
    pairs = [(a, b) for a in rows for b in rows if a["rule"] == "learned" and
             b["rule"] == "nesterov" and a["task"] == b["task"] and a["H"] == b["H"]]  # fmt: skip
    out["learned_vs_nesterov"] = [
        {"task": a["task"], "H": a["H"], "loss_ratio": a["final"] / b["final"]} for a, b in pairs
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", default=None, help="result name under benchmarks/results")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    validation, heldout, grid = VALIDATION, HELDOUT, GRID
    if args.quick:
        validation = [dict(VALIDATION[2], workers=4, topology="ring", horizon=40)]
        heldout = [dict(HELDOUT[2], workers=4, horizon=40)]
        grid = {
            "H": (10, 20),
            "compression": ("topk:0.02:4",),
            "lr": {"nesterov": (0.7,), "learned": (1.0,), "demo": (1.0,)},
        }
    out = args.out or ("local_steps_quick" if args.quick else "local_steps")
    payload = {
        "benchmark": "local_steps",
        "targets": {
            "bytes_reduction_x": BYTES_TARGET,
            "loss_ratio": LOSS_TARGET,
            "stretch_bytes_reduction_x": BYTES_STRETCH,
        },  # fmt: skip
        "inner": {"optimizer": "adam", "lr": INNER_LR},
        "grid": grid,
        "command": command_line(
            "OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.local_steps", argv
        ),  # fmt: skip
        **machine(),
    }
    exacts: dict = {}
    first = [dict(rule=FIRST[0], lr=FIRST[1], H=h, compression=c)
             for h in grid["H"] for c in grid["compression"]]  # fmt: skip
    rows = sweep(validation, first, exacts)
    base = choose(rows, ("H", "compression"))
    if base is None:
        base = min(rows, key=lambda r: r["loss_ratio"])
    second = [dict(rule=rule, lr=lr, H=base["H"], compression=base["compression"])
              for rule, lrs in grid["lr"].items() for lr in lrs
              if (rule, lr) != FIRST]  # fmt: skip
    rows += sweep(validation, second, exacts)
    chosen = {"H": base["H"], "compression": base["compression"]}
    for rule in OUTER_RULES:
        mine = [r for r in rows if r["rule"] == rule and r["H"] == base["H"]
                and r["compression"] == base["compression"]]  # fmt: skip
        best = choose(mine, ("lr",)) or min(mine, key=lambda r: r["loss_ratio"])
        chosen[rule] = {"lr": best["lr"], "max_loss_ratio": best.get("max_loss_ratio")}
    payload["validation"] = {"rows": rows, "chosen": chosen}
    write_json(out, payload, quiet=True)  # the choice is recorded before any held-out run
    print(f"chosen: {chosen}", flush=True)
    held = [dict(rule=rule, lr=chosen[rule]["lr"], H=h, compression=chosen["compression"])
            for rule in OUTER_RULES for h in grid["H"]]  # fmt: skip
    hrows = sweep(heldout, held, exacts)
    payload["heldout"] = {
        "rows": hrows,
        "summary": summary(hrows, chosen),
        "exact": [{**s, **exacts[str(sorted(s.items()))]} for s in heldout],
    }
    payload["wall_seconds"] = round(time.perf_counter() - start, 1)
    write_json(out, payload)
    plot(payload, RESULTS / f"{out}.png")
    return 0


def plot(payload: dict, path) -> None:
    """The held-out frontier: final loss against bytes per rank, one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exact = payload["heldout"]["exact"]
    fig, axes = plt.subplots(1, len(exact), figsize=(4.2 * len(exact), 3.4), squeeze=False)
    for ax, s in zip(axes[0], exact):
        rows = [r for r in payload["heldout"]["rows"] if r["task"] == s["task"]]
        for rule in OUTER_RULES:
            mine = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["bytes_per_rank"])
            ax.plot([r["bytes_per_rank"] for r in mine], [r["final"] for r in mine], "o-",
                    label=f"{rule} (H {', '.join(str(r['H']) for r in mine)})")  # fmt: skip
        ax.plot([s["bytes_per_rank"]], [s["final"]], "k*", ms=10, label="exact gossip")
        ax.axhline(s["final"] * LOSS_TARGET, color="grey", ls=":", lw=1, label="exact +5%")
        ax.set_xscale("log")
        ax.set_yscale("log")  # the learned rule's worst points sit far above the rest
        ax.set_title(f"{s['task']}, {s['workers']} ranks, {s['partition']}", fontsize=9)
        ax.set_xlabel("bytes sent per rank")
        ax.set_ylabel("averaged model's test loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
