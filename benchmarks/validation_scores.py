"""Scores of the validation benchmark (:mod:`benchmarks.validation`): per problem and seed,
over the seeds, and the summary against the issue's targets.

Step speedup: :func:`learned_opt.meta_train.evaluation.speedup` (steps tuned AdamW needs to
reach a loss level / steps the optimizer needs, at the worse of the two best smoothed
levels). Wall-clock speedup: the step speedup times AdamW's ms per step over the
optimizer's, measured side by side. Divergence: :func:`benchmarks.heldout_single.diverged`.
"""

from __future__ import annotations

import statistics

from benchmarks import heldout_decentralized as dec
from benchmarks import heldout_single as single
from learned_opt.meta_train.evaluation import final_loss, speedup

SHORT = 300  # horizons up to this are the "small problems" of the summary
LONG = 1000  # horizons from this on are the "long runs"

#: The issue's targets, recorded beside the measured summary.
TARGETS = {
    "min_speedup": ">= 0.9",
    "median_speedup_short": ">= 1.3",
    "median_speedup_long": ">= 1.3",
    "divergences": "0",
    "decentralized_worse_than_dadam": "0",
}


def r4(x):
    """``x`` rounded to 4 digits (``None`` stays ``None``)."""
    return None if x is None else round(float(x), 4)


def score_seed(best: dict, learned: list[float], anchor_curves: dict, ms: dict | None) -> dict:
    """One seed of a problem: the rule's and each anchor's step speedup over the tuned
    AdamW run ``best`` (:func:`single.best_adamw`), finals, divergence and, with the
    step times ``ms``, wall-clock speedups."""

    def one(curve, name):
        out = {"speedup": speedup(curve, best["curve"]), "final": final_loss(curve),
               "diverged": single.diverged(curve)}  # fmt: skip
        if ms:
            out["wall_speedup"] = out["speedup"] * ms["adamw"] / ms[name]
        return out

    return {"learned": one(learned, "learned"),
            "anchors": {a: one(c, a) for a, c in anchor_curves.items()}}  # fmt: skip


def merge(scored: list[dict]) -> dict:
    """Per-seed scores of one optimizer as one: median speedups, any divergence, the
    first seed's final loss, and the per-seed step speedups."""
    out = {"speedup": r4(statistics.median(x["speedup"] for x in scored)),
           "speedup_by_seed": [r4(x["speedup"]) for x in scored],
           "final": r4(scored[0]["final"]), "diverged": any(x["diverged"] for x in scored)}  # fmt: skip
    if all("wall_speedup" in x for x in scored):
        out["wall_speedup"] = r4(statistics.median(x["wall_speedup"] for x in scored))
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return r4(statistics.median(xs)) if xs else None


def summarise(single_rows: list[dict], dec_rows: list[dict]) -> dict:
    """The issue's criteria on the validation family, and each anchor's median."""
    sp = [r["learned"]["speedup"] for r in single_rows]
    by_h = lambda keep: [r["learned"]["speedup"] for r in single_rows if keep(r["horizon"])]  # noqa: E731
    names = sorted({a for r in single_rows for a in r["anchors"]})
    return {
        "median_speedup": _median(sp),
        "median_speedup_short": _median(by_h(lambda h: h <= SHORT)),
        "median_speedup_long": _median(by_h(lambda h: h >= LONG)),
        "min_speedup": min(sp) if sp else None,
        "rows_below_0.9": [f"{r['task']}@{r['horizon']}" for r in single_rows
                           if r["learned"]["speedup"] < 0.9],  # fmt: skip
        "divergences": sum(r["learned"]["diverged"] for r in single_rows),
        "median_wall_speedup": _median([r["learned"].get("wall_speedup") for r in single_rows]),
        "anchors_median_speedup": {
            a: _median([r["anchors"][a]["speedup"] for r in single_rows if a in r["anchors"]])
            for a in names
        },
        "anchors_divergences": {
            a: sum(r["anchors"][a]["diverged"] for r in single_rows if a in r["anchors"])
            for a in names
        },
        "median_speedup_decentralized": _median([r["speedup"] for r in dec_rows]),
        "min_speedup_decentralized": min((r["speedup"] for r in dec_rows), default=None),
        "divergences_decentralized": sum(r["diverged"] for r in dec_rows),
        "decentralized_worse_than_dadam": sum(r["worse_than_dadam"] for r in dec_rows),
        "single_rows": len(single_rows),
        "decentralized_rows": len(dec_rows),
    }  # fmt: skip


def dec_row(setting: dict, learned: dict, baselines: dict) -> dict:
    """A decentralized row: :func:`dec.score` and whether the averaged model ended worse
    than tuned D-Adam's or diverged."""
    s = dec.score(learned, baselines)
    return {
        **{k: setting[k] for k in ("task", "workers", "topology", "partition", "alpha")},
        "speedup": r4(s["speedup"]), "speedup_vs": {k: r4(v) for k, v in s["speedup_vs"].items()},
        "best_baseline": s["best_baseline"], "learned_final": r4(s["learned_final"]),
        "baseline_finals": {k: r4(v["final"]) for k, v in s["baselines"].items()},
        "baseline_lrs": {k: v["lr"] for k, v in s["baselines"].items()},
        "diverged": single.diverged(learned["curve"]),
        "worse_than_dadam": not s["learned_final"] <= s["baselines"]["D-Adam"]["final"],
        # sampled ranks: the averaged model's loss on the whole training set as well
        **({"population_final": r4(learned["population_final"])}
           if "population_final" in learned else {}),
    }  # fmt: skip
