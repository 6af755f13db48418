"""Which local rule runs under gossip: candidates on the decentralized validation settings.

Every candidate runs the decentralized settings of :mod:`benchmarks.validation` (7
settings, seeds 0, 1, 2; tuned D-SGD, D-Adam and DSGT from its cache) and is ranked by
the criteria of issue 34, in order: divergences, settings whose averaged model ended
worse than tuned D-Adam's at some seed, the lowest speedup, the median speedup. The
candidates are the meta-trained gossip rule ``gossip_adapt`` and the single-worker rule
``adapt_init_2x`` with its gossip bounds varied (:meth:`NetConfig.under_gossip
<learned_opt.config.NetConfig.under_gossip>`) and with its moments mixed in every
exchange. Writes ``benchmarks/results/validation_gossip_rule.json``; the docs' results
page renders it.

    python -m benchmarks.gossip_rule_choice --jobs 2
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks import validation
from benchmarks.common import command_line, machine, write_json

#: (label, --side or --checkpoint arguments of benchmarks.validation)
CANDIDATES = [
    ("gossip_adapt", ["--checkpoint", "gossip_adapt"]),
    ("ceiling e^2 (before)", ["--side", "e2=adapt_init_2x:lr_adapt_max_gossip=2"]),
    ("ceiling e^3", ["--side", "e3=adapt_init_2x:lr_adapt_max_gossip=3"]),
    ("ceiling e^4", ["--side", "e4=adapt_init_2x:lr_adapt_max_gossip=4"]),
    ("ceiling e^5", ["--side", "e5=adapt_init_2x:lr_adapt_max_gossip=5"]),
    ("ceiling e^7", ["--side", "e7=adapt_init_2x:lr_adapt_max_gossip=7"]),
    ("ceiling e^5, floor e^-3",
     ["--side", "e5f3=adapt_init_2x:lr_adapt_max_gossip=5,lr_adapt_min_gossip=-3"]),
    ("ceiling e^5, floor e^-4",
     ["--side", "e5f4=adapt_init_2x:lr_adapt_max_gossip=5,lr_adapt_min_gossip=-4"]),
    ("ceiling e^5, moments in every exchange",
     ["--side", "e5s1=adapt_init_2x:lr_adapt_max_gossip=5,share_state_every=1"]),
]  # fmt: skip


def rank_key(summary: dict) -> tuple:
    """Smaller is better: divergences, settings worse than D-Adam, then the lowest and the
    median speedup, larger first."""
    return (
        summary["divergences_decentralized"],
        summary["decentralized_worse_than_dadam"],
        -summary["min_speedup_decentralized"],
        -summary["median_speedup_decentralized"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    start, rows = time.perf_counter(), []
    for label, spec in CANDIDATES:
        vparser = validation.make_parser()
        vargs = vparser.parse_args([*spec, "--no-single", "--jobs", str(args.jobs)])
        side = validation.checked_side(vparser, vargs)
        print(f"== {label}", flush=True)
        payload = validation.execute(vargs, side, " ".join(spec))
        rows.append({"label": label, "arguments": " ".join(spec),
                     "summary": {k: v for k, v in payload["summary"].items()
                                 if "decentralized" in k},
                     "rows": payload["decentralized"]})  # fmt: skip
    ranked = sorted(rows, key=lambda r: rank_key(r["summary"]))
    write_json("validation_gossip_rule", {
        "benchmark": "gossip_rule_choice", "candidates": rows, "best": ranked[0]["label"],
        "seeds": list(validation.SEEDS), "wall_seconds": round(time.perf_counter() - start, 1),
        "command": command_line("python -m benchmarks.gossip_rule_choice", argv),
        **machine(),
    })  # fmt: skip
    print(f"best: {ranked[0]['label']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
