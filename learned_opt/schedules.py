"""The schedule to pair the learned step with when the run's length is known.

The learned rule anneals on its own only as far as its adapted step sizes shrink; tuned
AdamW usually ends lower on long runs because its schedule takes it to zero. On the
validation family (``benchmarks/validation.py --schedule``), holding the multiplier and
decaying it linearly to zero over the last fifth of the run was never worse than the
constant multiplier and raised the median of the runs of 1000 steps or more; cosine
annealing over the whole run helped runs of 200 steps more but lost on recurrent,
attention and embedding models (docs: *Results*, *Pairing the rule with a schedule*).
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

#: The share of the run over which :func:`wsd_schedule` decays the multiplier to zero.
DECAY_FRACTION = 0.2


class HoldThenDecay:
    """The multiplier's factor at scheduler step ``t``: 1 until the last ``decay`` steps of
    ``total_steps``, then linear to 0 at ``total_steps`` (and 0 after it). A class, not a
    lambda, so that the scheduler's ``state_dict`` carries it."""

    def __init__(self, total_steps: int, decay_fraction: float = DECAY_FRACTION):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
        if not 0.0 < float(decay_fraction) <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction!r}")
        self.total_steps = total_steps
        self.decay = max(1.0, float(decay_fraction) * total_steps)

    def __call__(self, t: int) -> float:
        return min(1.0, max(0.0, (self.total_steps - t) / self.decay))


def wsd_schedule(
    optimizer: Optimizer, total_steps: int, decay_fraction: float = DECAY_FRACTION
) -> LambdaLR:
    """A ``LambdaLR`` that holds each group's ``lr`` (the learned step's multiplier, or
    any optimizer's learning rate) and decays it linearly to zero over the last
    ``decay_fraction`` of ``total_steps`` (call its ``step()`` once per optimizer step)."""
    return LambdaLR(optimizer, HoldThenDecay(total_steps, decay_fraction))
