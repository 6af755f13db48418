"""Renderer of the validation family's tables (``benchmarks/validation.py``; see
``report.py``): one table of the single-worker problems with the zero-tuning anchors beside
the rule, one of the decentralized settings when the run has them, and the summary
against the targets."""

from __future__ import annotations

import math

from benchmarks.report import markdown_table, section
from benchmarks.validation_anchors import ANCHORS


def _x(v) -> str:
    if v is None:
        return "-"
    return "diverged" if not math.isfinite(v) else f"{v:.2f}x"


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


def _decentralized(r: dict) -> str:
    rows = [
        [row["task"], row["workers"], row["topology"], row["partition"], row["alpha"],
         row["best_baseline"], _cell(row), _x(row["speedup_vs"].get("D-Adam")),
         "yes" if row["worse_than_dadam"] else "no"]
        for row in r["decentralized"]
    ]  # fmt: skip
    header = ["problem", "ranks", "graph", "data", "alpha", "best baseline", "rule",
              "rule vs D-Adam", "final worse than D-Adam"]  # fmt: skip
    return markdown_table(header, rows)


#: How a rule's table says which schedule its multiplier ran under (constant: nothing).
SCHEDULE_PHRASES = {
    "cosine": ", its learning rate annealed to 0 by torch's `CosineAnnealingLR` over each run",
    "wsd": ", its learning rate held, then decayed linearly to 0 over the last fifth of each run",
    "wsd_half": ", its learning rate held, then decayed linearly to 0 over the last half of each run",
}


@section("validation")
@section("validation_final")
@section("validation_ns_bf16")
@section("validation_ns_pe3")
@section("validation_ns4")
@section("validation_ns4_decentralized")
@section("validation_adapt2x_tensor_stage9_decentralized")
@section("validation_adapt2x_tensor_stage9_shipped_bounds_decentralized")
@section("validation_soup89")
@section("validation_adapt2x_tensor_stage10")
@section("validation_adapt2x_tensor_stage10_shipped_bounds_decentralized")
@section("validation_adapt2x_tensor_stage10_gossip")
@section("validation_adapt2x_tensor_stage10_gossip_decentralized")
@section("validation_adapt2x_tensor_stage11")
@section("validation_adapt2x_tensor_stage11_decentralized")
@section("validation_adapt2x_tensor_stage11_gossip")
@section("validation_adapt2x_tensor_stage11_gossip_decentralized")
@section("validation_adapt2x_tail_stage1")
@section("validation_adapt2x_tail_from8_stage1")
@section("validation_adapt2x_tail_from8_lowlr_stage1")
@section("validation_ns3")
@section("validation_cosine")
@section("validation_wsd")
@section("validation_adapt2x_stage1")
@section("validation_adapt2x_tensor_stage1")
@section("validation_adapt2x_tensor_stage2")
@section("validation_adapt2x_tensor_stage3")
@section("validation_packed")
@section("validation_rate05")
@section("validation_floor6")
@section("validation_floor8")
@section("validation_shrink05")
@section("validation_shrink02")
@section("validation_noise10")
@section("validation_sparse_active")
@section("validation_floor6_wsd")
@section("validation_floor6_wsd_half")
@section("validation_adapt2x_tensor_stage4")
@section("validation_freeze_decay_wsd_half")
@section("validation_freeze_decay_cosine")
@section("validation_hold_growth_wsd_half")
@section("validation_wide_shrink025")
@section("validation_wide_shrink025_spectral")
@section("validation_dead05")
@section("validation_handset_now")
@section("validation_handset_seeds6")
@section("validation_adapt2x_tensor_stage8_seeds6")
@section("validation_adapt2x_tail_batch16_stage1_seeds6")
@section("validation_adapt2x_regression_long_stage1_seeds6")
@section("validation_nadam10")
@section("validation_nadam05")
@section("validation_ortho_floor1")
@section("validation_ortho_hypergradient")
@section("validation_ortho_hypergradient_wsd_half")
@section("validation_cosine_floor6")
@section("validation_cosine_discount")
@section("validation_cosine_target05")
@section("validation_cosine_target15")
@section("validation_lag_momentum")
@section("validation_lag_momentum_wsd_half")
@section("validation_lag_blend_wsd_half")
@section("validation_lag_ortho_wsd_half")
@section("validation_lag_adam_wsd_half")
@section("validation_lag_sparse")
@section("validation_lag_sparse_wsd_half")
@section("validation_before_sparse_lag")
@section("validation_sparse_lag")
@section("validation_sparse_lag_wsd_half")
@section("validation_switch300")
@section("validation_switch600")
@section("validation_switch1000")
@section("validation_rate02_wsd_half")
@section("validation_rate02")
@section("validation_rate02_decentralized")
@section("validation_rate03_decentralized")
@section("validation_objective_decentralized")
@section("validation_snr_gossip_decentralized")
@section("validation_stage3_now_wsd_half")
@section("validation_stage3_now")
@section("validation_adapt2x_tensor_stage6")
@section("validation_stage5_now")
@section("validation_adapt2x_tensor_stage7")
@section("validation_adapt2x_tensor_stage8")
@section("validation_adapt2x_tensor_stage8_wsd_half")
@section("validation_adapt2x_tensor_stage9")
@section("validation_adapt2x_tensor_stage9_wsd_half")
@section("validation_adapt2x_tensor_stage9_tables")
@section("validation_ortho_snr1")
@section("validation_gossip_displacement_decentralized")
@section("validation_gossip_tracking_decentralized")
@section("validation_gossip_now_decentralized")
@section("validation_gossip_state4_decentralized")
@section("validation_gossip_no_state_decentralized")
@section("validation_state_bf16_decentralized")
@section("validation_shared_v_only_decentralized")
@section("validation_shared_m_only_decentralized")
@section("validation_adapt2x_tensor_stage5_wsd_half")
@section("validation_adapt2x_tensor_stage5")
@section("validation_rate01_wsd_half")
@section("validation_orthomax2_wsd_half")
@section("validation_nesterov64")
@section("validation_whiten64")
@section("validation_whiten64_seeds345")
@section("validation_whiten64_decentralized")
@section("validation_whiten64_squared")
@section("validation_whiten_sampled")
@section("validation_whiten_sampled_seeds345")
@section("validation_whiten_sampled32")
@section("validation_adam_metric_cosine")
@section("validation_adam_hypergradient_cosine")
@section("validation_omax192")
@section("validation_ortho_ceiling2")
@section("validation_ortho_step8")
@section("validation_adam_step4")
@section("validation_cautious")
@section("validation_nesterov64_wsd_half")
@section("validation_nesterov64_decentralized")
@section("validation_nesterov_all")
@section("validation_nesterov128")
@section("validation_nesterov005")
@section("validation_nesterov005_wsd_half")
@section("validation_ns_lazy2")
@section("validation_ns_stale2")
@section("validation_ns_adaptive15")
@section("validation_ns_every2")
@section("validation_ns_every3")
@section("validation_width_family")
@section("validation_width_family_wsd_half")
@section("validation_omax128")
@section("validation_omax128_wsd_half")
@section("validation_ortho_width")
@section("validation_ortho_cap0")
@section("validation_ns_reuse2")
@section("validation_ns_reuse2_wsd_half")
@section("validation_ns_reuse4")
@section("validation_ns_reuse2_min64")
@section("validation_ns_reuse2_min64_wsd_half")
@section("validation_ns_lagged2_min64")
@section("validation_ns_lagged2_min64_wsd_half")
@section("validation_ns4_now")
@section("validation_ns4_now_wsd_half")
@section("validation_ns4_now_decentralized")
@section("validation_moment_rows_decentralized")
@section("validation_ns3_now")
@section("validation_ns3_now_wsd_half")
@section("validation_ns3_now_decentralized")
@section("validation_peak_bounds_wsd_half")
@section("validation_ns_warm_start")
@section("validation_ns_reuse_min96")
@section("validation_nesterov64_reuse96")
@section("validation_update_hypergradient")
@section("validation_update_hypergradient_blend")
@section("validation_ortho_whitened_cosine")
@section("validation_floor1")
@section("validation_gossip_ceiling7_decentralized")
@section("validation_gossip_ceiling3_decentralized")
@section("validation_gossip_ceiling4_decentralized")
@section("validation_gossip_ceiling6_decentralized")
@section("validation_gossip_ceiling7_now_decentralized")
@section("validation_weight_decay")
def render_validation(r: dict) -> str:
    s = r["summary"]
    side = r["side"]
    fields = ", ".join(f"{k}={v}" for k, v in (side.get("fields") or {}).items())
    parts = [_single(r)]
    if r.get("decentralized"):
        parts.append(_decentralized(r))
    summary = (
        f"Small problems (at most 300 steps): median {_x(s['median_speedup_short'])}; runs of"
        f" 1000 steps or more: median {_x(s['median_speedup_long'])}; lowest row"
        f" {_x(s['min_speedup'])}; rows below 0.9x: {', '.join(s['rows_below_0.9']) or 'none'};"
        f" divergences: {s['divergences']}."
    )
    if r.get("decentralized"):
        summary += (
            f" Decentralized: median {_x(s['median_speedup_decentralized'])} against the best"
            f" tuned baseline, {s['divergences_decentralized']} diverged,"
            f" {s['decentralized_worse_than_dadam']} of {s['decentralized_rows']} ending above"
            " tuned D-Adam."
        )
        if r.get("gossip_bounds"):
            b = r["gossip_bounds"]
            summary += (
                f" Gossip bounds of the rule: ceiling e^{b['lr_adapt_max_gossip']:g}, floor"
                f" e^{b['lr_adapt_min_gossip']:g}, rate {b['lr_adapt_rate_gossip']},"
                f" signal-to-noise exponent {b['ortho_snr_gossip']}."
            )
    parts.append(
        summary + f" Step speedup against AdamW tuned per problem and horizon (constant or cosine,"
        f" rates {', '.join(f'{x:g}' for x in r['adamw_grid'])}), the median over seeds"
        f" {', '.join(map(str, r['seeds']))}; anchors at their documented settings, untuned."
        f" Rule: `{side.get('checkpoint', side.get('label'))}`"
        + (f" with {fields}" if fields else "")
        + SCHEDULE_PHRASES.get(r.get("schedule", "constant"), "")
        + f". Measured {r['date']} on {r['machine']}, torch {r['torch']}, commit"
        f" {r['commit']}. Wall time {r['wall_seconds'] / 60:.0f} min. Command:"
        f" `{r['command']}`." + (f" {r['note']}" if r.get("note") else "")
    )
    return "\n\n".join(parts)


@section("meta_training_stages")
@section("meta_training_stages_seeds6")
def render_meta_stages(r: dict) -> str:
    """The meta-training stages against the hand-set rule (``benchmarks/meta_stages.py``)."""

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


#: The rows of the headroom table (``benchmarks/validation_headroom.py``), in order.
HEADROOM_ROWS = (
    ("reference", "the shipped rule"),
    ("best_variant", "the best single variant"),
    ("best_pair", "the better of two variants, per row and seed"),
    ("per_row_across_seeds", "each row's best variant, chosen on the other seeds"),
    ("per_row_in_sample", "each row's and seed's best variant (in sample)"),
)


@section("validation_headroom")
def render_headroom(r: dict) -> str:
    """What choosing per problem among the validation records could reach."""
    s = r["summaries"]
    base = s["reference"]["median"]
    rows = []
    for key, what in HEADROOM_ROWS:
        x = s[key]
        names = ", ".join(f"`{n}`" for n in x.get("names", ()))
        rows.append(
            [what + (f" ({names})" if names else ""), f"**{_x(x['median'])}**",
             f"{x['median'] / base:.2f}", _x(x["median_short"]), _x(x["median_long"]),
             _x(x["lowest"]), f"{x['geomean_over_reference']:.2f}"]
        )  # fmt: skip
    header = ["choice", "median", "times the shipped rule's", "small problems",
              "runs of 1000+ steps", "lowest row", "row by row"]  # fmt: skip
    settings = [
        [d["task"], d["workers"], d["topology"], d["partition"], d["alpha"],
         f"{len(d['not_worse_than_dadam'])} of {d['records']}",
         "-" if d["best"] is None else f"`{d['best']}` ({_x(d['best_speedup'])})"]
        for d in r.get("decentralized", [])
    ]  # fmt: skip
    dec_header = ["problem", "ranks", "graph", "data", "alpha",
                  "records ending no worse than D-Adam", "fastest of them"]  # fmt: skip
    return (
        markdown_table(header, rows)
        + ("\n\n" + markdown_table(dec_header, settings) if settings else "")
        + f"\n\nSingle-worker validation family, seeds {', '.join(map(str, r['seeds']))}: step"
        f" speedups against tuned AdamW from {len(r['variants'])} records that ran every"
        f" problem at those seeds (variants of the rule, meta-trained stages and schedules;"
        f" the reference `{r['reference']}.json` among them). Row by row: the geometric mean"
        f" over the reference's speedup, every problem and seed. Targets: runs of 1000+"
        f" steps {r['targets']['median_long']}, lowest row {r['targets']['lowest']}, a"
        f" meta-trained median {r['targets']['times_reference']} times the hand-set rule's."
        f" Decentralized: every record of the setting, at whatever seeds it ran; no worse"
        f" than D-Adam means at every seed, against D-Adam tuned in the same run."
        f" Generated from the records by `{r['command']}`."
    )
