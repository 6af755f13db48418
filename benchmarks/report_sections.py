"""The renderers of the generated result sections (see ``report.py``): each registered with
``@section(NAME)`` renders ``benchmarks/results/NAME.json`` (``NAME:VIEW`` a view of it)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from benchmarks.validation_anchors import ANCHORS

RESULTS = Path(__file__).resolve().parent / "results"
RENDERERS: dict[str, Callable[..., str]] = {}


def section(name: str):
    """Register ``fn(result_dict) -> markdown`` as the renderer of ``results/NAME.json``."""

    def register(fn):
        RENDERERS[name] = fn
        return fn

    return register


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _x(v) -> str:
    if v is None:
        return "-"
    return "diverged" if not math.isfinite(v) else f"{v:.2f}x"


# Step cost


def _load_cell(r: dict) -> str:
    if r["load"] == "as is":
        return "as is"
    blocks = r.get("blocks")
    if not blocks:
        return "2 busy processes beside"
    each = ", ".join(f"{b:.2f}x" for b in blocks)
    return f"2 busy processes beside (median of {len(blocks)} blocks: {each})"


#: Step-cost columns: (header, key of a row); a column no row has is left out.
STEP_COLUMNS = (
    ("optimizer step / AdamW", "learned_default_step_ratio"),
    ("training step / AdamW", "learned_default_train_ratio"),
    ("eager reference: step / AdamW", "learned_reference_step_ratio"),
    ("eager reference: training step / AdamW", "learned_reference_train_ratio"),
    ("no orthogonalisation: step / AdamW", "learned_no_ortho_step_ratio"),
    ("no orthogonalisation: training step / AdamW", "learned_no_ortho_train_ratio"),
    ("Newton-Schulz every step: step / AdamW", "learned_ns_every_step_step_ratio"),
    ("Newton-Schulz every step: training step / AdamW", "learned_ns_every_step_train_ratio"),
    ("Muon + AdamW: step / AdamW", "muon_adamw_step_ratio"),
    ("Muon + AdamW: training step / AdamW", "muon_adamw_train_ratio"),
)


def _first_steps(result: dict) -> str:
    """What the result says about the first steps of a new process (the compile)."""
    cold = result.get("cold_start")
    if not cold:
        return ""
    parts = []
    first = cold.get("first_step_seconds")
    if first is not None:
        digits = 2 if first < 0.1 else 1  # 0.04 s, not 0.0 s
        parts.append(f"the first step took {first:.{digits}f} s")
    if cold.get("first_kernel_seconds") is not None:
        parts.append(
            f"the kernel of the costliest kind of bucket was ready after "
            f"{cold['first_kernel_seconds']:.0f} s"
        )
    if cold.get("kernel_ready_seconds") is not None:
        parts.append(f"the compiled kernel was ready after {cold['kernel_ready_seconds']:.0f} s")
    where = f"{cold.get('workload', 'the first workload')}, {cold.get('threads', '?')} threads"
    if cold.get("command"):  # measured again on its own, after the table
        where += f"; measured {cold['date'][:10]} by `{cold['command']}`"
    text = f" In a new process with an empty compile cache ({where}), " + " and ".join(parts) + "."
    if cold.get("warm_kernel_ready_seconds") is not None:  # a second process on that cache
        text += (
            f" A second process on that cache (a later run, another rank) loaded the kernel "
            f"after {cold['warm_kernel_ready_seconds']:.1f} s "
            f"({cold['warm_steps_until_ready']} steps)."
        )
    text += f" {cold['note']}" if cold.get("note") else ""
    return text


@section("step_overhead")
@section("step_overhead_stacked")
def render_step_overhead(result: dict) -> str:
    """Step cost against AdamW: the optimizer step alone and the whole training step."""

    def ratio(r, key):
        return f"{r[key]:.2f}x" if key in r else "-"

    columns = [(h, k) for h, k in STEP_COLUMNS if any(k in r for r in result["rows"])]
    header = ["workload", "params (tensors)", "threads", "machine", "AdamW step ms"]
    header += [h for h, _ in columns]
    rows = [
        [
            r["workload"],
            f"{r['params']:,} ({r.get('tensors', '?')})",
            r.get("threads", 2),
            _load_cell(r),
            f"{r['adamw_foreach_step_ms']:.1f}",
        ]
        + [ratio(r, k) for _, k in columns]
        for r in result["rows"]
    ]
    m = result["machine"]
    load = result.get("load_average_before")
    load_note = f", load average {load[0]:.1f} before measuring" if load else ""
    return (
        markdown_table(header, rows)
        + f"\n\nMeasured {result['date'][:10]} on {m['processor']} ({m['cpu_count']} cores"
        f"{load_note}), torch {m['torch']}; {_samples(result)}, every optimizer on its own "
        "copy of the model, taking turns, so that a busy machine slows them alike (compare "
        f"ratios, not times). AdamW with `foreach=True`.{_first_steps(result)} Command: "
        f"`{result['command']}`. Targets: {result.get('targets', '-')}."
    )


def _samples(result: dict) -> str:
    """How a step-cost run sampled: single steps, or the mean of ``period`` in a row."""
    repeats, warmup, period = (result.get(k, "?") for k in ("repeats", "warmup", "period"))
    if period in ("?", 1):
        return f"median of {repeats} steps after {warmup} warm-up steps"
    return (
        f"median of {repeats} samples, each the mean of {period} consecutive steps (the "
        f"rule's step time alternates with its Newton-Schulz steps), after {warmup} warm-up "
        "samples"
    )


@section("step_overhead:brief")
@section("step_overhead_stacked:brief")
def render_step_overhead_brief(result: dict) -> str:
    """The shipped single-worker rule's step cost against AdamW, one row per workload
    measured as is (no competing processes)."""
    prefix = "learned_default"
    rows = [
        [
            r["workload"],
            f"{r['params']:,}",
            r.get("threads", 2),
            f"{r[f'{prefix}_step_ratio']:.1f}x",
            f"{r[f'{prefix}_train_ratio']:.2f}x" if f"{prefix}_train_ratio" in r else "-",
        ]
        for r in result["rows"]
        if r.get("load") == "as is" and f"{prefix}_step_ratio" in r
    ]
    header = [
        "workload",
        "params",
        "CPU threads",
        "optimizer step / AdamW's",
        "training step / AdamW's",
    ]
    m = result["machine"]
    return (
        markdown_table(header, rows)
        + f"\n\nOn {m['processor']}, torch {m['torch']}; the training step is forward, "
        "backward and optimizer step (`-`: not measured)."
    )


def _f(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{v:.4g}"


def _measured(r: dict) -> str:
    where = r.get("machine", "?")
    if isinstance(where, dict):  # written as benchmarks.common.machine() returns it
        where = where.get("machine", "?")
    return f"Measured {r.get('date', '?')} on {where}, torch {r.get('torch', '?')}."


def seeds_phrase(seeds: list[int]) -> str:
    """How a decentralized benchmark's rows were taken over ``seeds``, for a caption."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return (
        f"the median over seeds {', '.join(map(str, seeds))} (data split, initialisation "
        "and batches; baselines tuned per seed)"
    )


@section("cuda_check")
def render_cuda_check(r: dict) -> str:
    checks, env = r["checks"], r["checks"]["environment"]["result"]
    rows = [
        [name, c["status"], "; ".join(
            filter(None, [c.get("error"), c.get("reason"), c.get("expected") and
                          f"expected: {c['expected']}"])
        )]
        for name, c in checks.items()
    ]  # fmt: skip
    status = markdown_table(["check", "result", "note"], rows)
    step = checks.get("step_timing", {}).get("result", {}).get("rows", [])
    timing = markdown_table(
        ["params", "optimizer", "ms/step (median)", "ratio to fused AdamW"],
        [
            [f"{s['size']} ({s['params']:,})", s["optimizer"], f"{s['median_ms']:.2f}",
             f"{s['ratio_to_best_adamw']:.1f}x"]
            for s in step
        ],
    )  # fmt: skip
    flat = checks.get("flat_step_timing", {}).get("result", {})
    flat_rows = [
        [f["width"], f["pass"], f"{f['median_ms']:.1f}", f"{f['elements_per_s'] / 1e6:.0f}M"]
        for f in flat.get("rows", [])
    ]
    flat_table = markdown_table(["width", "pass", "ms", "elements/s"], flat_rows)
    parts = [status]
    if step:
        parts.append(f"Step time on the GPU, the optimizers taking turns:\n\n{timing}")
    if flat_rows:
        parts.append(
            f"`flat_step` (meta-training) on {flat.get('workers')} workers x "
            f"{flat.get('elements_per_worker', 0):,} elements:\n\n{flat_table}"
        )
    if r.get("runs"):
        runs = "; ".join(f"{run['date'][11:16]} UTC: {run['checks']}" for run in r["runs"])
        parts.append(f"The checks come from {len(r['runs'])} runs on one machine ({runs}).")
    return (
        "\n\n".join(parts) + "\n\n"
        f"Measured {r['date'][:10]} on one {env.get('gpu')} ({env.get('gpu_memory_gb')} GB), "
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}. Command: "
        "`python3 benchmarks/cuda_check.py --out DIR` on the GPU machine, then the JSON copied "
        "to `benchmarks/results/`."
    )


@section("gossip_step")
def render_gossip_step(r: dict) -> str:
    header = ["configuration", "ms per step", "vs all-reduce", "vs Decent-DP"]
    peers = [r.get("vs_decent_dp", {})]
    if "vs_decent_dp_fused" in r:  # the same fused Adam on both sides
        header.append("vs Decent-DP, fused Adam")
        peers.append(r["vs_decent_dp_fused"])
    rows = [
        [name, f"{ms:.1f}", _x(r["vs_allreduce"][name])]
        + [_x(peer[name]) if name in peer else "-" for peer in peers]
        for name, ms in r["step_ms"].items()
    ]
    shares = r.get("robust_overhead", {})
    robust = "; ".join(f"{name}: {100 * share:+.1f}%" for name, share in shares.items())
    robust = (
        f' Robust mixing (`robust="clip"`) when nobody attacks, against the same row without it: {robust}.'
        if robust
        else ""
    )
    return (
        markdown_table(header, rows)
        + f"\n\n{r['setup']}.{robust} Measured {r['date'][:10]}, {r['machine']}, torch {r['torch']}. "
        f"Command: `{r['command']}`."
    )


@section("stragglers")
def render_stragglers(r: dict) -> str:
    """One slow rank of 8: throughput, skipped exchanges and the averaged model, per run."""
    slow = r["slow_rank"]
    rows = []
    for topo, runs in r["results"].items():
        for name, m in runs.items():
            fast = [v for k, v in enumerate(m["steps_per_s"]) if k != slow]
            rows.append([
                topo, name, f"{sum(fast) / len(fast):.1f}", f"{m['steps_per_s'][slow]:.1f}",
                f"{100 * m['fast_ranks_drop_mean']:.0f}% ({100 * m['fast_ranks_drop_max']:.0f}%)",
                f"{m['slow_rank_exchanges_mixed']} / {m['slow_rank_exchanges_skipped']}",
                f"{100 * m['fast_edges_skipped_fraction']:.0f}%",
                f"{m['averaged_model_train_loss']:.4g} ({_x(m['loss_vs_clean'])})",
                f"{m['distance_to_average'][slow]:.3g}",
                "-" if "met" not in m else
                f"{'yes' if m['throughput_met'] else 'no'} / {'yes' if m['slow_rank_counted'] else 'no'}",
            ])  # fmt: skip
    header = ["topology", "run", "fast ranks steps/s", f"rank {slow} steps/s",
              "fast ranks' drop, mean (worst)", f"rank {slow}'s exchanges mixed / skipped",
              "fast-fast exchanges skipped", "averaged-model train loss (vs clean)",
              f"rank {slow}'s distance to the average", "goal: throughput / counted"]  # fmt: skip
    return (
        markdown_table(header, rows)
        + f"\n\n{r['setup']}. `slow`: rank {slow} {r['slow_factor']:g}x slower; "
        "`deadline_<ms>`: with `step_deadline`. Exchanges are counted on the slow rank's "
        "neighbours, fast-fast ones on both ends, once per step: mixed (late ones included) "
        "or skipped (still in flight); the distance to the average is relative "
        f"to the average's norm. Goal: {r['goal']}. Measured {r['date'][:10]}, "
        f"{r['machine']}, torch {r['torch']}. Command: `{r['command']}`."
    )


@section("local_steps")
def render_local_steps(r: dict) -> str:
    t = r["targets"]
    chosen = r["validation"]["chosen"]
    picks = "; ".join(
        f"{o}: H={c['H']}, top-k {c['density']:g}, outer lr {c['outer_lr']:g} (validation median "
        f"loss ratio {c['median_loss_ratio']:.3g}x, at least {c['min_bytes_reduction_x']:.0f}x "
        "fewer bytes"
        + (
            ""
            if c.get("meets_bytes_target", True)
            else ": none of its variants "
            "sends the target's fewer bytes, so its best at any compression"
        )
        + ")"
        for o, c in chosen.items()
        if c
    )
    header = ["task", "workers", "topology", "outer", "H", "top-k", "bytes/rank",
              "fewer bytes", "final loss", "exact loss", "loss ratio", "pass"]  # fmt: skip
    rows = [
        [x["task"], x["workers"], x["topology"], f"{x['outer']} {x['outer_lr']:g}", x["H"],
         f"{x['density']:g}", f"{x['bytes_per_rank']:,.0f}", _x(x["bytes_reduction_x"]),
         _f(x["final"]), _f(x["exact_final"]), _x(x["loss_ratio"]),
         ("yes" if x["passes"] else "no") + _local_steps_mark(x)]
        for x in r.get("heldout", {}).get("rows", [])
    ]  # fmt: skip
    summary = "; ".join(f"{o} {s['passes']} of {s['of']}"
                        for o, s in r.get("heldout", {}).get("summary", {}).items())  # fmt: skip
    front = "; ".join(
        f"at least {f['min_bytes_reduction_x']:g}x fewer bytes: "
        + (f"{b['outer']} {b['outer_lr']:g}, H={b['H']}, top-k {b['density']:g}, median "
           f"{b['median_loss_ratio']:.3g}x (worst {b['max_loss_ratio']:.3g}x)" if b else "none")
        for f in r["validation"].get("frontier", []) for b in [f["best"]]
    )  # fmt: skip
    return (
        markdown_table(header, rows)
        + f"\n\nTarget: at least {t['bytes_reduction_x']:g}x fewer bytes than exact per-step "
        f"gossip (D-Adam) with the final averaged-model loss at most {t['loss_ratio']:g}x the "
        f"exact run's. Chosen on the validation family: {picks}. Settings passing: {summary} "
        "(rows marked record are the other H at the chosen density; rows marked frontier "
        "the validation family's best loss ratio at that compression). "
        + (
            f"Frontier on the validation family (loss ratio against exact gossip): {front}. "
            if front
            else ""
        )
        + _measured(r)
    )


def _local_steps_mark(x: dict) -> str:
    """How a held-out row of ``local_steps`` was picked, after its pass column."""
    if x.get("chosen", True):
        return ""
    if x.get("frontier"):
        return " (frontier, " + ", ".join(f">= {f:g}x" for f in x["frontier"]) + ")"
    return " (record)"


@section("wallclock_heldout")
def render_wallclock(r: dict) -> str:
    """Compile-included wall clock: each side trained in a fresh process."""
    header = ["task", "steps", "speedup in steps", "wall-clock, compile included",
              "wall-clock, kernel compiled (suite's figure)",
              "wall-clock at AdamW's step cost", "seconds to the level: rule / AdamW",
              "kernel ready after step"]  # fmt: skip
    rows = []
    for x in r["rows"]:
        recorded = x.get("recorded_wall_speedup")
        rows.append([
            x["task"], x["horizon"], _x(x["speedup"]), f"**{_x(x['wall_speedup'])}**",
            "-" if recorded is None else _x(recorded),
            "-" if x.get("adamw_paced_wall_speedup") is None else _x(x["adamw_paced_wall_speedup"]),
            "a run diverged" if x["seconds_rule"] is None
            else f"{x['seconds_rule']:.2f} / {x['seconds_adamw']:.2f}",
            x["kernel_ready_step"] if x["kernel_ready_step"] is not None else "not in the run",
        ])  # fmt: skip
    s = r["summary"]
    paced = ""
    if s.get("median_adamw_paced_wall_speedup") is not None:
        paced = (
            f"; at AdamW's step cost, the rule's step counts would give "
            f"{_x(s['median_adamw_paced_wall_speedup'])}: AdamW's own seconds after the "
            "rule's number of steps, so a cheaper step can reach no more"
        )
    cache = "an empty compile cache" if r["cache"] == "empty" else "a warm compile cache"
    when = f"compiled in the background once its eager steps had taken {r['compile_after_seconds']:g} s"
    if r["cache"] != "empty" and r.get("kernel_route") == "aot_package":
        when = f"was loaded after its first steps where the earlier run had built it, else {when}"
    return (
        markdown_table(header, rows)
        + f"\n\nMedian: **{_x(s['median_speedup'])}** in steps, **{_x(s['median_wall_speedup'])}** "
        f"in wall-clock time with the compile included (the suite's figure, measured once the "
        f"kernel is compiled: {_x(s['median_recorded_wall_speedup'])}{paced}). Each side trained the "
        f"task {_trained(r)} ({r['threads']} thread, {cache}), at seed {r['timing_seed']}, "
        f"one process at a time; the rule's kernel {when}. Wall-clock speedup: AdamW's "
        f"seconds to the level (the worse of the two best smoothed losses) over the rule's, "
        f"each counted from the optimizer's construction. AdamW at the rate and schedule "
        f"tuned for seed {r['timing_seed']} in `{r['source']}`. {_measured(r)} Wall time "
        f"{r['wall_seconds'] / 60:.0f} min. Command: `{r['command']}`."
    )


def _trained(r: dict) -> str:
    """How often each side of a wall-clock run trained: once, or N times (``--repeats``, the
    repeats taking turns) timed by the median of its runs' clocks."""
    n = r.get("repeats", 1)
    if n == 1:
        return "once in a new process"
    return (
        f"{n} times, each in a new process, the repeats taking turns, and timed by the "
        "median of its clocks"
    )


@section("wallclock_heldout:headline")
def render_wallclock_headline(r: dict) -> str:
    s = r["summary"]
    return (
        f"With the compile included (each side trained {_trained(r)}, seed "
        f"{r['timing_seed']}, {'an empty' if r['cache'] == 'empty' else 'a warm'} compile cache), "
        f"the single-worker rows' median wall-clock speedup is **{_x(s['median_wall_speedup'])}** "
        f"({_x(s['median_speedup'])} in steps in those runs; "
        f"[table](docs/results.md#wall-clock-time-with-the-compile-included))."
    )


# Robust mixing (``benchmarks/robust_gossip.py``)

ROBUST_ATTACKS = ("scaled", "sign_flip", "random", "alie_drift", "alie_drift_fast")


def _loss_cell(loss: float | None, vs_clean: float | None = None) -> str:
    if loss is None:
        return "diverged"
    return f"{loss:.4g}" + ("" if vs_clean is None else f" ({vs_clean:.3g}x)")


@section("robust_gossip")
def render_robust_gossip(r: dict) -> str:
    """The docs table of ``results/robust_gossip.json``: per topology and attack, the honest
    ranks' loss with plain and robust mixing against the clean run's, then the overhead."""
    rows = []
    for topo, t in r["results"].items():
        rows.append(
            [topo, "none (clean run)", _loss_cell(t["clean"]), _loss_cell(t["clean_robust"]), "-"]
        )
        for attack in ROBUST_ATTACKS:
            a = t[attack]
            rows.append([topo, attack, _loss_cell(a["plain"], a["plain_vs_clean"]),
                         _loss_cell(a["robust"], a["robust_vs_clean"]),
                         "yes" if a["met"] else "no"])  # fmt: skip
    table = markdown_table(
        ["topology", "attack", "plain gossip", f"robust={r['default']!r}", "within 10%"], rows
    )
    refs = ", ".join(f"{topo} {_loss_cell(t['excluded'])}" for topo, t in r["results"].items())
    cost = "; ".join(
        f"{topo}: {kind} {t['plain_ms']:.3g} ms, +{100 * t['overhead']:.0f}%"
        for topo, kinds in r["overhead_no_attack"].items()
        for kind, t in kinds.items()
    )
    return (
        f"{table}\n\nLoss: the honest ranks' averaged model on their own shards; in brackets, "
        f"against the clean run. Leaving the bad rank out altogether (as a NaN sender is): "
        f"{refs}. Step time without an attacker, plain, and what robust mixing adds (CPU "
        f"time; `simulator`: all 8 workers, `worker`: one rank less the network, `worker_1m`: "
        f"the same on a 1.07M-parameter MLP): {cost}. {r['setup']}; measured "
        f"{r['date'][:10]}, {r['machine']}."
    )


# The validation family


def _cell(run: dict | None) -> str:
    if run is None:
        return "-"
    return _x(run["speedup"]) + (" (diverged)" if run.get("diverged") else "")


def _single(r: dict) -> str:
    anchors = [a for a in ANCHORS if any(a in row.get("anchors", {}) for row in r["single"])]
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


#: How a rule's table says which schedule its multiplier ran under (constant: nothing).
SCHEDULE_PHRASES = {
    "cosine": ", its learning rate annealed to 0 by torch's `CosineAnnealingLR` over each run",
    "wsd": ", its learning rate held, then decayed linearly to 0 over the last fifth of each run",
    "wsd_half": ", its learning rate held, then decayed linearly to 0 over the last half of each run",
}


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


@section("quality_heldout")
def render_quality_heldout(r: dict) -> str:
    return _render(r, "quality_heldout")


@section("quality_heldout_wsd_half")
def render_quality_heldout_wsd_half(r: dict) -> str:
    return _render(r, "quality_heldout_wsd_half")


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


def _render(r: dict, name: str) -> str:
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
    """The median time of the learned training step over the baselines' (AdamW's; under
    gossip the best baseline's), from the rows' step times, as a sentence."""
    import statistics

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


@section("quality_heldout_wsd_half:headline")
def render_wsd_headline(r: dict) -> str:
    """One line under the headline: the single-worker rule paired with its schedule."""
    s = r["summary"]
    return (
        f"With `wsd_schedule` (as in the quick start), the single-worker rows: median "
        f"**{_x(s['median_speedup_single'])}** in steps, {_x(s['median_wall_speedup_single'])} "
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
    """``r`` (``heldout_anchors.json``) with the rule's column read afresh from
    ``quality_heldout.json``: the anchors do not change when the rule does, so the
    table shows the rule's latest held-out measurement (its date in ``rule_date``)."""
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
