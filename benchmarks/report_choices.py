"""Renderers of the sections on how the rule is chosen (see ``report.py``): ``decide`` (the
latest decision, overall and per kind), ``decide:ledger`` (every decision of the ledger),
``report_draw`` (the shipped rule and the anchors per kind) and ``report_draw:headline``; and
the records of the choices made before: the validation family's (``validation_handset_now``)
and the meta-training stages' (``meta_training_stages``)."""

from __future__ import annotations

from benchmarks.decide import KIND_FLOOR, read_ledger
from benchmarks.report_sections import SCHEDULE_PHRASES, _x, markdown_table, section
from benchmarks.rules import ANCHORS

ANCHOR_NAMES = {"sfadamw": "schedule-free AdamW", "prodigy": "Prodigy (cosine)",
                "muon": "Muon + AdamW"}  # fmt: skip


def _interval(s: dict) -> str:
    low, high = s["interval"]
    return f"{s['geomean']:.3f}x [{low:.3f}, {high:.3f}]"


@section("decide")
def decide_table(r: dict) -> str:
    s, t = r["summary"]["steps"], r["summary"]["time"]
    verdict = "ships" if s["ships"] else "does not ship"
    head = (f"`{r['a']}` against `{r['b']}` on {s['n']} fresh draws (seeds {r['first_seed']}-"
            f"{r['first_seed'] + s['n'] - 1}): geometric mean in steps **{_interval(s)}** "
            f"(95 % bootstrap interval), median {s['median']:.2f}x, {s['won']:.0%} of draws won; in "
            f"time {_interval(t)}; divergences {r['summary']['divergences']['a']} against "
            f"{r['summary']['divergences']['b']}. Verdict: **{verdict}** (kinds below "
            f"{KIND_FLOOR}: {', '.join(s['kinds_below_floor']) or 'none'}).")  # fmt: skip
    rows = [[k, v["n"], f"{v['geomean']:.2f}x", f"{t['kinds'][k]['geomean']:.2f}x"]
            for k, v in s["kinds"].items()]  # fmt: skip
    return head + "\n\n" + markdown_table(["kind", "draws", "steps", "time"], rows)


def _pinned(side: str, commit: str | None) -> str:
    """A side as the ledger has it, with ``.`` (the checkout then) named by its commit."""
    if commit and (side == "." or side.startswith(".:")):
        return commit + side[1:]
    return side


@section("decide:ledger")
def ledger_table(_: dict) -> str:
    rows = []
    for e in read_ledger():
        s = e.get("steps")
        outcome = (f"{_interval(s)}; {'ships' if s['ships'] else 'does not ship'}"
                   if s else e["status"])  # fmt: skip
        a, b = (_pinned(e[k], e.get(f"{k}_commit")) for k in "ab")
        rows.append([e["date"], f"`{a}`", f"`{b}`",
                     f"{e['first_seed']}-{e['first_seed'] + e['draws'] - 1}", outcome])  # fmt: skip
    return markdown_table(
        ["date", "A", "B", "seeds", "A over B in steps (interval); verdict"], rows
    )


@section("report_draw")
def report_draw_table(r: dict) -> str:
    s = r["summary"]
    names = ("rule", "time", *ANCHORS)
    header = ["kind", "draws", "shipped rule", "in time",
              *(ANCHOR_NAMES[a] for a in ANCHORS)]  # fmt: skip
    rows = [[k, v["n"], *(f"{v[n]:.2f}x" for n in names)] for k, v in s["kinds"].items()]
    rows.append(["**all**", s["n"], *(f"**{s['geomean'][n]:.2f}x**" for n in names)])
    return markdown_table(header, rows) + (
        f"\n\n{_which_draws(r)}. Geometric mean of the step speedup over AdamW tuned per draw "
        "(6 learning rates x constant or cosine), clipped to [1/20, 20]; a diverged run counts "
        "1/20. *In time*: the step speedup times tuned AdamW's seconds over the rule's, the "
        "two run again side by side, each from its eager step (no compiled kernel; the compile "
        "and the optimizer's own cost are in the rule's seconds)."
    )


def _which_draws(r: dict) -> str:
    n, of = r["summary"]["n"], r.get("of", r["summary"]["n"])
    if n >= of:
        return f"All {of} draws"
    return f"The first {n} of its {of} draws (the rest's baselines are not cached yet)"


@section("report_draw:headline")
def report_draw_headline(r: dict) -> str:
    s = r["summary"]
    anchors = ", ".join(f"{ANCHOR_NAMES[a]} {s['geomean'][a]:.2f}x" for a in ANCHORS)
    n, of = s["n"], r.get("of", s["n"])
    jobs = f"{n} jobs" if n >= of else f"the first {n} of its {of} jobs"
    return (f"On the reporting draw ({jobs}, of 14 kinds, drawn from the task distribution and "
            f"never used for a choice), the shipped rule, untuned, needs a geometric mean of "
            f"**{s['geomean']['rule']:.2f}x** fewer steps than AdamW tuned per job "
            f"(**{s['geomean']['time']:.2f}x** in time, eager steps); it is level or "
            f"ahead on {s['won']:.0%} of the jobs, its worst kind is {s['worst_kind']} "
            f"({s['kinds'][s['worst_kind']]['rule']:.2f}x), divergences {s['divergences']}. "
            f"Untuned anchors: {anchors} "
            f"([per kind](docs/results.md#the-reporting-draw)).")  # fmt: skip


@section("decide:headline")
def decide_headline(r: dict) -> str:
    s = r["summary"]["steps"]
    low, high = s["interval"]
    fallen = ", ".join(s["kinds_below_floor"]) or "none"
    return (f"Every choice of the rule is an A/B on fresh draws of a task distribution of "
            f"{len(r['kinds'])} kinds of training job ([how](docs/guide/choosing.md)). The rule "
            f"shipped now, against the rule before the last round of changes chosen on the fixed "
            f"validation problems: **{s['geomean']:.3f}x** fewer steps [{low:.3f}, {high:.3f}] on "
            f"{s['n']} fresh draws, {'a win' if s['ships'] else 'not a win'}; kinds below "
            f"{KIND_FLOOR}: {fallen} ([decisions](docs/results.md#decisions-on-fresh-draws)).")  # fmt: skip


# The validation family's last record (its script is in git at ``40411a9``)


def _cell(run: dict | None) -> str:
    if run is None:
        return "-"
    return _x(run["speedup"]) + (" (diverged)" if run.get("diverged") else "")


def _single(r: dict) -> str:
    anchors = [a for a in r["anchors"] if any(a in row.get("anchors", {}) for row in r["single"])]
    rows = [
        [row["task"], row["horizon"], row["kind"], _cell(row["learned"]),
         _x(row["learned"].get("wall_speedup"))]
        + [_cell(row.get("anchors", {}).get(a)) for a in anchors]
        for row in r["single"]
    ]  # fmt: skip
    s = r["summary"]
    rows.append(
        ["**median**", "", "", f"**{_x(s['median_speedup'])}**", _x(s["median_wall_speedup"])]
        + [_x(s["anchors_median_speedup"].get(a)) for a in anchors]
    )
    header = ["problem", "steps", "kind", "rule", "rule, wall-clock"] + [f"`{a}`" for a in anchors]
    return markdown_table(header, rows)


@section("validation_handset_now")
def render_validation(r: dict) -> str:
    s = r["summary"]
    side = r["side"]
    fields = ", ".join(f"{k}={v}" for k, v in (side.get("fields") or {}).items())
    summary = (
        f"Small problems (at most 300 steps): median {_x(s['median_speedup_short'])}; runs of"
        f" 1000 steps or more: median {_x(s['median_speedup_long'])}; lowest row"
        f" {_x(s['min_speedup'])}; rows below 0.9x: {', '.join(s['rows_below_0.9']) or 'none'};"
        f" divergences: {s['divergences']}."
    )
    return (
        _single(r)
        + "\n\n"
        + (
            summary
            + f" Step speedup against AdamW tuned per problem and horizon (constant or cosine,"
            f" rates {', '.join(f'{x:g}' for x in r['adamw_grid'])}), the median over seeds"
            f" {', '.join(map(str, r['seeds']))}; anchors at their documented settings, untuned."
            f" Rule: `{side.get('checkpoint', side.get('label'))}`"
            + (f" with {fields}" if fields else "")
            + SCHEDULE_PHRASES.get(r.get("schedule", "constant"), "")
            + f". Measured {r['date']} on {r['machine']}, torch {r['torch']}, commit"
            f" {r['commit']}. Wall time {r['wall_seconds'] / 60:.0f} min. Command:"
            f" `{r['command']}`." + (f" {r['note']}" if r.get("note") else "")
        )
    )


@section("meta_training_stages")
def render_meta_stages(r: dict) -> str:
    """The meta-training stages against the hand-set rule (written by ``benchmarks/meta_stages.py``,
    in git at ``c2adf13``, from the stages' validation records)."""

    def pairs(row: dict) -> str:
        p = row.get("paired") or {}
        if row is r["rows"][0] or not p.get("pairs"):
            return "-"
        return f"{p['geomean']:.2f} ({p['ahead']} / {p['behind']} of {p['pairs']})"

    rows = [
        [f"`{row['rule']}`", row["date"], f"**{_x(row['median'])}**",
         f"{row['times_reference']:.2f}", pairs(row), _x(row["median_short"]),
         _x(row["median_long"]), _x(row["lowest"]), ", ".join(row["below_0.9"]) or "none"]
        for row in r["rows"]
    ]  # fmt: skip
    header = ["rule", "validated", "median", "times the hand-set rule",
              "row by row (ahead / behind)", "small problems", "runs of 1000+ steps",
              "lowest row", "rows below 0.9x"]  # fmt: skip
    verdict = "meets" if r["target_met"] else "does not meet"
    return (
        markdown_table(header, rows)
        + f"\n\nSingle-worker validation family, step speedup against tuned AdamW (the first"
        f" row is the hand-set rule, `{r['reference']}.json`; each stage was validated against"
        f" it at the same code). The best stage, `{r['best_stage']}`, reaches"
        f" {r['best_times_reference']:.2f} times the hand-set rule's median, and so"
        f" {verdict} the {r['target_times_reference']:.2f} times a meta-trained checkpoint"
        f" must reach before it may ship. Row by row: the geometric mean of the stage's"
        f" step speedup over the hand-set rule's on every problem and seed both ran, and on"
        f" how many the stage was ahead and behind. Generated from the records by"
        f" `{r['command']}`."
    )
