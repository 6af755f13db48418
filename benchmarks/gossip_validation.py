"""Decentralized validation on meta-training-family tasks: choose a rule here, confirm it
on the held-out suite.

A hand-designed constant of the learned optimizer (the step-size ceilings under gossip,
say) chosen by the held-out suite would be fitted to it. This benchmark runs the same
decentralized protocol as the held-out suite (:mod:`benchmarks.heldout_decentralized`:
simulated workers, label-skewed data, learned optimizer + learned mixing against tuned
D-SGD, D-Adam and DSGT, scored on the averaged model's full training-set loss) on tasks of
the meta-training registry only, so that such choices are made on it, and the held-out
suite is run once afterwards to confirm.

Every side is a checkpoint, optionally with some :class:`~learned_opt.config.NetConfig` (or MixingConfig)
fields replaced (``--side label=checkpoint:field=value,...``); the field
``share_state_every`` is the simulated workers' instead (how often an exchange carries
the shared moments, :class:`~learned_opt.meta_train.inner.InnerOptimizer`). Tuned
baselines are cached in ``benchmarks/results/gossip_validation_baselines.json``. Writes
``benchmarks/results/gossip_validation.json``. With ``--seeds``, each setting runs at every
seed (the baselines tuned per seed) and its row is the median of the seeds' speedups: one
seed's decentralized speedups move by up to 3.5x from seed to seed.

    python -m benchmarks.gossip_validation --side default \\
        --side adapt_init --side adapt_e4=adapt_init:lr_adapt_max_gossip=4 --seeds 0 1 2

``--heldout`` runs the held-out suite's decentralized settings instead
(:data:`benchmarks.quality_heldout.DEC_FULL`, against its cached baselines), for the one
confirmation of a choice made here; a result of it is never a basis for choosing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks import heldout_decentralized as dec
from benchmarks.common import RESULTS, command_line, machine, write_json
from benchmarks.quality_heldout import CACHE as HELDOUT_CACHE
from benchmarks.quality_heldout import DEC_FULL
from learned_opt import load_checkpoint
from learned_opt.meta_train.evaluation import BaselineCache
from learned_opt.meta_train.inner import InnerOptimizer, make_inner_optimizer
from learned_opt.network import with_config
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


def parse_side(text: str) -> tuple[str, str, dict]:
    """``label=checkpoint`` or ``label=checkpoint:field=value,field=value`` ->
    ``(label, checkpoint, {field: value})``, each value a float, or a name (a string, such as
    ``output=adam``); a bare ``checkpoint`` is its own label."""
    label, eq, rest = text.partition("=")
    if not eq:
        label, rest = text, text
    checkpoint, _, overrides = rest.partition(":")
    if not label or not checkpoint:
        raise argparse.ArgumentTypeError(f"side {text!r}: expected label=checkpoint[:f=v,...]")
    fields = {}
    for item in filter(None, overrides.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"side {text!r}: {item!r} is not field=value")
        value = value.strip()
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            if not value.isidentifier():  # a name, for a config field that takes one
                raise argparse.ArgumentTypeError(
                    f"side {text!r}: {value!r} is neither a number nor a name"
                ) from None
            fields[key.strip()] = value
    return label, checkpoint, fields


#: Side fields that set the simulated workers rather than the network's config.
WORKER_FIELDS = {"share_state_every": int}


def side_optimizer(checkpoint: str, fields: dict, mixing: str = "learned") -> InnerOptimizer:
    """The checkpoint's optimizer, ``fields`` of its config (or :data:`WORKER_FIELDS`)
    replaced, with ``mixing`` ("learned", or "none" for a single worker)."""
    worker = {}
    for key, kind in WORKER_FIELDS.items():
        if key in fields:
            value = fields[key]
            if value != kind(value):
                raise ValueError(f"{key} must be a whole number, got {value!r}")
            worker[key] = kind(value)
    config = {k: v for k, v in fields.items() if k not in WORKER_FIELDS}
    net = with_config(load_checkpoint(checkpoint)[0], config)
    return make_inner_optimizer("learned", 1.0, mixing, net, parts=None, **worker)


def learned_run(setting: dict, checkpoint: str, fields: dict) -> dict:
    torch.set_num_threads(1)
    return dec.run_averaged(setting["task"], side_optimizer(checkpoint, fields), setting)


def score_row(label: str, setting: dict, scored: list[tuple[dict, int]]) -> dict:
    """A side's row of one setting from its per-seed :func:`dec.score` results
    (:func:`dec.over_seeds`: the median speedup over the seeds, and the first seed's
    baseline, losses and consensus)."""
    merged = dec.over_seeds([x for x, _ in scored])
    best = merged["best_baseline"]
    row = {
        "side": label, **{k: setting[k] for k in ("task", "workers", "topology", "alpha")},
        "speedup": round(merged["speedup"], 4), "best_baseline": best,
        "baseline_lr": merged["baselines"][best]["lr"],
        "learned_final": merged["learned_final"],
        "baseline_final": merged["baselines"][best]["final"],
        "learned_consensus": merged["learned_consensus"],
    }  # fmt: skip
    if len(scored) > 1:
        row.update(seeds=[seed for _, seed in scored], speedup_by_seed=merged["speedup_by_seed"])
    return row


def summarise(speedups: list[float]) -> dict:
    """Median, minimum and geometric mean (each speedup floored at 1e-6) of a side's rows."""
    return {
        "median": statistics.median(speedups),
        "min": min(speedups),
        "geomean": statistics.geometric_mean([max(x, 1e-6) for x in speedups]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", type=parse_side, default=[],
                        help="label=checkpoint[:field=value,...] (repeatable; default: "
                        "default and adapt_init)")  # fmt: skip
    parser.add_argument("--tasks", nargs="*", help="only the settings of these tasks")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds of every setting; a row is the median over them")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--heldout", action="store_true",
                        help="the held-out suite's decentralized settings instead (to "
                        "confirm a choice once, never to make one)")  # fmt: skip
    parser.add_argument("--out", default="gossip_validation",
                        help="result name under benchmarks/results")  # fmt: skip
    args = parser.parse_args(argv)
    sides = args.side or [parse_side("default"), parse_side("adapt_init")]
    labels = [label for label, _, _ in sides]
    if len(set(labels)) != len(labels):
        parser.error(f"side labels must differ, got {labels}")
    for _, checkpoint, fields in sides:  # fail before any work
        try:
            side_optimizer(checkpoint, fields)
        except (ValueError, TypeError, OSError) as exc:
            parser.error(f"side {checkpoint!r}: {exc}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds repeats a seed: {args.seeds}")
    plan, cache_path = (DEC_FULL, HELDOUT_CACHE) if args.heldout else (SETTINGS, CACHE)
    settings = [s for s in plan if not args.tasks or s["task"] in args.tasks]
    if not settings:
        parser.error(f"no settings for tasks {args.tasks}; valid: {[s['task'] for s in plan]}")
    if not args.heldout:
        check_not_held_out([s["task"] for s in settings])
    cache = BaselineCache(cache_path)
    start = time.perf_counter()
    runs_of = [dict(s, seed=seed) for s in settings for seed in args.seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        base_jobs = {
            dec.setting_key(s): pool.submit(dec.baseline_job, s["task"], s)
            for s in runs_of
            if dec.setting_key(s) not in cache.data
        }
        runs = {
            (label, i): pool.submit(learned_run, s, checkpoint, fields)
            for i, s in enumerate(runs_of)
            for label, checkpoint, fields in sides
        }
        for key, job in base_jobs.items():
            cache.get(key, job.result)
            print(f"baselines {key}: {job.result()['seconds']} s", flush=True)
        rows = []
        for s in settings:
            seeds = [(i, r) for i, r in enumerate(runs_of) if dict(r, seed=s["seed"]) == s]
            for label, _, _ in sides:
                rows.append(score_row(label, s, [
                    (dec.score(runs[label, i].result(), cache.data[dec.setting_key(r)]), r["seed"])
                    for i, r in seeds
                ]))  # fmt: skip
                row = rows[-1]
                print(f"{label:>14} {s['task']:>16} {s['workers']:>2}w {s['topology']:>11} "
                      f"a={s['alpha']}: {row['speedup']:.3f}x vs {row['best_baseline']}"
                      + (f" (seeds {row['speedup_by_seed']})" if len(seeds) > 1 else ""),
                      flush=True)  # fmt: skip
    summary = {label: summarise([r["speedup"] for r in rows if r["side"] == label])
               for label in labels}  # fmt: skip
    for label, got in summary.items():
        print(f"{label}: median {got['median']:.3f}x, min {got['min']:.3f}x, "
              f"geomean {got['geomean']:.3f}x", flush=True)  # fmt: skip
    write_json(args.out, {
        "benchmark": "gossip_validation",
        "sides": [{"label": label, "checkpoint": str(ckpt), "fields": fields}
                  for label, ckpt, fields in sides],
        "suite": "heldout" if args.heldout else "validation",
        "summary": summary, "rows": rows, "horizon": settings[0]["horizon"],
        "seeds": args.seeds,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": command_line("python -m benchmarks.gossip_validation", argv),
        **machine(),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
