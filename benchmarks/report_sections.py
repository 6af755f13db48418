"""The registry of the generated result sections (see ``report.py``), their shared pieces, and
the gossip benchmarks' renderers; the other renderers are in the ``report_*`` modules."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

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


def _f(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{v:.4g}"


def _measured(r: dict) -> str:
    return f"Measured {r.get('date', '?')} on {r.get('machine', '?')}, torch {r.get('torch', '?')}."


def seeds_phrase(seeds: list[int]) -> str:
    """How a decentralized benchmark's rows were taken over ``seeds``, for a caption."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return (
        f"the median over seeds {', '.join(map(str, seeds))} (data split, initialisation "
        "and batches; baselines tuned per seed)"
    )


#: How a rule's table says which schedule its multiplier ran under (constant: nothing).
SCHEDULE_PHRASES = {
    "cosine": ", its learning rate annealed to 0 by torch's `CosineAnnealingLR` over each run",
    "wsd": ", its learning rate held, then decayed linearly to 0 over the last fifth of each run",
    "wsd_half": ", its learning rate held, then decayed linearly to 0 over the last half of each run",
}


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
    """The held-out rows of ``local_steps.json`` (the shared compressed outer step against
    exact per-step gossip), the validation's choice, and what passed."""
    t, c = r["targets"], r["validation"]["chosen"]
    header = ["task", "ranks", "topology", "data", "steps", "outer rule", "H", "bytes/rank",
              "fewer bytes", "test loss", "exact gossip", "loss ratio", "pass"]  # fmt: skip
    rows = [
        [x["task"], x["workers"], x["topology"],
         "iid" if x["partition"] == "iid" else f"skew {x['alpha']:g}", x["horizon"],
         f"{x['rule']} {x['lr']:g}" + (" (default)" if x["H"] == c["H"] else ""), x["H"],
         f"{x['bytes_per_rank']:,.0f}", _x(x["bytes_reduction_x"]), _f(x["final"]),
         _f(x["exact_final"]), _x(x["loss_ratio"]), "yes" if x["passes"] else "no"]
        for x in r.get("heldout", {}).get("rows", [])
    ]  # fmt: skip
    s = r.get("heldout", {}).get("summary", {})
    rules = [k for k in s if k != "learned_vs_nesterov"]
    passing = "; ".join(
        f"{k} {s[k]['passes']} of {s[k]['of']}"
        + (f" (>= {t['stretch_bytes_reduction_x']:g}x within the loss target on one)"
           if s[k]["stretch"] else "")
        for k in rules
    )  # fmt: skip
    versus = ", ".join(f"{v['task']} H={v['H']}: {v['loss_ratio']:.3g}x"
                       for v in s.get("learned_vs_nesterov", []))  # fmt: skip
    lrs = ", ".join(f"{k} {c[k]['lr']:g}" for k in rules if k in c)
    return (
        markdown_table(header, rows)
        + f"\n\nTarget: at least {t['bytes_reduction_x']:g}x fewer bytes per rank than exact "
        f"per-step gossip (Adam, Metropolis weights, float32) with the averaged model's test "
        f"loss at most {t['loss_ratio']:g}x the exact run's, one setting at "
        f">= {t['stretch_bytes_reduction_x']:g}x. Chosen on the validation settings: "
        f"H={c['H']}, {c['compression']}, outer lr {lrs}. Settings passing at the default "
        f"H: {passing}. The learned outer rule's loss over Nesterov's at the same bytes: "
        f"{versus}. Inner Adam lr {r['inner']['lr']:g} in both arms; bytes as sent (indices, "
        "packed values, scales) to every other rank. "
        + _measured(r)
        + f" Command: `{r['command']}`. Plot: `benchmarks/results/local_steps.png`."
        + _real_ranks(r.get("real_ranks"))
    )


def _real_ranks(x: dict | None) -> str:
    """The held-out setting that ran on real gloo ranks, beside its simulation."""
    if not x:
        return ""
    s, sim = x["setting"], x["simulated"]
    runs = "; ".join(
        f"{how} test loss {x[n]['test_loss']:.4g} ({x['loss_ratio'][n]:.3f}x exact), "
        f"{x[n]['bytes_per_rank']:,.0f} bytes per rank"
        for n, how in (("torchrun", "the torchrun entry"), ("lightning", "`GossipStrategy`"))
    )
    return (
        f"\n\nOn {s['workers']} real gloo ranks (`{x['command']}`), {s['task']} with "
        f"{x['rule']} {x['lr']:g} at H={x['H']}: {runs}; simulated {sim['final']:.4g} "
        f"({sim['loss_ratio']:.3f}x), {sim['bytes_per_rank']:,.0f} bytes. Exact gossip there: "
        f"{x['exact']['test_loss']:.4g} and {x['exact']['bytes_per_rank']:,.0f} bytes per rank "
        f"(simulated {sim['exact_final']:.4g} and {sim['exact_bytes_per_rank']:,.0f}; the "
        "entry's exchanges also carry the loss and a header)."
    )


@section("local_steps:summary")
def render_local_steps_summary(r: dict) -> str:
    """One line per held-out setting: each outer rule's bytes reduction and loss ratio at
    the chosen default ``H`` (for the guide and the README)."""
    c, lines = r["validation"]["chosen"], []
    for e in r["heldout"]["exact"]:
        mine = [x for x in r["heldout"]["rows"] if x["task"] == e["task"] and x["H"] == c["H"]]
        data = "IID" if e["partition"] == "iid" else f"label skew {e['alpha']:g}"
        cells = ", ".join(f"{x['rule']} {_x(x['loss_ratio'])} the loss at "
                          f"{x['bytes_reduction_x']:.0f}x fewer bytes" for x in mine)  # fmt: skip
        lines.append(f"- {e['task']}, {e['workers']} ranks ({e['topology']}, {data}), "
                     f"{e['horizon']} steps: {cells}.")  # fmt: skip
    return (
        f"Default H={c['H']}, {c['compression']}; loss ratios against exact per-step gossip "
        f"(target: at most {r['targets']['loss_ratio']:g}x at "
        f">= {r['targets']['bytes_reduction_x']:g}x fewer bytes):\n\n" + "\n".join(lines)
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
