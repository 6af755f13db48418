"""Reference updates of the shipped checkpoints, recorded once from the pure step.

``data/golden_updates.pt`` holds, for every shipped checkpoint, the new parameters and
state that the pure step gave on the inputs built by :func:`golden_inputs` when it was
recorded (commit a511179, before the step math was written once; checkpoints shipped
later, such as ``ortho_init``, ``gossip_adapt`` and ``adapt_init_2x``, were added when they were shipped; ``adapt_init_2x`` was recorded again when it took four Newton-Schulz iterations instead of five). ``test_golden.py``
checks every path of today's code against it, so a refactor cannot change what the
shipped optimizers do. Regenerate only on purpose: ``python tests/core/golden.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "data" / "golden_updates.pt"
#: name -> shape; two tensors of one shape (stacked path), small ones (packed path), a
#: large one (several chunks) and a scalar.
SHAPES = {"w1": (13, 17), "w2": (13, 17), "b": (5,), "s": (), "emb": (50, 40)}
STEP, LR = 5, 0.7


def golden_inputs(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Per tensor: parameter, gradient and a warm state (``m`` ``(3, *shape)``, ``v``, and
    an adapted log step multiplier ``log_lr``, which only configs that adapt it read)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SHAPES.items():
        p = 0.05 * torch.randn(shape, generator=gen)
        g = 1e-2 * torch.randn(shape, generator=gen)
        m = 1e-2 * torch.randn((3, *shape), generator=gen)
        v = 1e-4 * torch.rand(shape, generator=gen)
        out[name] = {"p": p, "g": g, "m": m, "v": v, "log_lr": torch.tensor(0.5)}
    return out


def pure_step(theta, cfg, t: dict) -> dict[str, torch.Tensor]:
    """The pure step of one golden tensor ``t``: new ``p``, ``m``, ``v`` (and ``log_lr``
    when ``cfg`` adapts step sizes)."""
    from learned_opt.step import tensor_step

    log_lr = t["log_lr"] if cfg.adapts_lr else None
    out = tensor_step(theta, cfg, t["p"], t["g"], t["m"], t["v"], STEP, LR, log_lr=log_lr)
    return dict(zip(("p", "m", "v", "log_lr"), out))


def _record() -> None:
    """Record the shipped checkpoints that have no reference yet; existing ones are kept."""
    from learned_opt import list_pretrained, load_checkpoint

    result = torch.load(GOLDEN, weights_only=True) if GOLDEN.exists() else {}
    for ckpt in list_pretrained():
        if ckpt in result:
            continue
        net, _ = load_checkpoint(ckpt)
        theta = {k: v.detach() for k, v in net.named_parameters()}
        result[ckpt] = {
            name: pure_step(theta, net.config, t) for name, t in golden_inputs().items()
        }
    GOLDEN.parent.mkdir(exist_ok=True)
    torch.save(result, GOLDEN)


if __name__ == "__main__":
    _record()
