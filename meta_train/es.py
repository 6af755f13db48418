"""Antithetic evolution strategies over the rule's constants, scored on whole training runs.

One meta-step:

1. ``pairs`` perturbations ``eps_i ~ N(0, I)`` of ``theta_c`` (:mod:`.rule_space`) give a
   population of ``2 * pairs`` members, ``theta_c + sigma * eps_i`` and
   ``theta_c - sigma * eps_i``;
2. ``draws`` jobs are drawn from the family (seeds from :data:`META_SEEDS` on, a pure
   function of the meta-step); every member trains every job for its whole horizon, capped
   at ``horizon_cap`` steps, and so does the base rule (``theta_c = 0``);
3. a member's score on a draw is the log of its step speedup over the base rule there
   (:func:`learned_opt.meta_train.evaluation.speedup`: the steps the base rule needs to
   reach the worse of the two best smoothed losses over the steps the member needs),
   clipped to ``[1/clip, clip]`` (a run that diverged where the other did not scores the
   clip, as the decision procedure scores it), plus ``final_weight`` times the log of the
   base rule's final smoothed loss over the member's, clipped alike. Steps are whole
   numbers: on a short run where both rules are still descending at the end, both reach the
   common level at the last step, and the final losses alone tell the members apart;
4. the gradient of the mean score is estimated from the pairs,
   ``sum_i (S(+eps_i) - S(-eps_i)) / (2 sigma) * eps_i / pairs``, and an outer Adam step
   climbs it.

Every run of a meta-step is a *work unit* ``(member, draw)`` (member ``-1``: the base rule);
:func:`balanced_shares` splits the units across ranks by their estimated cost
(:func:`job_cost`), and the curves are gathered before scoring, so N processes do each run
once in total and compute the same update as one process.
Everything here is a pure function of its arguments; no Lightning.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch

from .evaluation import final_loss, smooth, speedup
from .families import FamilyJob

#: Meta-training draws from this seed of the task distribution on (decisions draw below it;
#: see ``benchmarks/decide.py``, whose constant of the same name this is).
META_SEEDS = 10_000_000
#: The draws of the estimator's validation start here (inside the meta-training range,
#: far above the draws of any run's training steps).
VAL_SEEDS = META_SEEDS + 1_000_000_000
BASE = -1  # the member index of the base rule

Unit = tuple[int, int]  # (member, draw index)


def draw_seeds(first_seed: int, meta_step: int, draws: int) -> list[int]:
    """The job seeds of ``meta_step``: disjoint across meta-steps."""
    start = int(first_seed) + int(meta_step) * int(draws)
    return list(range(start, start + int(draws)))


def perturbations(first_seed: int, meta_step: int, pairs: int, dim: int) -> torch.Tensor:
    """The ``(pairs, dim)`` standard normal perturbations of ``meta_step`` (float64)."""
    gen = torch.Generator().manual_seed((int(first_seed) * 1_000_003 + int(meta_step)) % 2**62)
    return torch.randn(pairs, dim, generator=gen, dtype=torch.float64)


def population(theta: torch.Tensor, eps: torch.Tensor, sigma: float) -> torch.Tensor:
    """The ``(2 * pairs, dim)`` members: row ``2i`` is ``theta + sigma eps_i``, row ``2i+1``
    is ``theta - sigma eps_i``."""
    theta = theta.detach().to(torch.float64).reshape(1, -1)
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(eps.shape[0])
    return theta + sigma * signs[:, None] * eps.repeat_interleave(2, dim=0)


def work_units(members: int, draws: int) -> list[Unit]:
    """Every run of a meta-step, draw by draw: the base rule's, then each member's. Draw by
    draw, so that :func:`share` gives every rank about as many runs of each draw (the
    draws' costs differ by orders of magnitude)."""
    return [(m, d) for d in range(draws) for m in range(BASE, members)]


def share(units: Sequence[Unit], rank: int, world: int) -> list[Unit]:
    """Rank ``rank``'s units of ``world``: every ``world``-th, from its own index."""
    return list(units[rank::world])


def job_cost(job: FamilyJob, cap: int) -> float:
    """A job's rough cost in a run: its steps times its parameters, each tensor counted as
    at least 2,000 elements (the optimizer's work per tensor)."""
    sizes = [p.numel() for p in job.model.parameters()]
    return float(horizon(job, cap) * (sum(sizes) + 2_000 * len(sizes)))


def balanced_shares(units: Sequence[Unit], costs: Sequence[float], world: int) -> list[list[Unit]]:
    """``units`` split into ``world`` shares of about equal cost (``costs[d]``: a run of draw
    ``d``): the costliest first, each to the least loaded rank (ties to the lowest rank).
    Every rank computes the same split."""
    shares: list[list[Unit]] = [[] for _ in range(world)]
    loads = [0.0] * world
    for unit in sorted(units, key=lambda u: (-costs[u[1]], u[1], u[0])):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shares[rank].append(unit)
        loads[rank] += costs[unit[1]]
    return shares


def run_curve(job: FamilyJob, make_opt: Callable, steps: int, seed: int) -> list[float]:
    """Train ``job`` for ``steps`` steps; the loss before each update. A non-finite loss
    ends the run, and the rest of the curve is ``inf``."""
    torch.manual_seed(seed)
    opt = make_opt(list(job.model.parameters()))
    curve: list[float] = []
    for _, batch in zip(range(steps), job.batches):
        loss = job.loss_fn(batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            return curve + [math.inf] * (steps - len(curve))
        curve.append(value)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return curve


def horizon(job: FamilyJob, cap: int) -> int:
    """The steps a job trains for: its own horizon, capped at ``cap``."""
    return min(int(job.horizon), int(cap)) if job.horizon else int(cap)


def run_units(
    units: Sequence[Unit],
    members: torch.Tensor,
    seeds: Sequence[int],
    make_job: Callable[[int], FamilyJob],
    make_rule: Callable[[torch.Tensor | None], Callable],
    horizon_cap: int,
) -> dict[Unit, dict]:
    """The curves of ``units``: ``{(member, draw): {"curve", "kind", "seconds"}}``.
    ``make_rule(theta)`` gives an optimizer factory (``theta=None``: the base rule)."""
    import time

    out = {}
    for m, d in units:
        # training needs autograd, also where the caller runs under no_grad or inference
        # mode (Lightning's validation)
        with torch.inference_mode(False), torch.enable_grad():
            job = make_job(seeds[d])
            start = time.perf_counter()
            rule = make_rule(None if m == BASE else members[m])
            curve = run_curve(job, rule, horizon(job, horizon_cap), seeds[d])
        out[(m, d)] = {
            "curve": curve,
            "kind": job.kind,
            "seconds": time.perf_counter() - start,
        }
    return out


def diverged(curve: list[float]) -> bool:
    """Non-finite, or ended (smoothed) above its first loss."""
    s = smooth(curve)
    return not s or not math.isfinite(s[-1]) or s[-1] > curve[0]


def log_speedup(member: list[float], base: list[float], clip: float = 20.0) -> float:
    """The log of ``member``'s step speedup over ``base``, clipped to ``+-log(clip)``; a run
    that diverged where the other did not scores the clip."""
    a, b = diverged(member), diverged(base)
    if a != b:
        return -math.log(clip) if a else math.log(clip)
    s = speedup(member, base)
    return math.log(min(max(s, 1 / clip), clip)) if s > 0 else 0.0  # both never finite


def log_final_ratio(member: list[float], base: list[float], clip: float = 20.0) -> float:
    """The log of ``base``'s final smoothed loss over ``member``'s, clipped to
    ``+-log(clip)`` (0 where both are not finite, or not positive)."""
    a, b = final_loss(member), final_loss(base)
    if not (math.isfinite(a) or math.isfinite(b)):
        return 0.0
    if not math.isfinite(a):
        return -math.log(clip)
    if not math.isfinite(b):
        return math.log(clip)
    if a <= 0 or b <= 0:
        return 0.0
    return min(max(math.log(b / a), -math.log(clip)), math.log(clip))


def draw_score(
    member: list[float], base: list[float], clip: float = 20.0, final_weight: float = 1.0
) -> float:
    """A member's score on one draw: its log step speedup over the base rule plus
    ``final_weight`` times the log ratio of their final losses."""
    score = log_speedup(member, base, clip)
    if final_weight:
        score += final_weight * log_final_ratio(member, base, clip)
    return score


def score_matrix(
    curves: dict[Unit, dict], members: int, draws: int, clip: float, final_weight: float = 1.0
) -> torch.Tensor:
    """``(members, draws)`` scores (:func:`draw_score`) of each member on each draw."""
    out = torch.empty(members, draws, dtype=torch.float64)
    for m in range(members):
        for d in range(draws):
            member, base = curves[(m, d)]["curve"], curves[(BASE, d)]["curve"]
            out[m, d] = draw_score(member, base, clip, final_weight)
    return out


def gradient(eps: torch.Tensor, scores: torch.Tensor, sigma: float) -> torch.Tensor:
    """The antithetic estimate of the gradient of the mean score (the direction to climb):
    ``scores`` holds each member's mean score, ``+eps_i`` and ``-eps_i`` in turn."""
    diff = scores[0::2] - scores[1::2]
    return (diff[:, None] * eps).sum(0) / (2 * sigma * eps.shape[0])


def summary(curves: dict[Unit, dict], scores: torch.Tensor) -> dict:
    """What a meta-step logs: the members' mean score, the base rule's divergences and the
    members', and the seconds of the runs."""
    base = [c for (m, _), c in curves.items() if m == BASE]
    members = [c for (m, _), c in curves.items() if m != BASE]
    return {
        "score": float(scores.mean()),
        "base_diverged": sum(diverged(c["curve"]) for c in base),
        "member_diverged": sum(diverged(c["curve"]) for c in members),
        "run_seconds": sum(c["seconds"] for c in curves.values()),
        "kinds": sorted({c["kind"] for c in base}),
    }


def merge(parts: Sequence[dict]) -> dict:
    """One dict of the curves every rank ran."""
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


def geometric_mean_speedup(scores: Sequence[float]) -> float:
    return math.exp(statistics.fmean(scores)) if scores else math.nan


__all__ = [
    "BASE",
    "balanced_shares",
    "META_SEEDS",
    "VAL_SEEDS",
    "diverged",
    "draw_score",
    "draw_seeds",
    "geometric_mean_speedup",
    "gradient",
    "horizon",
    "job_cost",
    "log_final_ratio",
    "log_speedup",
    "merge",
    "perturbations",
    "population",
    "run_curve",
    "run_units",
    "score_matrix",
    "share",
    "summary",
    "work_units",
]
