"""Renderers of the speed sections (see ``report.py``): the step cost against AdamW
(``step_overhead``), the device check (``cuda_check``) and the wall clock with the compile
included (``wallclock_heldout``)."""

from __future__ import annotations

from benchmarks.report_sections import _measured, _x, markdown_table, section

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


@section("cuda_check")
def render_cuda_check(r: dict) -> str:
    checks, env = r["checks"], r["checks"]["environment"]["result"]
    rows = [
        [name, c["status"], "; ".join(filter(None, [c.get("error"), c.get("reason")]))]
        for name, c in checks.items()
    ]
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
    parts = [status]
    if step:
        parts.append(f"Step time on the GPU, the optimizers taking turns:\n\n{timing}")
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
    when = f"compiled in the background once its eager steps had taken {r['compile_after_seconds']:g} s"
    if r.get("cache", "empty") != "empty":
        when = f"was loaded at its first steps where the filled cache held it, else {when}"
    return (
        markdown_table(header, rows)
        + f"\n\nMedian: **{_x(s['median_speedup'])}** in steps, **{_x(s['median_wall_speedup'])}** "
        f"in wall-clock time with the compile included (the suite's figure, measured once the "
        f"kernel is compiled: {_x(s['median_recorded_wall_speedup'])}{paced}). Each side trained the "
        f"task {_trained(r)} ({r['threads']} thread, {_cache(r)}), at seed {r['timing_seed']}, "
        f"one process at a time; the rule's kernel {when}. Wall-clock speedup: AdamW's "
        f"seconds to the level (the worse of the two best smoothed losses) over the rule's, "
        f"each counted from the optimizer's construction. AdamW at the rate and schedule "
        f"tuned for seed {r['timing_seed']} in `{r['source']}`. {_measured(r)} Wall time "
        f"{r['wall_seconds'] / 60:.0f} min. Command: `{r['command']}`."
    )


def _cache(r: dict) -> str:
    """The rule's compile cache in a wall-clock run (``wallclock.py --cache``)."""
    if r.get("cache", "empty") == "empty":
        return "an empty compile cache"
    return (
        "a machine that has built before: a compile cache filled beforehand by each task's rule "
        "run, which built every kind of tensor it steps; the kernels load off the step"
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
        f"{r['timing_seed']}, {_cache(r)}), "
        f"the single-worker rows' median wall-clock speedup is **{_x(s['median_wall_speedup'])}** "
        f"({_x(s['median_speedup'])} in steps in those runs; "
        f"[table](docs/results.md#wall-clock-time-with-the-compile-included))."
    )
