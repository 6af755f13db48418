"""The held-out suite's rows and summaries from its runs: each single-worker row against
tuned AdamW and each decentralized row against its tuned baselines, scored per seed and
merged as the medians over the seeds, and the suite's criteria per learned side
(``quality_heldout.py`` runs the suite and writes them)."""

from __future__ import annotations

import statistics

from benchmarks import heldout_decentralized as dec
from benchmarks import heldout_single as single
from benchmarks import rules
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.meta_train.evaluation import final_loss, speedup
from learned_opt.tasks import get_task

TARGETS = {
    "median_speedup_single": ">= 1.3",
    "median_speedup_decentralized": ">= 1.3",
    "min_speedup": ">= 0.8",
    "divergences": "0",
    "lr_mult_within_2x": "all",
}


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def _seed_scores(best: dict, curves: dict, ms: dict | None) -> dict:
    """One seed's scores of a learned side against its tuned AdamW run ``best``: from its
    curves by lr multiplier, and the step times ``ms`` (if measured) for the wall clock."""

    def score(curve):
        return {"speedup": speedup(curve, best["curve"]), "final": final_loss(curve),
                "diverged": rules.diverged(curve)}  # fmt: skip

    out = score(curves[1.0])
    if ms:
        out["wall_speedup"] = out["speedup"] * ms["adamw"] / ms["learned"]
    out["lr_mult"] = {m: score(c) for m, c in curves.items() if m != 1.0 and c is not None}
    return out


def _merge(scored: list[dict]) -> dict:
    """Per-seed :func:`_seed_scores` as one (:func:`dec.over_seeds`), ``diverged`` if any
    seed diverged."""
    merged = dec.over_seeds(scored)
    merged.update(speedup=_r(merged["speedup"]), diverged=any(x["diverged"] for x in scored))
    if "wall_speedup" in merged:
        merged["wall_speedup"] = _r(merged["wall_speedup"])
    return merged


def _single_row(suite, side: str, task: str, h: int, bests: list[dict], runs: list[dict]) -> dict:
    """A side's row of ``task`` at horizon ``h`` over the suite's seeds (the AdamW and loss
    columns: the first seed's)."""
    ms = suite.timing.get((side, task))
    scored = [_seed_scores(best, curves, ms) for best, curves in zip(bests, runs)]
    merged = _merge([{k: v for k, v in x.items() if k != "lr_mult"} for x in scored])
    a = bests[0]
    row = {
        "task": task, "side": side, "horizon": h, "num_params": get_task(task).num_params,
        "adamw": {"lr": a["lr"], "schedule": a["schedule"], "final": a["final"], "grid": a["grid"]},
        "adamw_by_seed": [{"lr": b["lr"], "schedule": b["schedule"]} for b in bests],
        "learned_final": merged.pop("final"), "wall_speedup": None, **merged,
        "seeds": list(suite.seeds), "ms_per_step": ms, "lr_mult": {},
    }  # fmt: skip
    sp = row["speedup"]
    for mult in single.LR_MULTS[1:]:
        if any(mult not in x["lr_mult"] for x in scored):
            continue
        m = _merge([x["lr_mult"][mult] for x in scored])
        row["lr_mult"][f"{mult:g}"] = {
            **m, "ratio_to_default": _r(m["speedup"] / sp) if sp > 0 else None,
            "within_2x": (not m["diverged"]) and m["speedup"] >= 0.5 * sp,
        }  # fmt: skip
    return row


def single_rows(suite) -> tuple[list[dict], dict]:
    """One row per task, horizon and learned side, once every seed of it is in (AdamW's
    grid complete, every learned run done)."""
    rows, panels = [], {}
    for task in suite.tasks:
        for h in suite.horizons(task):
            bests = [single.best_adamw(suite.adamw_runs(task, seed), h) for seed in suite.seeds]
            if any(b is None or not suite.grid_complete(task, h, seed)
                   for b, seed in zip(bests, suite.seeds)):  # fmt: skip
                continue  # a row only once its baselines are fully tuned
            panel = {f"AdamW {bests[0]['schedule']} {bests[0]['lr']:g}": bests[0]["curve"]}
            for side in suite.sides:
                runs = [{m: suite.learned_curve(side, task, m, h, seed) for m in single.LR_MULTS}
                        for seed in suite.seeds]  # fmt: skip
                if any(curves[1.0] is None for curves in runs):
                    continue
                rows.append(_single_row(suite, side, task, h, bests, runs))
                panel[side] = runs[0][1.0]
            panels[f"{task} @{h}"] = panel
    return rows, panels


def decentralized_rows(suite) -> tuple[list[dict], dict]:
    """One row per decentralized setting and checkpoint, once every seed of it is in, each
    seed against its own tuned baselines."""
    groups: dict = {}
    for s in suite.settings:
        key = tuple(s[k] for k in SETTING_FIELDS)
        groups.setdefault(key, []).append(s)
    rows, panels = [], {}
    for key, seeds in groups.items():
        s0 = seeds[0]
        bases = [suite.cache.data.get(dec.setting_key(s)) for s in seeds]
        if any(b is None for b in bases):
            continue
        title = f"{s0['task']} {s0['workers']}w {s0['topology']} a={s0['alpha']} @{s0['horizon']}"
        for side in suite.checkpoints:
            learned = [suite.dec_learned.get((side, dec.setting_key(s))) for s in seeds]
            if any(run is None for run in learned):
                continue
            scored = [{**dec.score(run, base), "diverged": rules.diverged(run["curve"])}
                      for run, base in zip(learned, bases)]  # fmt: skip
            row = {**dict(zip(SETTING_FIELDS, key)), "side": side, **_merge(scored),
                   "seeds": [s["seed"] for s in seeds]}  # fmt: skip
            rows.append(row)
            best = scored[0]["best_baseline"]
            label = f"{best} {bases[0][best]['lr']:g}"
            panels.setdefault(title, {label: bases[0][best]["curve"]})
            panels[title][side] = learned[0]["curve"]
    return rows, panels


#: What identifies a decentralized setting apart from its seed.
SETTING_FIELDS = ("task", "workers", "topology", "alpha", "horizon")


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return _r(statistics.median(xs)) if xs else None


def summarise(side: str, singles: list[dict], decs: list[dict]) -> dict:
    """The issue's criteria for one learned side (its single-worker and decentralized
    rows); ``divergences`` counts the rows and lr-multiplier entries that diverged at some
    seed."""
    s = [r for r in singles if r["side"] == side]
    d = [r for r in decs if r["side"] == side]
    mults = [m for r in s for m in r["lr_mult"].values()]
    speeds = [r["speedup"] for r in s + d]
    return {
        "median_speedup_single": _median([r["speedup"] for r in s]),
        "median_speedup_decentralized": _median([r["speedup"] for r in d]),
        "min_speedup": min(speeds) if speeds else None,
        "divergences": sum(r["diverged"] for r in s + d) + sum(m["diverged"] for m in mults),
        "median_wall_speedup_single": _median([r["wall_speedup"] for r in s]),
        "median_wall_speedup_decentralized": _median([r["wall_speedup"] for r in d]),
        "rows_below_0.8": [
            f"{r['task']}@{r['horizon']}" + (f" {r['workers']}w" if "workers" in r else "")
            for r in s + d
            if r["speedup"] < 0.8
        ],  # fmt: skip
        "lr_mult_within_2x": f"{sum(m['within_2x'] for m in mults)}/{len(mults)}",
        "single_rows": len(s),
        "decentralized_rows": len(d),
    }


def headline(sides: list[str], singles: list[dict], decs: list[dict]) -> dict:
    """The top-level summary: the shipped default of ``LearnedOptimizer()``
    (:data:`~learned_opt.checkpoint.DEFAULT_CHECKPOINT`, one rule alone and under gossip)
    when it was measured, else the first learned side."""
    if DEFAULT_CHECKPOINT in sides:
        parts = {"side": "shipped default", "rule": DEFAULT_CHECKPOINT}
        return {**parts, **summarise(DEFAULT_CHECKPOINT, singles, decs)}
    return {"side": sides[0], **summarise(sides[0], singles, decs)}
