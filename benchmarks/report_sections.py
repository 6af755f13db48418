"""Renderers of the other result sections (see ``report.py``)."""

from __future__ import annotations

import json
import math

from benchmarks.report import markdown_table, section


def _x(v: float) -> str:
    return "diverged" if not math.isfinite(v) else f"{v:.2f}x"


def _f(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{v:.4g}"


def _partial(r: dict, what: str) -> str:
    if r.get("complete", True):
        return ""
    done = len(r.get("tasks", r.get("settings", [])))
    return f"**Partial run: {done} of {r.get('total', '?')} {what} measured.** "


def _measured(r: dict) -> str:
    where = r.get("machine", "?")
    if isinstance(where, dict):  # written as benchmarks.common.machine() returns it
        where = where.get("machine", "?")
    return f"Measured {r.get('date', '?')} on {where}, torch {r.get('torch', '?')}."


@section("quality_single")
def render_quality_single(r: dict) -> str:
    h1, h2 = r["horizons"]
    header = ["task", "params", f"speedup @{h1}", f"speedup @{h2}", f"best baseline @{h2}",
              f"final loss learned / best @{h2}"]  # fmt: skip
    rows = []
    for t in r["tasks"]:
        a, b = t[f"h{h1}"], t[f"h{h2}"]
        best = b["best_baseline"][0]
        rows.append([
            t["task"], f"{t['num_params']:,}", _x(a["speedup_median"]), _x(b["speedup_median"]),
            f"{best} (lr {b['best_lr'][best]:g})",
            f"{_f(b['final_loss_mean']['learned'])} / {_f(b['final_loss_mean'][best])}",
        ])  # fmt: skip
    s1, s2 = r["summary"][f"h{h1}"], r["summary"][f"h{h2}"]
    return (
        markdown_table(header, rows)
        + f"\n\n{_partial(r, 'tasks')}Median speedup over the best of tuned Adam, AdamW and "
        f"SGD+momentum: "
        f"**{_x(s1['median_speedup'])}** at {h1} steps ({s1['tasks_faster']}/{s1['tasks']} "
        f"tasks faster), **{_x(s2['median_speedup'])}** at {h2} steps ({s2['tasks_faster']}/"
        f"{s2['tasks']}). Learned-optimizer runs that diverged: {s2['learned_diverged_runs']}. "
        f"Speedup = steps the best baseline needs to reach a loss level / steps the learned "
        f"optimizer needs, at the worse of the two best levels (below 1: slower); median of "
        f"{len(r['seeds'])} seeds; each baseline tuned per task and horizon over a 7-point "
        f"learning-rate grid. Checkpoint: `{r['checkpoint']}`. {_measured(r)} "
        f"Wall time {r['wall_seconds'] / 60:.0f} min. Plot: `benchmarks/results/quality_single.png`."
    )


@section("quality_decentralized")
def render_quality_decentralized(r: dict) -> str:
    header = ["workers", "topology", "data", "speedup", "best baseline (lr)",
              "avg-model loss learned / best", "consensus learned / best"]  # fmt: skip
    rows = []
    for s in r["settings"]:
        best = s["best_baseline"]
        b = s["baselines"][best]
        rows.append([
            s["workers"], s["topology"], s["partition"], _x(s["speedup"]), f"{best} ({b['lr']:g})",
            f"{_f(s['learned']['averaged_model_loss'])} / {_f(b['averaged_model_loss'])}",
            f"{s['learned']['consensus']:.3g} / {b['consensus']:.3g}",
        ])  # fmt: skip
    per = ", ".join(f"{w} workers {_x(v['median_speedup'])}" for w, v in r["summary"].items())
    return (
        markdown_table(header, rows)
        + f"\n\n{_partial(r, 'settings')}Task `{r['task']}`, {r['horizon']} steps, Dirichlet alpha "
        f"{r['dirichlet_alpha']} for the non-IID rows. Learned optimizer + learned mixing "
        f"against the best of D-SGD (momentum 0.9), D-Adam and gradient tracking (DSGT), all "
        f"Metropolis-mixed and each tuned over its 7-point grid per setting. Median speedup: "
        f"**{_x(r['median_speedup_all'])}** overall; {per}. {_measured(r)} Wall time "
        f"{r['wall_seconds'] / 60:.0f} min. Plot: `benchmarks/results/quality_decentralized.png`."
    )


@section("meta_train_throughput")
def render_meta_train_throughput(r: dict) -> str:
    rows = [[k, f"{v['inner_steps_x_workers_per_s']:.0f}", f"{v['seconds_per_meta_step']:.2f}"]
            for k, v in r["results"].items()]  # fmt: skip
    return (
        markdown_table(["estimator", "inner steps x workers / s", "s / meta-step"], rows)
        + f"\n\nConfig `{r['config'].split('/work/main/')[-1]}`. {_measured(r)}"
    )


@section("estimators")
def render_estimators(r: dict) -> str:
    rows = [[k, v["meta_steps"], _x(v["median_speedup_adam"]), _x(v["median_speedup_dadam"])]
            for k, v in r["results"].items()]  # fmt: skip
    return (
        markdown_table(
            [
                "estimator",
                "meta-steps",
                "median speedup vs tuned Adam",
                "vs tuned D-Adam (8 workers)",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nSame budget: {r['budget_minutes_each']:g} minutes each, side by side, "
        f"{r['threads_each']} thread each, config `{r['config']}`, measured {r['date']}. "
        f"The better one, **{r['better']}**, is the default."
    )


@section("gossip_throughput")
def render_gossip_throughput(r: dict) -> str:
    rows = []
    for procs, sizes in r["throughput_ms"].items():
        for size, m in sizes.items():
            rows.append([
                procs, size, f"{m['exchange+mix']:.1f}", f"{m['exchange+mix (learned)']:.1f}",
                f"{m['raw send/recv']:.1f}", f"{m['all_reduce']:.1f}", f"{m['mix_overhead_x']:.2f}x",
            ])  # fmt: skip
    header = ["processes", "params", "exchange+mix ms", "learned mix ms", "raw send/recv ms",
              "all_reduce ms", "mix / raw"]  # fmt: skip
    return (
        markdown_table(header, rows)
        + f"\n\nGoal: {r['goal']}. {r['note']}. Measured {r['date'][:10]}, {r['machine']}, "
        f"torch {r['torch']}."
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


@section("robust_cost")
def render_robust_cost(r: dict) -> str:
    """One rank's robust mix against the plain one, eager and compiled (robust_cost.py)."""
    labels = {"plain": "plain mix", "robust": 'robust mix (`robust="clip"`), eager distances',
              "robust_compiled": "robust mix, compiled distances",
              "distances": "the distances alone, eager",
              "compiled_distances": "the distances alone, compiled",
              "state_distances": "the shared moments' distances, eager",
              "state_compiled_distances": "the shared moments' distances, compiled",
              "fused_distances": "the distances in one compiled pass"}  # fmt: skip
    rows = [[labels.get(k, k), f"{v:.2f}"] for k, v in r["ms"].items()]
    extra, of_step = r["extra_ms"], r.get("extra_of_step") or {}
    parts = []
    for key, how in (("robust", "with eager distances"), ("robust_compiled", "compiled")):
        if key in extra:
            part = f"{how}, robust mixing adds {extra[key]:.2f} ms"
            if key in of_step:
                part += f" ({of_step[key]:.1%} of a rank's share of the step)"
            parts.append(part)
    if "fused_floor" in extra:
        floor = f"with the distances fused into one pass it would add {extra['fused_floor']:.2f} ms"
        if "fused_floor" in of_step:
            floor += f" ({of_step['fused_floor']:.0%})"
        parts.append(floor)
    share = ""
    if r.get("rank_share_ms"):
        share = (f" A rank's share of the step: `gossip_step.json`'s {r['step_row']} row, "
                 f"{r['step_ms']:.1f} ms for 4 ranks on 2 cores, times 2 / 4 "
                 f"({r['rank_share_ms']:.1f} ms).")  # fmt: skip
    return (
        markdown_table(["one rank's mix", "ms"], rows)
        + f"\n\n{r['setup'][:1].upper()}{r['setup'][1:]}: "
        + "; ".join(parts)
        + "."
        + share
        + f" Measured {r['date']} on {r['machine']}, torch {r['torch']}. "
        f"Command: `{r['command']}`."
    )


@section("weight_decay")
def render_weight_decay(r: dict) -> str:
    """Each side at each decay on the two overfitting problems (weight_decay.py)."""
    side = {"learned": "learned rule", "adamw": "AdamW (lr 1e-3)"}
    head = {"problem": "problem", "side": "optimizer", "weight_decay": "weight_decay",
            "train_loss": "training loss", "test_loss": "held-out loss",
            "test_accuracy": "held-out accuracy", "matrix_norm": "matrix norm"}  # fmt: skip
    cell = {"problem": "`{}`".format, "side": side.get, "weight_decay": "{:g}".format,
            "train_loss": "{:.4f}".format, "test_loss": "{:.3f}".format,
            "test_accuracy": "{:.1%}".format, "matrix_norm": "{:.1f}".format}  # fmt: skip
    rows = [[cell[k](x[k]) for k in head] for x in r["rows"]]
    setup = f"{r['setup'][:1].upper()}{r['setup'][1:]} ({r['seeds']} seeds, {r['steps']} steps)"
    return f"{markdown_table(list(head.values()), rows)}\n\n{setup}. {_measured(r)} " + (
        f"Command: `{r['command']}`."
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


@section("gossip_compression")
def render_gossip_compression(r: dict) -> str:
    rows, notes = [], []
    for partition, run in r.items():
        for name, m in run["runs"].items():
            gamma, beta = m.get("consensus_step"), m.get("drift_correction")
            rows.append([
                partition, name, "-" if gamma is None else f"{gamma:g}",
                "-" if beta is None else f"{beta:g}",
                f"{m['averaged_model_train_loss']:.4g}", _x(m["loss_vs_exact"]),
                f"{m['consensus_distance']:.3g}",
                f"{m['bytes_per_step']:,.0f}", _x(m["bytes_reduction_x"]),
            ])  # fmt: skip
        notes.append(f"{partition}: {run['setup']}, measured {run['date'][:10]}, {run['machine']}")
    header = ["partition", "exchange", "consensus step", "drift correction",
              "averaged-model train loss", "vs exact", "consensus distance", "bytes/step",
              "fewer bytes"]  # fmt: skip
    goal = next(iter(r.values()))["goal"]
    return markdown_table(header, rows) + f"\n\nGoal: {goal}. " + "; ".join(notes) + "."


def seeds_phrase(seeds: list[int]) -> str:
    """How a decentralized benchmark's rows were taken over ``seeds``, for a caption."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return (
        f"the median over seeds {', '.join(map(str, seeds))} (data split, initialisation "
        "and batches; baselines tuned per seed)"
    )


@section("heldout_floor")
@section("gossip_validation_floor")
@section("heldout_share_every")
@section("gossip_validation_every")
@section("gossip_validation_momenta")
@section("gossip_validation_shared")
@section("gossip_validation_seeds")
@section("gossip_validation_stage1")
@section("gossip_validation")
def render_gossip_validation(r: dict) -> str:
    labels = [s["label"] for s in r["sides"]]
    keys = []
    for row in r["rows"]:
        key = (row["task"], row["workers"], row["topology"], row["alpha"])
        if key not in keys:
            keys.append(key)
    speed = {(row["side"], row["task"], row["workers"], row["topology"], row["alpha"]): row
             for row in r["rows"]}  # fmt: skip
    table = []
    for key in keys:
        first = speed[(labels[0], *key)]
        best = f"{first['best_baseline']} ({first['baseline_lr']:.3g})"
        table.append([*key, best] + [_x(speed[(label, *key)]["speedup"]) for label in labels])
    for stat in ("median", "min", "geomean"):
        table.append([f"**{stat}**", "", "", "", ""]
                     + [f"**{_x(r['summary'][label][stat])}**" for label in labels])  # fmt: skip
    sides = "; ".join(
        f"`{s['label']}` = `{s['checkpoint']}`"
        + ("" if not s["fields"] else " with " + ", ".join(f"{k}={v:g}" for k, v in s["fields"].items()))
        for s in r["sides"]
    )  # fmt: skip
    header = ["task", "workers", "topology", "Dirichlet alpha", "best tuned (lr)"]
    suite = (
        "the held-out suite's decentralized settings (a confirmation, not a basis for choosing)"
        if r.get("suite") == "heldout"
        else "registry tasks only (none held out)"
    )
    return (
        markdown_table(header + [f"`{label}`" for label in labels], table)
        + f"\n\nStep speedup against the best of D-SGD, D-Adam and DSGT (each Metropolis-mixed"
        f" and tuned per setting), scored on the averaged model's full training-set loss,"
        f" {r['horizon']} steps, {seeds_phrase(r.get('seeds', [0]))}; {suite}. Sides: {sides}."
        f" {_measured(r)} Wall time {r['wall_seconds'] / 60:.0f} min. Command:"
        f" `{r['command']}`." + (f" {r['note']}." if r.get("note") else "")
    )


@section("validation_gossip_rule")
def render_gossip_rule(r: dict) -> str:
    """The candidates for the rule under gossip, one column each, on the decentralized
    validation settings."""
    cands = r["candidates"]
    first = cands[0]["rows"]
    table = []
    for i, row in enumerate(first):
        cells = []
        for c in cands:
            x = c["rows"][i]
            flag = " (diverged)" if x["diverged"] else (" *" if x["worse_than_dadam"] else "")
            cells.append(f"{_x(x['speedup'])}{flag}")
        data = row["partition"] + ("" if row["partition"] == "iid" else f" {row['alpha']:g}")
        table.append([row["task"].removeprefix("val_"), row["workers"], row["topology"], data]
                     + cells)  # fmt: skip
    for key, name in (("median_speedup_decentralized", "median"),
                      ("min_speedup_decentralized", "lowest")):  # fmt: skip
        table.append([f"**{name}**", "", "", ""] + [_x(c["summary"][key]) for c in cands])
    for key, name in (("decentralized_worse_than_dadam", "worse than D-Adam"),
                      ("divergences_decentralized", "diverged")):  # fmt: skip
        table.append([f"**{name}**", "", "", ""] + [str(c["summary"][key]) for c in cands])
    header = ["problem", "ranks", "graph", "data"] + [f"`{c['label']}`" for c in cands]
    args = "; ".join(f"`{c['label']}`: `{c['arguments']}`" for c in cands)
    return (
        markdown_table(header, table)
        + "\n\nStep speedup of the averaged model against the best of D-SGD, D-Adam and DSGT "
        "(each Metropolis-mixed and tuned per setting), 200 steps, "
        f"{seeds_phrase(r['seeds'])}; `*`: the averaged model ended worse than tuned "
        "D-Adam's at some seed. Ranked by divergences, then settings worse than D-Adam, then "
        f"the lowest and the median speedup: best `{r['best']}`. Candidates (arguments of "
        f"`benchmarks.validation`): {args}. {_measured(r)} Wall time "
        f"{r['wall_seconds'] / 60:.0f} min. Command: `{r['command']}`."
    )


@section("registry_sides")
@section("registry_sides_lr")
def render_registry_sides(r: dict) -> str:
    labels = [s["label"] for s in r["sides"]]
    keys = list(dict.fromkeys((row["task"], row["horizon"]) for row in r["rows"]))
    speed = {(row["side"], row["task"], row["horizon"]): row for row in r["rows"]}
    table = [[task, h] + [_x(speed[(label, task, h)]["speedup"]) for label in labels]
             for task, h in keys]  # fmt: skip
    for stat, name in (("median_speedup", "median"), ("median_speedup_h200", "median, 200"),
                       ("median_speedup_h2000", "median, 2000")):  # fmt: skip
        table.append([f"**{name}**", ""] + [f"**{_x(r['summary'][lb][stat])}**" for lb in labels])
    table.append(
        ["**rows below 0.8x**", ""] + [str(r["summary"][lb]["rows_below_0.8"]) for lb in labels]
    )
    table.append(  # non-finite or ended above the first loss, over every row and seed
        ["**diverged runs**", ""] + [str(r["summary"][lb]["diverged_runs"]) for lb in labels]
    )
    sides = "; ".join(
        f"`{s['label']}` = `{s['checkpoint']}`"
        + ("" if not s["fields"] else " with " + ", ".join(f"{k}={v:g}" for k, v in s["fields"].items()))
        for s in r["sides"]
    )  # fmt: skip
    return (
        markdown_table(["task", "steps"] + [f"`{label}`" for label in labels], table)
        + "\n\nStep speedup against the best of Adam, AdamW and SGD+momentum at the rates"
        f" `benchmarks/quality_single.py` tuned per task and horizon (`{r['tuned_from']}`),"
        f" single worker, the median over seeds {', '.join(map(str, r['seeds']))} (the baselines"
        " at the rates tuned on seed 0); registry tasks only (the meta-training"
        f" family's fixed tasks, none held out: where a change of the rule is chosen). Sides:"
        f" {sides}. {_measured(r)} Wall time {r['wall_seconds'] / 60:.0f} min. Command:"
        f" `{r['command']}`."
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
@section("wallclock_heldout_warm")
@section("wallclock_validation_child10")
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


@section("wallclock_validation_choice")
@section("wallclock_validation_thresholds")
def render_wallclock_compare(r: dict) -> str:
    """Several runs of ``benchmarks/wallclock.py`` on the same rows, side by side."""
    runs = r["runs"]
    header = ["problem", *[x["label"] for x in runs]]
    keys = list(runs[0]["walls"])
    rows = [[k, *[_x(x["walls"][k]) if k in x["walls"] else "-" for x in runs]] for k in keys]
    rows.append(["**median**", *[f"**{_x(x['summary']['median_wall_speedup'])}**" for x in runs]])
    commands = "; ".join(f"`{x['command']}`" for x in runs)
    return (
        markdown_table(header, rows)
        + "\n\nWall-clock speedup against tuned AdamW with the compile included (see the "
        f"table below for how it is measured), one column per way of compiling. Commands: {commands}."
    )


def _packed_label(side: str) -> str:
    """``packed_N``: "packed up to N" (every tensor for a bound of a billion or more)."""
    bound = int(side.removeprefix("packed_"))
    return "every tensor packed" if bound >= 10**9 else f"packed up to {bound:,}"


@section("eager_step_split")
@section("eager_step_flat_state")
@section("eager_step_pack_bound")
@section("eager_step_pack_bound_validation")
@section("eager_step_ns4")
@section("eager_step")
def render_eager_step(r: dict) -> str:
    """The eager reference step: masking every step, the mask read on the host, and small
    tensors packed into one call (and any other packing bounds measured)."""
    sides = [s for s in r["sides"] if s != "masked"]
    rows = [
        [name, f"{m['parameters']:,}", f"{m['ms']['adamw']:.2f}", _x(m["x_adamw"]["masked"]),
         *(_x(m["x_adamw"][s]) for s in sides), _x(m["speedup_vs_masked"]["packed"]),
         f"{max(m['max_rel_diff_vs_masked'][s] for s in sides):.2g}"]
        for name, m in r["rows"].items()
    ]  # fmt: skip
    names = {"mask_read": "mask read on the host", "packed": "mask read, small tensors packed",
             "default": "compile=True, before its kernels"}  # fmt: skip
    header = ["model", "params", "AdamW step ms", "masking every step / AdamW",
              *(f"{names.get(s) or _packed_label(s)} / AdamW" for s in sides),
              "packed vs masking", "largest parameter difference"]  # fmt: skip
    return (
        markdown_table(header, rows)
        + "\n\nEager reference step (`compile=False`, and the default optimizer before "
        "its kernels are built where a column says so), one thread, median of "
        "the timed rounds, each side on its own copy of the model, taking turns with AdamW "
        f"(`foreach=True`). Small tensors: at most {r['pack_numel']:,} elements. {_measured(r)} Load average {r['load_average_end']} at the end. "
        f"Command: `{r['command']}`."
    )


@section("step_ab")
@section("step_ab_pack_bound")
@section("step_ab_packs")
@section("step_ab_groups")
@section("step_ab_groups_one")
@section("step_ab_kernel_groups")
@section("step_ab_kernel_one")
@section("step_ab_whiten_validation")
@section("step_ab_whiten_squared")
@section("step_ab_whiten_sampled")
@section("step_ab_whiten_sampled_kernel")
def render_step_ab(r: dict) -> str:
    """This checkout's step against another revision's, taking turns in one process: the
    eager reference, or (``path`` ``kernel``) the compiled kernels with the kinds each
    revision built."""
    kernel = r.get("path") == "kernel"
    rows = [
        [name, f"{m['parameters']:,}", f"{m['ms']['adamw']:.3f}", _x(m["x_adamw"]["base"]),
         _x(m["x_adamw"]["this"]), _x(m["this_over_base"]), f"{m['max_rel_diff']:.2g}",
         *([f"{m['kernel_kinds']['base']} / {m['kernel_kinds']['this']}"] if kernel else [])]
        for name, m in r["rows"].items()
    ]  # fmt: skip
    header = ["workload", "params", "AdamW step ms", f"{r['base']} / AdamW",
              f"{r['this']} / AdamW", "step time, new ÷ old", "largest parameter difference",
              *(["kernels built, old / new"] if kernel else [])]  # fmt: skip
    split = ""
    if r.get("param_groups") == "split":
        split = (" Every side on two param groups, AdamW's usual split: weight decay 0.1 on "
                 "the tensors of two or more dimensions, none on the others.")  # fmt: skip
    what = "Eager reference step (`compile=False`)"
    if kernel:
        what = "The compiled kernels' step (each revision's built first, in a child process)"
    return (
        markdown_table(header, rows) + f"\n\n{what}, one thread, one fixed gradient; the two "
        "revisions' rules and AdamW (`foreach=True`) take turns in one process, each on its "
        f"own copy of the model, {r['rounds']} rounds of {r['steps']} steps, each side's "
        f"fastest round kept.{split} {_measured(r)} Load average {r['load_average_end']} "
        f"at the end. Command: `{r['command']}`."
    )


@section("eager_step_malloc_on")
def render_eager_step_malloc(r: dict) -> str:
    """The eager step with glibc's thresholds raised (``learned_opt.allocator``) beside the
    same benchmark run with them left alone (``eager_step_malloc_off.json``)."""
    from benchmarks.report import RESULTS

    off = json.loads((RESULTS / "eager_step_malloc_off.json").read_text())
    rows = []
    for name, on in r["rows"].items():
        before = off["rows"][name]
        rows.append([
            name, f"{on['parameters']:,}",
            f"{before['ms']['packed']:.2f} / {on['ms']['packed']:.2f}",
            f"{before['ms']['adamw']:.2f} / {on['ms']['adamw']:.2f}",
            f"{_x(before['x_adamw']['packed'])} / {_x(on['x_adamw']['packed'])}",
            _x(before["ms"]["packed"] / on["ms"]["packed"]),
        ])  # fmt: skip
    header = ["model", "params", "rule step ms, defaults / raised", "AdamW step ms",
              "rule / AdamW", "rule's step time, defaults ÷ raised"]  # fmt: skip
    return (
        markdown_table(header, rows)
        + "\n\nEager reference step (the default packing), one thread, each side on its own "
        "copy of the model taking turns with AdamW; the first of each pair with glibc's "
        "allocator defaults (`LEARNED_OPT_TUNE_MALLOC=0`), the second with its thresholds "
        f"raised for every side, as `LearnedOptimizer` sets them on CPU. {_measured(r)} "
        f"Load average {off['load_average_end']} and {r['load_average_end']} at the ends. "
        f"Commands: `LEARNED_OPT_TUNE_MALLOC=0 {off['command']}` and `{r['command']}`."
    )


@section("kernel_call")
def render_kernel_call(r: dict) -> str:
    """One call of a loaded kernel by how its inputs are handed over, beside AdamW's step."""
    routes = ("flat_loader", "flat_package_call", "nested_package_call")
    rows = [
        [name, f"{m['parameters']:,} ({m['tensors']})", f"{m['ms']['adamw_step']:.3f}",
         *(f"{m['ms'][k]:.3f} ({_x(m['vs_adamw'][k])})" for k in routes)]
        for name, m in r["rows"].items()
    ]  # fmt: skip
    header = ["model", "params (tensors)", "AdamW step ms", "flat list, loader (the optimizer's)",
              "flat list, package call", "structured arguments, package call (before)"]  # fmt: skip
    return (
        markdown_table(header, rows)
        + f"\n\nms of one kernel call (ratio to AdamW's `step()` on the same model), "
        f"{r['setup']}. {_measured(r)} Command: `{r['command']}`."
    )


@section("build_race")
def render_build_race(r: dict) -> str:
    """Steps done over time while the kernel builds, with and without yielding a thread."""
    marks = sorted({int(m) for run in r["runs"].values() for m in run["steps_at"]})
    header = ["setting", "kernel ready", *(f"steps at {m} s" for m in marks)]
    rows = []
    for name, run in r["runs"].items():
        ready = run["kernel_ready"]
        cell = f"{ready['seconds']:.0f} s (step {ready['step']})" if ready else "not in the run"
        rows.append([name, cell, *(run["steps_at"].get(str(m), "-") for m in marks)])
    return (
        markdown_table(header, rows)
        + f"\n\n{r['workload']} at {r['threads']} threads, trained for {r['seconds']:.0f} s "
        "in a new process with an empty compile cache, one process at a time (load "
        f"average {r['load_average_before']:.1f} before). {_measured(r)} Command: "
        f"`{r['command']}`."
    )


@section("build_anatomy")
def render_build_anatomy(r: dict) -> str:
    """Where a kernel build's seconds go, for each variant of the build."""
    phases = [
        ("export", "torch.export"), ("inductor_python", "inductor (Python)"),
        ("isa_probes", "vector-ISA probes"), ("wrapper", "C++ wrapper"),
        ("kernels", "C++ kernels"), ("link_and_other", "linking and other"),
    ]  # fmt: skip
    rows = []
    for name, v in r["variants"].items():
        total = v["total"]
        packages = " + ".join(str(b["tensors"]) for b in v["builds"])
        rows.append([name, packages, f"{total['seconds']:.1f}",
                     *(f"{total.get(k, 0.0):.1f}" for k, _ in phases)])  # fmt: skip
    return (
        markdown_table(
            ["variant", "tensors per package", "build s", *(h + " s" for _, h in phases)], rows
        )
        + f"\n\nThe packages of {r['workload']}'s kinds of bucket, built in turn in a new process "
        f"with an empty compile cache, at {r['threads']} threads and normal priority, one variant "
        f"at a time (load average {r['load_average_before']:.1f} before). {_measured(r)} "
        f"Command: `{r['command']}`."
    )


@section("ns_precision")
def render_ns_precision(r: dict) -> str:
    ms = {(tuple(t["shape"]), t["path"], t["dtype"]): t["ms"] for t in r["timings"]}
    shapes = list(dict.fromkeys(tuple(t["shape"]) for t in r["timings"]))
    rows = [
        [f"{s[0]} x {s[1]}"]
        + [f"{ms[(s, p, d)]:.2f}" for p in ("plain", "gram") for d in ("float32", "bfloat16")]
        for s in shapes
    ]
    timing = markdown_table(
        ["matrix", "plain float32 ms", "plain bfloat16 ms", "Gram float32 ms", "Gram bfloat16 ms"],
        rows,
    )
    quality = markdown_table(
        ["input (256 x 1024)", "path", "dtype", "singular values", "distance to float32"],
        [
            [q["input"], q["path"], q["dtype"], f"{q['sv_min']:.3g} to {q['sv_max']:.3g}",
             f"{q['rel_to_float32']:.3g}"]
            for q in r["quality"]
        ],
    )  # fmt: skip
    return f"{timing}\n\n{quality}\n\n{_measured(r)} Command: `{r['command'].strip()}`."


@section("meta_throughput")
def render_meta_throughput(r: dict) -> str:
    """Meta-training's speed with the single-worker gradient by autograd and by vmap."""
    rows = [
        [side, f"{r['seconds_per_meta_step'][side]:.2f}", f"{r['inner_steps_per_second'][side]:.0f}"]
        for side in ("autograd", "vmap")
    ]  # fmt: skip
    return (
        markdown_table(["single-worker gradient", "s per meta-step", "inner steps per s"], rows)
        + f"\n\n{r['speedup']:.2f}x faster meta-steps by autograd: the median over "
        f"{r['meta_steps_per_side']} meta-steps per side of `{r['config']}`, the sides taking "
        f"turns (load average {r['load_average_before'][0]:.1f} before). {_measured(r)} "
        f"Command: `{r['command']}`."
    )
