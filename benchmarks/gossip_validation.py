"""Decentralized validation on meta-training-family tasks: choose a rule here, confirm it
on the held-out suite.

A hand-designed constant of the learned optimizer (the step-size ceilings under gossip,
say) chosen by the held-out suite would be fitted to it. This benchmark runs the same
decentralized protocol as the held-out suite (:mod:`benchmarks.heldout_decentralized`:
simulated workers, label-skewed data, learned optimizer + learned mixing against tuned
D-SGD, D-Adam and DSGT, scored on the averaged model's full training-set loss) on tasks of
the meta-training registry only, so that such choices are made on it, and the held-out
suite is run once afterwards to confirm.

Every variant is the checkpoint with some :class:`~learned_opt.config.NetConfig` fields
replaced (``--variant name:field=value,field=value``). Tuned baselines are cached in
``benchmarks/results/gossip_validation_baselines.json``. Writes
``benchmarks/results/gossip_validation.json``.

    python -m benchmarks.gossip_validation --checkpoint adapt_init \\
        --variant base: --variant ceil4:lr_adapt_max_gossip=4
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks import heldout_decentralized as dec
from benchmarks.common import RESULTS, machine, write_json
from learned_opt import load_checkpoint
from learned_opt.meta_train.evaluation import BaselineCache, final_loss, speedup
from learned_opt.meta_train.inner import InnerOptimizer
from learned_opt.tasks import check_not_held_out

CACHE = RESULTS / "gossip_validation_baselines.json"


def _setting(task, workers, topology, alpha, every=1, horizon=200) -> dict:
    return dict(task=task, workers=workers, topology=topology, alpha=alpha,
                horizon=horizon, every=every, seed=0)  # fmt: skip


#: Registry tasks only (checked at start): convex, regression, MLPs, conv nets (one with
#: batch norm), an autoencoder, an L2-regularised linear classifier.
SETTINGS = [
    _setting("logreg_synth", 8, "exponential", 0.3),
    _setting("linreg_diabetes", 16, "torus", 0.1),
    _setting("digits_mlp", 16, "ring", 0.1),
    _setting("wine_mlp", 8, "torus", 1.0),
    _setting("spirals_mlp", 8, "ring", 0.3),
    _setting("digits_cnn", 4, "ring", 0.3, every=5),
    _setting("wine_autoencoder", 8, "torus", 0.3),
    _setting("logreg_wine_l2", 16, "torus", 0.1),
    _setting("digits_cnn_bn", 4, "ring", 0.3, every=5),
]


def parse_variant(text: str) -> tuple[str, dict]:
    """``name:field=value,field=value`` -> ``(name, {field: float})``; ``name:`` is the
    checkpoint as it is."""
    name, _, rest = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r} needs a name before ':'")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {item!r} is not field=value")
        fields[key.strip()] = float(value)
    return name, fields


def learned_run(setting: dict, checkpoint: str, fields: dict) -> dict:
    """The checkpoint (with ``fields`` of its config replaced) with learned mixing."""
    torch.set_num_threads(1)
    net, _ = load_checkpoint(checkpoint)
    cfg = dataclasses.replace(net.config, **fields)
    opt = InnerOptimizer("learned", 1.0, "learned", dict(net.named_parameters()), cfg)
    return dec.run_averaged(setting["task"], opt, setting)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="adapt_init")
    parser.add_argument("--variant", action="append", type=parse_variant, default=[],
                        help="name:field=value,... (repeatable; default: the checkpoint)")
    parser.add_argument("--tasks", nargs="*", help="only the settings of these tasks")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="gossip_validation", help="result name under benchmarks/results")
    args = parser.parse_args(argv)
    variants = dict(args.variant or [("base", {})])
    settings = [s for s in SETTINGS if not args.tasks or s["task"] in args.tasks]
    check_not_held_out([s["task"] for s in settings])
    cache = BaselineCache(CACHE)
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        base_jobs = {
            dec.setting_key(s): pool.submit(dec.baseline_job, s["task"], s)
            for s in settings
            if dec.setting_key(s) not in cache.data
        }
        runs = {
            (name, i): pool.submit(learned_run, s, args.checkpoint, fields)
            for i, s in enumerate(settings)
            for name, fields in variants.items()
        }
        for key, job in base_jobs.items():
            cache.get(key, job.result)
            print(f"baselines {key}: {job.result()['seconds']} s", flush=True)
        rows = []
        for (name, i), job in runs.items():
            s, out = settings[i], job.result()
            base = {k: v for k, v in cache.data[dec.setting_key(s)].items() if k in dec.BASELINES}
            best = min(base, key=lambda k: base[k]["final"])
            row = {
                "variant": name, **{k: s[k] for k in ("task", "workers", "topology", "alpha")},
                "speedup": round(speedup(out["curve"], base[best]["curve"]), 4),
                "best_baseline": best, "baseline_lr": base[best]["lr"],
                "learned_final": final_loss(out["curve"]), "baseline_final": base[best]["final"],
                "learned_consensus": out["consensus"],
            }  # fmt: skip
            rows.append(row)
            print(f"{name:>12} {s['task']:>16} {s['workers']:>2}w {s['topology']:>11} "
                  f"a={s['alpha']}: {row['speedup']:.3f}x vs {best}", flush=True)  # fmt: skip
    summary = {}
    for name in variants:
        got = [r["speedup"] for r in rows if r["variant"] == name]
        summary[name] = {"median": statistics.median(got), "min": min(got),
                         "geomean": statistics.geometric_mean([max(x, 1e-6) for x in got])}  # fmt: skip
        print(f"{name}: median {summary[name]['median']:.3f}x, min {summary[name]['min']:.3f}x, "
              f"geomean {summary[name]['geomean']:.3f}x", flush=True)  # fmt: skip
    write_json(args.out, {
        "benchmark": "gossip_validation", "checkpoint": args.checkpoint,
        "variants": {k: v for k, v in variants.items()}, "summary": summary, "rows": rows,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": "python -m benchmarks.gossip_validation " + " ".join(sys.argv[1:] if argv is None else argv),
        **machine(),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
