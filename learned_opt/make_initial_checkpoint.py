"""Write the hand-initialised checkpoint: zero output heads, i.e. exactly Adam(lr=1e-3)
with Metropolis-Hastings mixing. Run: ``python -m learned_opt.make_initial_checkpoint OUT``."""

from __future__ import annotations

import sys

from .checkpoint import save_checkpoint
from .config import NetConfig
from .network import LearnedOptimizerNet

CARD = {
    "name": "adam-init",
    "trained": False,
    "summary": (
        "Hand-initialised, NOT meta-trained. The output heads are zero, so the local update "
        "is exactly Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8) and the mixing weights are "
        "exactly Metropolis-Hastings 1/(1+max degree). It is a correct starting point for "
        "meta-training, not an improvement over Adam."
    ),
    "command": "python -m learned_opt.make_initial_checkpoint checkpoints/adam_init.pt",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else "checkpoints/adam_init.pt"
    width = int(argv[1]) if len(argv) > 1 else 8
    config = NetConfig(width=width)
    card = dict(CARD, config=config.to_dict())
    print(save_checkpoint(LearnedOptimizerNet(config), out, card))


if __name__ == "__main__":
    main()
