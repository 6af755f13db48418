"""The kernels of one user (an optimizer, a communicator), and when they are built.

:class:`Kernels` steps each tensor with the kernel of its kind (:func:`~.export.tensor_kind`)
once that is loaded, and every other tensor with one call of the reference; ``step()``
never waits for a build (see :mod:`learned_opt.kernel`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..config import NetConfig, with_weight_decay
from ..step import Parts
from . import worker
from .eager import step_tensors
from .export import (
    STEP,
    kernel_inputs,
    refresh_of,
    step_args,
    tensor_kind,
    tensor_stats,
    theta_inputs,
)
from .worker import Entry, Recipe, kernel_threads

#: the package, whose settings (:data:`~learned_opt.kernel.COMPILE_AFTER`, ...) are read at each use
knobs = sys.modules[__package__]


def compiling_enabled() -> bool:
    """False where :data:`~learned_opt.kernel.COMPILE_ENV` is ``0`` (or ``false``)."""
    value = os.environ.get(knobs.COMPILE_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise ValueError(f"Invalid {knobs.COMPILE_ENV}={value!r} (must be 0 or 1, or unset)")
    return value not in ("0", "false")


class Group(NamedTuple):
    """One param group's tensors on one device and dtype, as :meth:`Kernels.step_groups`
    takes them: its config (with its weight decay) and its step multiplier ``lr``."""

    cfg: NetConfig
    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    states: Sequence[dict]
    lr: float


def _shared_config(groups: Sequence[Group]) -> NetConfig:
    """The config of ``groups`` without weight decay, which a kernel takes per tensor; a
    ``ValueError`` where they differ in more."""
    cfg = with_weight_decay(groups[0].cfg, 0.0)
    if any(with_weight_decay(g.cfg, 0.0) != cfg for g in groups[1:]):
        raise ValueError("param groups stepped together must differ at most in weight_decay")
    return cfg


def _per_tensor(groups: Sequence[Group]) -> tuple[list[float], list[float]]:
    """Each tensor's ``lr`` and weight decay (its group's), over the groups' tensors in
    turn."""
    lrs = [float(g.lr) for g in groups for _ in g.params]
    return lrs, [g.cfg.weight_decay for g in groups for _ in g.params]


class KernelCache:
    """The kernels of one user, one :class:`~.worker.Entry` per kind of input, and when to
    build them: a kind's build is queued once it has run eagerly
    :data:`~learned_opt.kernel.COMPILE_AFTER` times and all the user's eager calls have taken
    :data:`~learned_opt.kernel.COMPILE_AFTER_SECONDS`; a kind whose package is on disk is
    queued at that step whatever the seconds, and the worker thread loads it while the
    reference keeps stepping (a process's first load probes the CPU's vector instruction
    set, 0.3-0.4 s, which a short run would otherwise wait for at that step)."""

    def __init__(self, compile: bool = True):
        self.compile = compile
        self._entries: dict[tuple, Entry] = {}
        #: host seconds of all the eager calls (not synchronised on CUDA): what the
        #: reference has cost this user, which decides when its kinds compile
        self.eager_seconds = 0.0

    def compiles(self, device: torch.device) -> bool:
        """Whether this user's kinds on ``device`` compile: ``compile`` set, compiling not
        turned off, and a device of :data:`~learned_opt.kernel.KERNEL_DEVICES`."""
        return self.compile and compiling_enabled() and device.type in knobs.KERNEL_DEVICES

    def _entry(self, key: tuple) -> Entry:
        """The entry of the kind ``key`` (made at its first call)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry()
        return entry

    def _queue_if_due(
        self, entry: Entry, args_of: Callable[[], tuple], recipe: Recipe | None = None
    ) -> None:
        """Count an eager call of a kind, and load or queue its kernel once due; ``args_of``
        gives the kind's build arguments (of ``recipe``, the step's by default), made only
        on the calls that need them."""
        recipe = recipe or STEP
        entry.eager_steps += 1
        if entry.eager_steps == 1:  # built before (another model, another rank, a run)
            entry.built = _is_built(recipe, args_of())
        if entry.queued or entry.eager_steps < knobs.COMPILE_AFTER:
            return
        if entry.built or self.eager_seconds >= knobs.COMPILE_AFTER_SECONDS:
            entry.queued = True
            worker._worker().submit(entry, args_of(), recipe)

    def ready(self) -> bool:
        """Whether every kind run so far runs its compiled kernel."""
        entries = [e for e in self._entries.values() if not e.failed]
        return bool(entries) and all(e.fn is not None for e in entries)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued compile has finished (or failed); returns
        :meth:`ready`. For benchmarks and tests: a step or a mix never waits."""
        for entry in list(self._entries.values()):
            if entry.queued and not entry.done.wait(timeout):
                return False
        worker._worker().join_if_idle(timeout)
        if not worker._worker().busy():
            worker._yield_threads(False)
        return self.ready()


class _Plan(NamedTuple):
    """Each tensor's kind, entry (None: the reference steps it) and shape statistics, and
    the ``(lr, decay)`` inputs of each tensor by the groups' values."""

    tensors: list[tuple[tuple | None, Entry | None, Tensor | None]]
    inputs: dict


class Kernels(KernelCache):
    """The compiled kernels of one optimizer (see :mod:`learned_opt.kernel`): one per kind of
    tensor, shared by every tensor of that kind whatever its size. The tensors without a
    kernel yet step together, in one call of the reference, whose eager packs keep their
    flat state in the optimizer's cache (:class:`~.eager._Pack`)."""

    def __init__(self, compile: bool = True):
        super().__init__(compile)
        self._plans: dict[tuple, _Plan] = {}  # see _plan
        self._lr: dict[tuple, Tensor] = {}  # (value, dtype, device): its 0-d tensor
        self._packs: dict = {}  # the eager packs' flat state (see eager._Pack)
        self._theta: tuple = (None, [])  # a theta dict, and its tensors as a kernel takes them

    def step(self, theta, cfg: NetConfig, parts: Parts, params, grads, states, lr) -> list[bool]:
        """:func:`~.eager.step_tensors` of every tensor, each with the kernel of its kind if
        that is ready, else with the reference; returns, per tensor, whether it was stepped.
        ``states`` are the tensors' optimizer states, whose entries an eager step may
        replace with views of a pack's flat state (see :class:`~.eager._Pack`)."""
        return self.step_groups(theta, parts, [Group(cfg, params, grads, states, lr)])[0]

    def step_groups(self, theta, parts: Parts, groups: Sequence[Group]) -> list[list[bool]]:
        """:meth:`step` of several param groups on one device and dtype, whose configs
        differ at most in ``weight_decay``; returns each group's flags. Each tensor steps
        with its group's ``lr`` and weight decay: a kernel takes both as inputs (a model
        split into the usual decay and no-decay groups uses the kernels of one group), and
        the tensors without one step in one reference call."""
        device = groups[0].params[0].device
        if device.type == "cpu":
            worker._yield_threads(worker._worker().busy())
        kernels = self.compiles(device)
        cfg = _shared_config(groups)
        # the kernel and the reference step outside autocast, which would otherwise cast
        # the matrix products of a step() called inside it
        outside = contextlib.nullcontext()
        if torch.is_autocast_enabled(device.type):
            outside = torch.autocast(device.type, enabled=False)
        if len(groups) == 1:
            params, grads, states = groups[0].params, groups[0].grads, groups[0].states
        else:
            params, grads, states = (
                [t for g in groups for t in getattr(g, name)]
                for name in ("params", "grads", "states")
            )
        flags: list = [False] * len(params)
        with outside:
            eager = list(range(len(params)))
            if kernels:
                plan = self._plan(cfg, parts, params, grads, states)
                eager = self._run_kernels(theta, cfg, parts, groups, plan, flags, params, grads,
                                          states)  # fmt: skip
            if eager:  # the tensors without a kernel: one reference call for all of them
                start = time.perf_counter()
                oks = self._reference(theta, parts, cfg, groups, eager, params, grads, states)
                if kernels:
                    self._count_eager(time.perf_counter() - start, params, eager, plan)
                for i, ok in zip(eager, oks.tolist()):
                    flags[i] = ok
        out, at = [], 0
        for g in groups:
            out.append(flags[at : at + len(g.params)])
            at += len(g.params)
        return out

    def _run_kernels(
        self, theta, cfg, parts, groups, plan: _Plan, flags: list, params, grads, states
    ) -> list[int]:
        """Step each tensor whose kind has its kernel (its flag into ``flags``), count an
        eager step of each kind without one (loading or queueing it once due); returns the
        tensors left to the reference."""
        inputs = self._inputs(plan, groups, states[0]["v"].dtype, params[0].device)
        if self._theta[0] is not theta:
            self._theta = (theta, theta_inputs(theta))
        eager, waiting = [], {}
        for i, (kind, entry, stats) in enumerate(plan.tensors):
            if entry is None or entry.fn is None or entry.failed:
                eager.append(i)
                if entry is not None and entry.fn is None and not entry.failed:
                    waiting.setdefault(id(entry), (entry, i))
                continue
            p, g, s = params[i], grads[i], states[i]
            lr, decay = inputs[i]
            try:
                ok = entry.fn(kernel_inputs(self._theta[1], kind, p, g, s, lr, decay, stats),
                              refresh_of(cfg, kind, s))  # fmt: skip
            except Exception as e:  # a size its graph refuses: the reference steps the kind
                entry.failed = True
                warnings.warn(
                    f"learned_opt: the step kernel refused a tensor of shape {tuple(p.shape)} "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); its "
                    "kind keeps the eager reference step (correct, slower)",
                    RuntimeWarning,
                    stacklevel=4,
                )
                eager.append(i)
                continue
            flags[i] = bool(ok)
        for entry, i in waiting.values():
            kind = plan.tensors[i][0]
            self._queue_if_due(entry, lambda i=i, kind=kind: step_args(
                theta, cfg, parts, kind, params[i], grads[i], states[i]))  # fmt: skip
        return eager

    def _reference(self, theta, parts, shared, groups, picked, params, grads, states) -> Tensor:
        """:func:`~.eager.step_tensors` of the tensors ``picked`` (indices into ``groups``'
        tensors in turn) in one call: under the groups' config (``shared``, their
        :func:`_shared_config`, where they differ in weight decay, each tensor's then
        handed over as ``decay``), with the groups' ``lr`` where they share one, else one
        per tensor."""
        dtype, device = states[0]["v"].dtype, params[0].device
        owner = [k for k, g in enumerate(groups) for _ in g.params]
        used = [groups[k] for k in dict.fromkeys(owner[i] for i in picked)]
        cfg, decay = used[0].cfg, None
        lr = self._scalar(float(used[0].lr), dtype, device)
        lrs_differ = len({float(g.lr) for g in used}) > 1
        decays_differ = len({g.cfg for g in used}) > 1
        if lrs_differ or decays_differ:  # one value per tensor (a single group needs none)
            lrs, decays = _per_tensor(groups)
            if lrs_differ:
                lr = torch.tensor([lrs[i] for i in picked], dtype=dtype, device=device)
            if decays_differ:
                cfg = shared
                decay = torch.tensor([decays[i] for i in picked], dtype=dtype, device=device)
        params, grads, states = ([t[i] for i in picked] for t in (params, grads, states))
        return step_tensors(theta, cfg, parts, params, grads, states, lr, self._packs, decay)

    def _inputs(self, plan: _Plan, groups, dtype, device) -> list[tuple[Tensor, Tensor]]:
        """Each tensor's ``lr`` and ``decay`` kernel inputs (0-d), made again only when a
        group's ``lr`` or weight decay changes."""
        key = (tuple(float(g.lr) for g in groups), tuple(g.cfg.weight_decay for g in groups))
        inputs = plan.inputs.get(key)
        if inputs is None:
            lrs, decays = _per_tensor(groups)
            inputs = [
                (self._scalar(lr, dtype, device), self._scalar(decay, dtype, device))
                for lr, decay in zip(lrs, decays)
            ]
            if len(plan.inputs) >= knobs.MAX_PLANS:  # values that change step after step
                plan.inputs.clear()
            plan.inputs[key] = inputs
        return inputs

    def _scalar(self, value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``value`` as a 0-d tensor input, made again only when it changes."""
        key = (value, dtype, device)
        out = self._lr.get(key)
        if out is None:
            if len(self._lr) >= 4 * knobs.MAX_PLANS:  # values that change step after step
                self._lr.clear()
            out = self._lr[key] = torch.tensor(value, dtype=dtype, device=device)
        return out

    def _plan(self, cfg, parts, params, grads, states) -> _Plan:
        """Each tensor's kind and entry, kept by the signature of all the tensors, which
        holds everything that decides them (a step only builds this key; a model whose
        tensors change layout gets a plan of its own)."""
        threads = kernel_threads()
        key = (cfg, parts, threads, tuple(
            (p.dtype, tuple(p.shape), p.stride(), g.dtype, g.stride(), s["v"].dtype,
             s["m"].shape[0], bool(s.get("sparse_rows")), "q" in s)
            for p, g, s in zip(params, grads, states)
        ))  # fmt: skip
        plan = self._plans.get(key)
        if plan is None:
            tensors = []
            for p, g, s in zip(params, grads, states):
                kind = tensor_kind(cfg, p, g, s)
                entry = None if kind is None else self._entry((cfg, parts, kind, threads))
                stats = None if kind is None else tensor_stats(cfg, p, s)
                tensors.append((kind, entry, stats))
            if len(self._plans) >= knobs.MAX_PLANS:  # layouts that change step after step
                self._plans.clear()
            plan = self._plans[key] = _Plan(tensors, {})
        return plan

    def _count_eager(self, seconds: float, params, eager: list[int], plan: _Plan) -> None:
        """Add an eager call's ``seconds`` to the optimizer's and, by their share of the
        elements, to each kind's whose tensors it stepped."""
        self.eager_seconds += seconds
        total = max(sum(params[i].numel() for i in eager), 1)
        for i in eager:
            entry = plan.tensors[i][1]
            if entry is not None:
                entry.eager_seconds += seconds * params[i].numel() / total


def _is_built(recipe: Recipe, args: tuple) -> bool:
    """Whether the package of ``recipe`` for ``args`` is on disk already (False where the
    kernel folder cannot be used: the worker's build then says why)."""
    try:
        return recipe.path(args).is_file()
    except OSError:
        return False
