"""The held-out table in the cards of the shipped checkpoints it measured.

``python -m benchmarks.quality_heldout ... --record-cards`` calls :func:`record_cards` after
a complete, full (not ``--quick``) run: each shipped checkpoint among the measured sides
gets a ``heldout`` entry in its card (when and how it was measured, the summary of the
issue's criteria, and its speedup per task and setting), so that ``learned-opt inspect``
and ``LearnedOptimizer(...).card`` show what it reaches on work it never saw. Theta and
the config are left as they are.
"""

from __future__ import annotations

from pathlib import Path

from learned_opt.checkpoint import (
    list_pretrained,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)


def heldout_card(payload: dict, side: str) -> dict:
    """The ``heldout`` card entry of ``side`` from a held-out suite result."""
    return {
        "measured": payload.get("date"),
        "command": payload.get("command"),
        "summary": payload["summaries"][side],
        "single": [
            {k: r[k] for k in ("task", "horizon", "speedup", "wall_speedup", "diverged")}
            for r in payload["single"]
            if r["side"] == side
        ],
        "decentralized": [
            {k: r[k] for k in ("task", "workers", "topology", "alpha", "speedup", "diverged")}
            for r in payload["decentralized"]
            if r["side"] == side
        ],
    }


def record_cards(payload: dict) -> list[Path]:
    """Write :func:`heldout_card` into the card of every shipped checkpoint among the
    payload's sides (files and factories are skipped); the files written."""
    if not payload.get("complete") or payload.get("quick"):
        raise ValueError("only a complete, full held-out run is recorded in the cards")
    shipped = set(list_pretrained())
    written = []
    for side in payload["sides"]:
        if side not in shipped:  # a file or a factory
            continue
        path = resolve_checkpoint(side)
        net, card = load_checkpoint(path)
        written.append(save_checkpoint(net, path, {**card, "heldout": heldout_card(payload, side)}))
    return written
