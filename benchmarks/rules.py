"""Optimizers to compare on drawn jobs, named by one string (a *side*), and one training run.

A side is one of:

* ``.`` -- the shipped rule of this checkout; ``.:field=value,...`` replaces fields of its
  config (``.:lr_adapt_rate=0``); the pseudo-field ``schedule=wsd`` pairs the rule with
  ``learned_opt.wsd_schedule`` over the run (``.:schedule=wsd``, or ``schedule=wsd0.2``
  for another decay fraction);
* a git revision (``bbd8f5d``, ``HEAD~3``), optionally with ``:field=value,...`` -- the
  shipped single-worker rule of that revision, its ``learned_opt`` and checkpoints taken
  from git into a cache folder and imported as a package of its own, so two revisions step
  side by side in one process;
* ``adamw:LR`` -- AdamW at that learning rate (torch's other defaults), optionally
  ``adamw:LR:cosine`` with cosine annealing to 0 over the run;
* ``sfadamw`` (schedule-free AdamW, lr 2.5e-3, warm-up 5 %), ``prodigy`` (Prodigy, lr 1,
  cosine) and ``muon`` (``torch.optim.Muon`` at lr 0.02 on hidden matrices, AdamW 3e-3 on
  the rest): the zero-tuning anchors at their recommended settings.

Every learned side steps its eager reference (no compile), so a run's cost does not depend
on whether a kernel was built; :func:`run` records the seconds of each run beside its curve.
"""

from __future__ import annotations

import importlib
import inspect
import io
import math
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from learned_opt.meta_train.evaluation import final_loss

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "learned-opt" / "revisions"
ANCHORS = ("sfadamw", "prodigy", "muon")


def parse_side(side: str) -> tuple[str, dict]:
    """``(ref, fields)`` of a learned side: ``"bbd8f5d:lr_adapt_rate=0"`` ->
    ``("bbd8f5d", {"lr_adapt_rate": 0.0})``; ``true`` and ``false`` are booleans."""
    ref, _, rest = side.partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"side {side!r}: expected field=value, got {item!r}")
        if value.lower() in ("true", "false"):
            fields[key] = value.lower() == "true"
            continue
        try:
            fields[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            fields[key] = value
    return ref or ".", fields


def resolve_commit(ref: str) -> str:
    """The short commit of a git revision of this repository (one clear error otherwise)."""
    done = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise ValueError(f"{ref!r} is not a git revision of {ROOT}")
    return done.stdout.strip()


def import_revision(commit: str):
    """The ``learned_opt`` package of ``commit`` (with its shipped checkpoints), imported
    under the name ``learned_opt_<commit>``; extracted once into :data:`CACHE`."""
    name = f"learned_opt_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    folder = CACHE / commit
    if not (folder / name / "__init__.py").is_file():
        archive = subprocess.run(["git", "archive", commit, "learned_opt", "checkpoints"],
                                 cwd=ROOT, capture_output=True, check=True).stdout  # fmt: skip
        tmp = folder.with_name(f"{commit}.tmp")
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        (tmp / "checkpoints").rename(tmp / "learned_opt" / "checkpoints")
        (tmp / "learned_opt").rename(tmp / name)
        tmp.rename(folder) if not folder.exists() else None
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    package = importlib.import_module(name)
    checkpoint = importlib.import_module(f"{name}.checkpoint")
    checkpoint._PACKAGE = f"{name}.checkpoints"  # its shipped files, not this checkout's
    return package


def _rule_package(ref: str):
    if ref == ".":
        return importlib.import_module("learned_opt")
    return import_revision(resolve_commit(ref))


def learned_factory(side: str):
    """``factory(params) -> optimizer`` of a learned side (see the module docstring; its
    ``schedule`` is :func:`factory`'s)."""
    ref, fields = parse_side(side)
    fields.pop("schedule", None)
    package = _rule_package(ref)
    opt_cls = importlib.import_module(f"{package.__name__}.optimizer").LearnedOptimizer
    accepted = inspect.signature(opt_cls).parameters
    kwargs = {k: False for k in ("compile", "fused") if k in accepted}  # the eager reference
    if fields:
        network = importlib.import_module(f"{package.__name__}.network")
        checkpoint = importlib.import_module(f"{package.__name__}.checkpoint")
        if not hasattr(network, "with_config"):
            raise ValueError(f"side {side!r}: revision {ref} cannot replace config fields")
        net = checkpoint.load_checkpoint(checkpoint.DEFAULT_CHECKPOINT)[0]
        unknown = [k for k in fields if not hasattr(net.config, k)]
        if unknown:
            raise ValueError(f"side {side!r}: the config has no fields {unknown}")
        kwargs["net"] = network.with_config(net, fields)
    return lambda params: opt_cls(params, **kwargs)


def _muon(params):
    params = list(params)
    hidden = [p.dim() == 2 and min(p.shape) > 1 and max(p.shape) < 4096 for p in params]
    return muon_with_adamw(params, hidden, lr=3e-3)


def muon_with_adamw(params, hidden: list[bool], **adamw) -> _Pair:
    """``torch.optim.Muon`` (lr 0.02, momentum 0.95, Nesterov, weight decay 0.01) on the
    parameters ``hidden`` marks, ``AdamW(**adamw)`` on the rest, stepped as one (``.opts``:
    AdamW, then Muon; a model without hidden matrices is AdamW's alone, and the reverse)."""
    params = list(params)
    if len(params) != len(hidden):
        raise ValueError(f"{len(params)} parameters but a mask of {len(hidden)}")
    rest = [p for p, h in zip(params, hidden) if not h]
    muon = [p for p, h in zip(params, hidden) if h]
    opts = [torch.optim.AdamW(rest, **adamw)] if rest else []
    if muon:
        opts.append(
            torch.optim.Muon(muon, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
        )
    return _Pair(*opts)


class _Pair:
    """Two optimizers stepped as one (Muon on matrices, AdamW on the rest)."""

    def __init__(self, *opts):
        self.opts = list(opts)
        self.param_groups = [g for o in self.opts for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.opts:
            o.step()


def factory(side: str, steps: int):
    """``(make(params) -> optimizer, scheduler(opt) or None)`` for any side."""
    if side.startswith("adamw:"):
        _, lr, *schedule = side.split(":")
        cosine = schedule == ["cosine"]
        make = lambda params: torch.optim.AdamW(params, lr=float(lr))  # noqa: E731
        sched = (
            (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps))
            if cosine
            else None
        )
        return make, sched
    if side == "muon":
        return _muon, None
    if side == "sfadamw":
        import schedulefree

        return lambda p: schedulefree.AdamWScheduleFree(
            p, lr=2.5e-3, warmup_steps=max(1, steps // 20)
        ), None
    if side == "prodigy":
        import prodigyopt

        cos = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps)  # noqa: E731
        return lambda p: prodigyopt.Prodigy(p, lr=1.0), cos
    return learned_factory(side), learned_schedule(side, steps)


def learned_schedule(side: str, steps: int):
    """``scheduler(opt)`` of a learned side with ``schedule=wsd[FRACTION]``, else ``None``:
    the multiplier held, then decayed to 0 over the last ``FRACTION`` of the run (the
    shipped ``wsd_schedule``'s share when not given)."""
    schedule = parse_side(side)[1].get("schedule")
    if schedule is None:
        return None
    if not (isinstance(schedule, str) and schedule.startswith("wsd")):
        raise ValueError(f"side {side!r}: schedule must be wsd or wsdFRACTION, got {schedule!r}")
    from learned_opt.schedules import DECAY_FRACTION, wsd_schedule

    fraction = float(schedule[3:]) if schedule[3:] else DECAY_FRACTION
    return lambda o: wsd_schedule(o, steps, fraction)


def run(spec, side: str) -> dict:
    """Train the drawn job ``spec`` with ``side`` for its horizon; the per-step training loss
    (before each update; a non-finite loss ends the run and fills the rest with ``inf``),
    and the run's seconds from the optimizer's construction on."""
    from learned_opt.tasks.distribution import build

    torch.set_num_threads(1)
    job = build(spec)
    make, make_sched = factory(side, spec.horizon)
    start = time.perf_counter()
    opt = make(list(job.model.parameters()))
    sched = make_sched(opt) if make_sched else None
    # seeded after the optimizer is built: both sides of a draw train on one random stream
    # (sampling, dropout), whatever building theirs drew (another revision's network)
    torch.manual_seed(spec.seed)
    if hasattr(opt, "train"):  # schedule-free keeps two points; train mode steps the right one
        opt.train()
    curve = train(opt, sched, job.loss_fn, job.batches, spec.horizon)
    return {"curve": curve, "seconds": round(time.perf_counter() - start, 3)}


def diverged(curve: list[float]) -> bool:
    """A run diverged if its loss went non-finite or ended (smoothed) above its first loss."""
    return not curve or not math.isfinite(final_loss(curve)) or final_loss(curve) > curve[0]


def train(opt, sched, loss_fn, batches, steps: int, clock: list[float] | None = None,
          start: float = 0.0) -> list[float]:  # fmt: skip
    """Train ``steps`` steps of ``batches``; the per-step training loss, each taken before
    its update and kept to 6 digits (compact caches, the same speedups). A non-finite loss
    ends the run and fills the rest with ``inf``. ``clock``, if given, receives the seconds
    since ``start`` (``time.perf_counter()``) at the end of each step."""
    curve: list[float] = []
    for _, batch in zip(range(steps), batches):
        loss = loss_fn(batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            curve += [math.inf] * (steps - len(curve))
            break
        curve.append(float(f"{value:.6g}"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        if clock is not None:
            clock.append(time.perf_counter() - start)
    return curve
