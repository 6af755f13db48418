"""Renderers of the sections on how the rule is chosen (see ``report.py``): ``decide`` (the
latest decision, overall and per kind), ``decide:ledger`` (every decision of the ledger),
``report_draw`` (the shipped rule and the anchors per kind) and ``report_draw:headline``."""

from __future__ import annotations

from benchmarks.decide import KIND_FLOOR, read_ledger
from benchmarks.report_sections import markdown_table, section
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
            f"as it was before the procedure's first accepted change, against the rule before "
            f"the last round of changes chosen on the fixed validation problems: "
            f"**{s['geomean']:.3f}x** fewer steps "
            f"[{low:.3f}, {high:.3f}] on "
            f"{s['n']} fresh draws, {'a win' if s['ships'] else 'not a win'}; kinds below "
            f"{KIND_FLOOR}: {fallen} ([decisions](docs/results.md#decisions-on-fresh-draws)).")  # fmt: skip
