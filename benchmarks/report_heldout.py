"""Renderers of the held-out suite's sections (see ``report.py``): its tables, the front page's
headline, a checkpoint's rows for its model card, and the zero-tuning anchors beside them."""

from __future__ import annotations

import json
import statistics

from benchmarks.report_sections import (
    RESULTS,
    SCHEDULE_PHRASES,
    _f,
    _measured,
    _x,
    markdown_table,
    section,
    seeds_phrase,
)

# The held-out suite


def _pair(row: dict | None) -> str:
    if row is None:
        return "-"
    wall = row.get("wall_speedup")
    flag = " (diverged)" if row.get("diverged") else ""
    seeds = row.get("speedup_by_seed", [])
    each = f" ({', '.join(f'{x:.2f}' for x in seeds)})" if len(seeds) > 1 else ""
    return f"{_x(row['speedup'])} / {_x(wall) if wall is not None else '-'}{each}{flag}"


def _mult(row: dict, m: str) -> str:
    r = row["lr_mult"].get(m)
    if r is None:
        return "-"
    return "diverged" if r["diverged"] else _x(r["speedup"])


def _single_table(r: dict) -> str:
    sides = r["sides"]
    by = {(x["task"], x["horizon"], x["side"]): x for x in r["single"]}
    keys = sorted({(x["task"], x["horizon"]) for x in r["single"]}, key=lambda k: (k[0], k[1]))
    header = ["task", "params", "steps", "tuned AdamW (lr, schedule)", "final loss ours / AdamW"]
    header += [f"`{s}` speedup steps / wall" for s in sides]
    header += [f"`{sides[0]}` at lr x0.3", "at lr x3"]
    rows = []
    for task, h in keys:
        first = by.get((task, h, sides[0])) or next(by[(task, h, s)] for s in sides
                                                    if (task, h, s) in by)  # fmt: skip
        a = first["adamw"]
        rows.append(
            [task.removeprefix("heldout_"), f"{first['num_params']:,}", h,
             f"{a['lr']:g}, {a['schedule']}", f"{_f(first['learned_final'])} / {_f(a['final'])}"]
            + [_pair(by.get((task, h, s))) for s in sides]
            + [_mult(first, "0.3"), _mult(first, "3")]
        )  # fmt: skip
    return markdown_table(header, rows)


def _decentralized_table(r: dict) -> str:
    sides = [s for s in r["sides"] if any(x["side"] == s for x in r["decentralized"])]
    groups: dict = {}
    for x in r["decentralized"]:
        key = (x["task"], x["workers"], x["topology"], x["alpha"], x["horizon"])
        groups.setdefault(key, {})[x["side"]] = x
    header = ["task", "workers", "topology", "Dirichlet alpha", "steps", "best tuned (lr)",
              "avg-model loss ours / best"] + [f"`{s}` speedup steps / wall" for s in sides]  # fmt: skip
    rows = []
    for (task, w, topo, alpha, h), per in groups.items():
        first = per.get(sides[0]) or next(iter(per.values()))
        best = first["best_baseline"]
        b = first["baselines"][best]
        rows.append(
            [task.removeprefix("heldout_"), w, topo, alpha, h, f"{best} ({b['lr']:g})",
             f"{_f(first['learned_final'])} / {_f(b['final'])}"]
            + [_pair(per.get(s)) for s in sides]
        )  # fmt: skip
    return markdown_table(header, rows)


def _summary_line(side: str, s: dict) -> str:
    def num(v):
        return "-" if v is None else _x(v)

    below = ", ".join(s["rows_below_0.8"]) or "none"
    if "rule" in s:  # the headline: the shipped default
        side = (
            f"**The shipped default** (`LearnedOptimizer()`: `{s['rule']}`, alone and under gossip)"
        )
    else:
        side = f"`{side}`"
    return (
        f"{side}: median speedup **{num(s['median_speedup_single'])}** single-worker "
        f"(wall clock {num(s['median_wall_speedup_single'])}), "
        f"**{num(s['median_speedup_decentralized'])}** decentralized (wall clock "
        f"{num(s['median_wall_speedup_decentralized'])}); minimum {num(s['min_speedup'])} "
        f"(rows below 0.8x: {below}); divergences {s['divergences']}; lr multipliers 0.3 and "
        f"3 within 2x of the default's speedup: {s['lr_mult_within_2x']}."
    )


def _seeds(r: dict) -> str:
    """How the rows were taken over the result's seeds."""
    if len(r["seeds"]) == 1:
        return f"Seed {r['seeds'][0]}."
    return (
        f"Every row, single-worker and decentralized: {seeds_phrase(r['seeds'])}, each seed's "
        "step speedup in brackets (the lr-multiplier columns: medians too; the step "
        f"times behind the wall-clock speedups: seed {r.get('timing_seed', 0)}'s); the loss "
        "and best-tuned columns are the first seed's."
    )


@section("quality_heldout")
def render_quality_heldout(r: dict, name: str = "quality_heldout") -> str:
    """The held-out suite's tables and summary of ``results/NAME.json``."""
    partial = ""
    if not r["complete"]:
        exp = r["expected_rows"]
        partial = (
            f"**Partial run: {len(r['single'])} of {exp['single']} single-worker and "
            f"{len(r['decentralized'])} of {exp['decentralized']} decentralized rows measured; "
            "the run was stopped before the rest were measured.** "
        )
    t = r["targets"]
    load = ""
    if "load_average" in r:
        load = (
            f" Mean load average while measuring: {r['load_average']:g} (shared machine: the "
            "step times behind the wall-clock speedups are noisy)."
        )
    lines = [_summary_line(side, s) for side, s in r["summaries"].items()]
    if "rule" in r["summary"] and len(r["summaries"]) > 1:
        lines.insert(0, _summary_line(r["summary"]["side"], r["summary"]))
    summaries = "\n".join(f"- {line}" for line in lines)
    decentralized = ""
    if r["decentralized"] or r["expected_rows"]["decentralized"]:  # none: factories alone
        decentralized = (
            "\n\nDecentralized (simulated workers, label-skewed data), learned optimizer with "
            "learned mixing against the best of D-SGD, D-Adam and DSGT, each Metropolis-mixed "
            "and tuned per setting; scored on the averaged model's loss on the whole training "
            "set:\n\n" + _decentralized_table(r)
        )
    return (
        "Single worker, against AdamW tuned per task and horizon:\n\n"
        + _single_table(r)
        + decentralized
        + f"\n\n{summaries}\n\n{partial}Targets: median {t['median_speedup_single']} single "
        f"and {t['median_speedup_decentralized']} decentralized, minimum "
        f"{t['min_speedup']}, {t['divergences']} divergences. Speedup = steps the tuned "
        "baseline needs to reach a loss level / steps ours needs, at the worse of the two "
        "best smoothed levels (below 1: slower); wall = that times the ratio of step times "
        "(forward, backward and optimizer; for the decentralized rows one simulated step of "
        "all workers in one process, learned mixing included), measured side by side. AdamW "
        f"grid {', '.join(f'{x:g}' for x in r['adamw_grid'])} (extended at an edge), each "
        "constant and cosine; ours untuned (lr multiplier 1; the x0.3 and x3 columns are its "
        f"step speedups at those multipliers)"
        f"{SCHEDULE_PHRASES.get(r.get('schedule', 'constant'), '')}. A run diverged if its loss went non-finite or "
        f"ended above its start. {_seeds(r)} {_measured(r)}{load} Wall time "
        f"{r['wall_seconds'] / 60:.0f} min (runs found in the caches not counted). Command: "
        f"`{r['command']}`. Plot: "
        f"`benchmarks/results/{name}.png`."
    )


def _step_costs(single: list[dict], dec: list[dict]) -> str:
    """The median time of the learned training step over the (best) baseline's, as a
    sentence."""

    def median(rows, base) -> float | None:
        ratios = [x["ms_per_step"]["learned"] / x["ms_per_step"][base(x)]
                  for x in rows if x.get("ms_per_step")]  # fmt: skip
        return statistics.median(ratios) if ratios else None

    parts = []
    if (one := median(single, lambda x: "adamw")) is not None:
        parts.append(f"{one:.2f} times AdamW's on one worker")
    if (gossip := median(dec, lambda x: x["best_baseline"])) is not None:
        parts.append(f"{gossip:.2f} times the best baseline's under gossip")
    if not parts:
        return ""
    return f"The learned training step took a median {' and '.join(parts)}. "


@section("quality_heldout:headline")
def render_headline(r: dict) -> str:
    """The front page's one table: the shipped default against what users would pick (a
    run of one side only: that side, alone and under gossip)."""
    s = r["summary"]
    rule = s.get("rule", s["side"])

    def lowest(rows: list[dict]) -> str:
        return _x(min(x["speedup"] for x in rows)) if rows else "-"

    single = [x for x in r["single"] if x["side"] == rule]
    dec = [x for x in r["decentralized"] if x["side"] == rule]
    header = ["shipped rule", "compared with", "settings", "median speedup in steps",
              "median speedup in wall-clock time", "lowest setting (steps)"]  # fmt: skip
    rows = [
        [f"one worker (`{rule}`)", "AdamW, lr and schedule tuned per task",
         len(single), f"**{_x(s['median_speedup_single'])}**",
         _x(s["median_wall_speedup_single"]), lowest(single)],
        [f"gossip workers (`{rule}`)",
         "best of D-SGD, D-Adam, DSGT, each tuned", len(dec),
         f"**{_x(s['median_speedup_decentralized'])}**",
         _x(s["median_wall_speedup_decentralized"]), lowest(dec)],
    ]  # fmt: skip
    return (
        markdown_table(header, rows)
        + f"\n\nFive held-out tasks never seen in meta-training, {seeds_phrase(r['seeds'])}; "
        f"divergences: {s['divergences']}. Speedup: steps the tuned baseline needs to reach "
        "a loss level divided by the steps ours needs (above 1: faster). Wall-clock time "
        "counts each side's whole training step once the kernel is compiled, so the compile, "
        "and the eager steps before it, are left out (the next line counts them). "
        f"{_step_costs(single, dec)}Measured on "
        f"{r['machine']}, torch {r['torch']}."
    )


section("quality_heldout_wsd_half")(
    lambda r: render_quality_heldout(r, "quality_heldout_wsd_half")
)  # fmt: skip


@section("quality_heldout_wsd_half:headline")
def render_wsd_headline(r: dict) -> str:
    """One line under the headline: the single-worker rule paired with its schedule."""
    s = r["summary"]
    return (
        "With `wsd_schedule` (held, then to 0 over the last half), the single-worker rows: "
        f"median **{_x(s['median_speedup_single'])}** in steps, {_x(s['median_wall_speedup_single'])} "
        f"in wall-clock time, lowest setting {_x(s['min_speedup'])}, divergences "
        f"{s['divergences']} ([table](docs/results.md#the-single-worker-rule-with-wsd_schedule))."
    )


@section("quality_heldout:card")
def render_card_rows(r: dict, side: str) -> str:
    """One checkpoint's rows of the held-out suite, for its model card."""
    single = [x for x in r["single"] if x["side"] == side]
    dec = [x for x in r["decentralized"] if x["side"] == side]
    out = []
    if single:
        header = ["task", "steps", "speedup steps / wall (per seed)", "at lr x0.3", "at lr x3"]
        rows = [[x["task"].removeprefix("heldout_"), x["horizon"], _pair(x),
                 _mult(x, "0.3"), _mult(x, "3")] for x in single]  # fmt: skip
        out.append("One worker, against AdamW tuned per task and horizon:\n\n"
                   + markdown_table(header, rows))  # fmt: skip
    if dec:
        header = ["task", "workers", "topology", "Dirichlet alpha", "best tuned baseline",
                  "speedup steps / wall (per seed)"]  # fmt: skip
        rows = [[x["task"].removeprefix("heldout_"), x["workers"], x["topology"], x["alpha"],
                 x["best_baseline"], _pair(x)] for x in dec]  # fmt: skip
        out.append("Gossip workers (learned mixing), against the best tuned of D-SGD, D-Adam "
                   "and DSGT:\n\n" + markdown_table(header, rows))  # fmt: skip
    out.append(_summary_line(side, r["summaries"][side]))
    out.append(f"{_seeds(r)} {_measured(r)}")
    return "\n\n".join(out)


ANCHOR_NAMES = {
    "schedulefree_adamw": "schedule-free AdamW",
    "prodigy_constant": "Prodigy",
    "prodigy_cosine": "Prodigy with cosine",
    "muon_adamw": "Muon + AdamW",
}


def _current_rule(r: dict) -> dict:
    """``r`` (``heldout_anchors.json``) with the rule's column (and ``rule_date``) read
    afresh from ``quality_heldout.json``: the anchors do not change when the rule does."""
    path = RESULTS / "quality_heldout.json"
    side = r["summary"]["learned_side"]
    if not path.exists():
        return {**r, "rule_date": r.get("date", "?")}
    suite = json.loads(path.read_text())
    learned = {(x["task"], x["horizon"]): x["speedup"] for x in suite["single"]
               if x["side"] == side}  # fmt: skip
    rows = [{**x, "learned": learned.get((x["task"], x["horizon"]))} for x in r["rows"]]
    mine = [x["learned"] for x in rows if x["learned"] is not None]
    median = round(statistics.median(mine), 4) if mine else None
    summary = {**r["summary"], "learned_median_speedup": median}
    return {**r, "rows": rows, "summary": summary, "rule_date": suite.get("date", "?")}


@section("heldout_anchors")
def render_heldout_anchors(r: dict) -> str:
    """The anchors' step speedups on the held-out single-worker rows, beside the rule's."""
    r = _current_rule(r)
    names = list(r["summary"]["median_speedup"])
    side = r["summary"]["learned_side"]
    header = ["task", "steps", f"`{side}`", *(ANCHOR_NAMES.get(a, a) for a in names)]
    rows = [
        [x["task"].removeprefix("heldout_"), x["horizon"],
         "?" if x["learned"] is None else _x(x["learned"]),
         *(_x(x["anchors"][a]) for a in names)]
        for x in r["rows"]
    ]  # fmt: skip
    learned = r["summary"]["learned_median_speedup"]
    rows.append(
        ["**median**", "", "?" if learned is None else f"**{_x(learned)}**",
         *(_x(r["summary"]["median_speedup"][a]) for a in names)]
    )  # fmt: skip
    return (
        markdown_table(header, rows)
        + "\n\nStep speedup against AdamW tuned per task, horizon and seed (the held-out "
        f"suite's grid), {seeds_phrase(r['seeds'])}. Anchors untuned, at their "
        "documentation's settings (`benchmarks/validation_anchors.py`); the rule's column, the median "
        f"over that suite's seeds, from `quality_heldout.json` (measured {r['rule_date']}). "
        f"Anchors: {_measured(r)} Wall time "
        f"{r['wall_seconds'] / 60:.0f} min. Command: `{r['command']}`."
    )


@section("heldout_anchors:headline")
def render_anchors_headline(r: dict) -> str:
    """One line under the headline: the rule against the anchors, in steps."""
    s = _current_rule(r)["summary"]
    others = ", ".join(f"{ANCHOR_NAMES.get(a, a)} {_x(v)}" for a, v in s["median_speedup"].items())
    return (
        f"The optimizers a user would otherwise pick, untuned at their recommended settings, "
        f"on the same single-worker rows (median step speedup against tuned AdamW): {others}; "
        f"`{s['learned_side']}` {_x(s['learned_median_speedup'])} "
        "([table](docs/results.md#zero-tuning-anchors-on-the-held-out-suite))."
    )
