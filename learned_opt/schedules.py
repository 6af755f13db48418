"""A schedule for the learned step's multiplier when the run's length is known.

The rule needs none, and none is recommended: on 200 freshly drawn jobs of the task
distribution (``python -m benchmarks decide --a .:schedule=wsd --b .``) the rule under
:func:`wsd_schedule` was 0.999x the multiplier held [0.986, 1.013] in steps, autoencoders,
graph nets, MLPs and full-batch regressions below 0.97. What follows is how it was chosen
before that measurement.

The learned rule anneals on its own only as far as its adapted step sizes shrink; tuned
AdamW usually ends lower because its schedule takes it to zero. On the validation family
(``benchmarks/validation.py --schedule``, in git at ``40411a9``; the rule with its floor
e^-6), holding the multiplier and decaying it linearly to zero over the last half of the
run lifted the problems of 200 steps (median 1.41x tuned AdamW against 1.23x with the
multiplier held; the convex softmax problem 0.97x against 0.46x) and the recommender
(0.83x against 0.68x), and no row fell below 0.83x; over the last fifth it changed none of
the 200-step rows. Cosine annealing over the whole run helped the 200-step problems as
much, but lost on recurrent, attention and embedding models (docs: *Results*, *Pairing the
rule with a schedule*).
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

#: The share of the run over which :func:`wsd_schedule` decays the multiplier to zero:
#: the last half, chosen on the validation family against the last fifth (see the module).
DECAY_FRACTION = 0.5


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
