"""``LearnedOptimizer``: the learned optimizer as a drop-in ``torch.optim.Optimizer``."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable
from itertools import chain

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._state_dict import refuse_foreign_keys
from .allocator import tune_malloc
from .checkpoint import (
    DEFAULT_CHECKPOINT,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from .config import NetConfig, with_weight_decay
from .features import compute_dtype, init_state
from .kernel import Group, Kernels
from .network import LearnedOptimizerNet, Theta
from .orthogonal import reuses_gram
from .step import Parts, active_parts, fit_state_rows, moment_rows


def _finite_nonnegative(value, where: str, given, accepted: str, what: str = "") -> float:
    """``value`` as a float, or a ``ValueError`` naming ``where`` and ``given`` (what the
    caller passed) unless it is a finite number >= 0 (``accepted``: what may be passed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Invalid {where}: {given!r} (must be {accepted})")
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"Invalid {where}: {given!r} ({what}must be finite and >= 0)")
    return float(value)


def checked_lr(lr, where: str = "lr") -> float:
    """``lr`` as a float, or a ``ValueError`` unless it is a finite number >= 0.

    A one-element ``Tensor`` is accepted, as torch's optimizers accept one."""
    value = lr
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or lr.dtype.is_complex or lr.dtype == torch.bool:
            raise ValueError(f"Invalid {where}: Tensor lr must be 1-element and real, got {lr!r}")
        value = lr.item()
    accepted = "a number or a one-element Tensor"
    return _finite_nonnegative(value, where, lr, accepted, "the multiplier ")


def checked_weight_decay(weight_decay, where: str = "weight_decay") -> float | None:
    """``weight_decay`` as a float (None stays None: the rule's own), or a ``ValueError``
    unless it is a finite number >= 0."""
    if weight_decay is None:
        return None
    return _finite_nonnegative(weight_decay, where, weight_decay, "a number >= 0 or None")


#: The error of a positional argument after ``params``.
KEYWORD_ONLY = (
    "LearnedOptimizer(params, {!r}): everything after params is keyword-only; lr= is a "
    "multiplier of the learned step (default 1.0, not a learning rate like Adam's 1e-3), "
    "and a checkpoint is passed as checkpoint='name or path'"
)


#: A multiplier at most this small, given when an optimizer or a param group is built, is
#: most likely a learning rate of Adam's kind (1e-2 to 1e-5) carried over from a script
#: written for another optimizer, and is warned about (a schedule lowering it later is not).
ADAM_SIZED_LR = 0.01
#: The warning for such a multiplier.
SMALL_LR = (
    "LearnedOptimizer: lr={lr!r} is a multiplier of the learned step, not a learning rate "
    "like Adam's: every step will be {factor:.0f}x smaller than the rule's own (lr=1.0, the "
    "default); leave lr out unless you mean it"
)


def has_empty_rows(grad: Tensor) -> bool:
    """Whether at least half the rows of a 2-D gradient are zeros: the mark of an embedding
    table, whose rows absent from the batch get no gradient. Such a matrix takes the Adam
    form, whose per-row step does not grow with the number of absent rows (an
    orthogonalised step has a fixed RMS over the whole matrix, so the few rows present
    would take it all). A hidden layer with a few dead ReLU units also has zero rows, but
    not half of them: it keeps the orthogonalised step (measured: a small MLP on two
    features lost half its speedup when any zero row sent it to the Adam form). Decided
    on the tensor's first gradient."""
    if grad.dim() != 2 or grad.shape[0] < 2:
        return False
    return 2 * int((grad == 0).all(dim=1).sum()) >= grad.shape[0]


class StalledError(RuntimeError):
    """Training has stalled: on :attr:`LearnedOptimizer.stall_steps` steps in a row, every
    tensor's update was skipped because its gradient or the parameter held NaN or Inf."""


class LearnedOptimizer(Optimizer):
    """A learned optimizer, used like any ``torch.optim`` optimizer.

    Everything after ``params`` is keyword-only: ``LearnedOptimizer(params, 1e-3)`` raises a
    ``TypeError`` (``lr`` is a multiplier, not Adam's learning rate).

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        checkpoint: a shipped name (see :func:`learned_opt.list_pretrained`) or a file path.
            A shipped name wins over a file of that name in the working directory (write
            ``./default`` for the file); ``checkpoint_path`` says which file was loaded.
            Ignored when ``net`` is given. Default (None): the shipped rule,
            :data:`~learned_opt.checkpoint.DEFAULT_CHECKPOINT`, the same alone and under
            a gossip wrapper.
        lr: a multiplier on the learned step (default 1.0), so every
            ``torch.optim.lr_scheduler`` works unchanged. A finite number >= 0, or a
            one-element Tensor (read with ``.item()`` once per group and step); it is
            checked again at every step, so a scheduler or an edit
            of ``param_groups`` that makes it negative, infinite or NaN raises a
            ``ValueError`` instead of corrupting the parameters.
        net: an in-memory :class:`LearnedOptimizerNet` to use instead of a checkpoint.
        weight_decay: decoupled weight decay, as AdamW's ``weight_decay`` (a number >= 0,
            per param group like ``lr``; None, the default: the rule's own,
            :attr:`~learned_opt.config.NetConfig.weight_decay`, 0 for every shipped rule).
            Before its update every tensor is multiplied by
            ``1 - weight_decay * step_mult * lr``, ``step_mult`` the rule's base step
            (1e-3 for every shipped rule): ``weight_decay=0.1`` decays as
            ``AdamW(lr=1e-3, weight_decay=0.1)`` does, and follows ``lr`` and its schedule.
            The usual param groups without decay for biases and norms work unchanged.
        compile: run the step's compiled kernel (the default), or always run the eager
            reference (``False``; also the environment variable
            ``LEARNED_OPT_COMPILE=0``). ``step()`` never waits for a compile: the first
            steps of a model run the reference while a child process builds the kernel
            (see :mod:`learned_opt.kernel`), and the steps after that run it. If building
            fails, one warning says why and the reference keeps stepping.

    With parameters on CPU the optimizer raises glibc's mmap and trim thresholds once per
    process, so that the eager step's temporaries reuse memory instead of being faulted in
    afresh every step (process-wide; ``LEARNED_OPT_TUNE_MALLOC=0`` leaves the allocator
    alone; see :mod:`learned_opt.allocator`).

    Per-parameter state (``self.state[p]``): momenta ``m`` (``[k, *p.shape]``: the first
    ``k`` of the decays 0.9, 0.99 and 0.999, those the rule reads; a rule that evaluates no
    network, like the shipped single-worker rule, reads only the first (and the second for
    an embedding table), so that its state is 8 bytes per float32 parameter, as AdamW's:
    see :func:`~learned_opt.step.moment_rows`) and second moment
    ``v`` in float32 (float64 for float64 parameters), the adapted log step multiplier
    ``log_lr``, the tensor's own step count ``step`` (its bias correction counts its own
    steps, as torch's Adam does: a tensor whose first gradient arrives late takes a normal
    first step), ``sparse_rows`` (a matrix whose first gradient left at least half its rows
    at zero, as an embedding's does: it takes the Adam form, never the orthogonalised step;
    see :func:`has_empty_rows`), ``q`` for a matrix that keeps the Gram polynomial of its
    last Newton-Schulz iteration between iterations (``r x r``, ``r`` its smaller side; see
    :attr:`~learned_opt.config.NetConfig.ns_every` and :func:`fit_gram_state`), and
    ``nonfinite_skips``: how many steps this tensor's update was skipped
    because its gradient or the parameter itself held NaN or Inf. Such a gradient never
    reaches the parameter or the state, and a non-finite parameter never spreads to the
    rest of its tensor; a parameter that holds NaN or Inf warns once, naming it. After
    :attr:`stall_steps` steps in a row on which every tensor was skipped, ``step()`` raises
    :class:`StalledError`, naming the cause and the parameters (nothing has changed then).
    ``group["step"]`` counts the group's steps. Theta lives in ``self.net``, not in
    ``state_dict()``.

    A parameter is left alone, with no state, until its gradient is non-zero somewhere: the
    learned step from zero state is not zero (its MLP has biases), so a tensor whose
    gradient is all zeros on the first step would otherwise move. Elements with a zero
    gradient inside a tensor that has a gradient do move, like with any learned update.

    ``config_transform``: ``None`` (the default), or a function of the network's
    :class:`~learned_opt.config.NetConfig` that gives the config the step runs with; a
    wrapper that changes how the steps behave sets it (a picklable function, such as the
    gossip wrapper's :meth:`MixingConfig.under_gossip
    <learned_opt.config.MixingConfig.under_gossip>` of the network's own mixing config,
    keeps the optimizer picklable).

    ``copy.deepcopy`` and ``pickle`` carry theta, the card and the settings along with
    torch's defaults, state and param groups, so a copy steps exactly like the original.
    """

    #: Steps in a row on which every tensor's update is skipped (its gradient or the
    #: parameter held NaN or Inf) before ``step()`` raises :class:`StalledError`; ``None``
    #: never raises. Set it on an instance to change one optimizer (copies carry it).
    stall_steps: int | None = 5

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        *positional,
        checkpoint: str | os.PathLike | None = None,
        lr: float = 1.0,
        net: LearnedOptimizerNet | None = None,
        weight_decay: float | None = None,
        compile: bool = True,
    ):
        if positional:  # the Adam(params, 1e-3) habit would make every step 1000x too small
            raise TypeError(KEYWORD_ONLY.format(positional[0]))
        checked_lr(lr, "learning-rate multiplier lr")
        checked_weight_decay(weight_decay)
        if not isinstance(compile, bool):
            raise ValueError(f"Invalid compile: {compile!r} (must be True or False)")
        if net is None:
            name = DEFAULT_CHECKPOINT if checkpoint is None else checkpoint
            self.checkpoint_path = resolve_checkpoint(name)
            net, card = load_checkpoint(self.checkpoint_path)
        else:
            self.checkpoint_path, card = None, {}
        self.net = net
        self.card = card
        self.compile = compile
        self.config_transform: Callable[[NetConfig], NetConfig] | None = None
        self._theta_cache: dict[tuple, Theta] = {}
        self._parts: Parts | None = None
        self._kernels = Kernels(compile)
        self._warned: set[tuple[int, int]] = set()  # (group, position) warned as non-finite
        self._stalled = 0  # steps in a row on which every tensor was skipped
        self.stall_steps = type(self).stall_steps  # an instance's own, carried by copies
        self._building = True  # add_param_group's warnings name the caller of the constructor
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, step=0))
        del self._building
        if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            tune_malloc()  # the eager step's temporaries reuse memory (see .allocator)

    #: Attributes carried by ``pickle`` and ``copy.deepcopy`` besides torch's (defaults,
    #: state, param groups). Theta (``net``) is small; caches and kernels are rebuilt.
    _PICKLED = (
        "net",
        "card",
        "checkpoint_path",
        "compile",
        "config_transform",
        "stall_steps",
    )

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            p = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # named parameters
            if isinstance(p, Tensor) and not p.is_floating_point():
                raise ValueError(f"LearnedOptimizer needs floating-point parameters, got {p.dtype}")
        refuse_foreign_keys(
            param_group, "a param group", "hyper-parameters of torch's optimizers that a "
            "LearnedOptimizer does not take (its update is learned; its groups take lr, a "
            "multiplier, and weight_decay); remove them",
        )  # fmt: skip
        lr = checked_lr(param_group.get("lr", self.defaults["lr"]), "lr of the new param group")
        if 0 < lr <= ADAM_SIZED_LR:  # named at the caller's line: the constructor's or this
            level = 4 if self.__dict__.get("_building") else 2
            warnings.warn(SMALL_LR.format(lr=lr, factor=1 / lr), UserWarning, stacklevel=level)
        checked_weight_decay(param_group.get("weight_decay"), "weight_decay of the new param group")
        super().add_param_group({**param_group, "params": params})

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._PICKLED})
        return state

    def __setstate__(self, state: dict) -> None:
        # Called by unpickling and deepcopy with the whole state, and by torch's
        # load_state_dict with only state and param groups.
        state = dict(state)
        for stale in ("workers", "chunk_size", "small_tensor_size", "stack_same_shape", "fused"):
            state.pop(stale, None)  # settings of earlier versions
        state.pop("last_loss", None)  # kept by earlier versions, read by nothing
        for stale in ("shipped_default", "checkpoint_by_default"):
            state.pop(stale, None)  # earlier versions' marks for a gossip rule swap
        gossip = state.pop("gossip", False)  # earlier versions' flag for the gossip bounds
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("step", 0)
            group.setdefault("lr", 1.0)
            group.setdefault("weight_decay", None)  # saved before weight decay: the rule's
        if "net" not in self.__dict__:
            raise ValueError(
                "this pickled LearnedOptimizer holds no network (net): it was pickled by a "
                "version of learned-opt that dropped theta; build a new optimizer and load "
                "the state with load_state_dict"
            )
        defaults = {
            "card": {},
            "checkpoint_path": None,
            "compile": True,
            "config_transform": None,
            "_theta_cache": {},
            "_parts": None,
            "_warned": set(),
            "_stalled": 0,
            "stall_steps": type(self).stall_steps,  # pickled before it was a setting
        }
        for name, default in defaults.items():
            self.__dict__.setdefault(name, default)
        # earlier versions' transform, by name, now the network's own mixing config's
        if gossip or self.config_transform is NetConfig.under_gossip:
            self.config_transform = self.net.mixing.under_gossip
        if "_kernels" not in self.__dict__:
            self._kernels = Kernels(self.compile)

    @property
    def config(self):
        """The network's config (:class:`~learned_opt.config.NetConfig`)."""
        return self.net.config

    @property
    def nonfinite_skips(self) -> int:
        """Total tensor updates skipped because a gradient or a parameter held NaN or Inf."""
        return sum(int(s.get("nonfinite_skips", 0)) for s in self.state.values())

    def theta(self, device: torch.device, dtype: torch.dtype) -> Theta:
        """Detached theta on ``device``/``dtype`` (cached; call ``refresh_theta`` after editing
        ``self.net``)."""
        key = (str(device), dtype)
        if key not in self._theta_cache:
            self._theta_cache[key] = {
                k: v.detach().to(device=device, dtype=dtype) for k, v in self.net.named_parameters()
            }
        return self._theta_cache[key]

    def refresh_theta(self) -> None:
        """Drop cached copies of theta after ``self.net`` was changed in place."""
        self._theta_cache.clear()
        self._parts = None

    @property
    def parts(self) -> Parts:
        """Which networks of theta can change the step (:func:`~learned_opt.step.active_parts`):
        a rule whose heads are zero evaluates none."""
        if self._parts is None:
            self._parts = active_parts(dict(self.net.named_parameters()))
        return self._parts

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the compiles queued so far have finished; returns whether every
        set of tensors stepped so far runs its compiled kernel. For benchmarks and tests:
        ``step()`` itself never waits."""
        return self._kernels.wait(timeout)

    def _group_items(self, group: dict, cfg: NetConfig) -> list[tuple[Tensor, Tensor, dict]]:
        """``(param, grad, state)`` of the group's parameters to step under ``cfg``; state
        created lazily.

        A parameter whose state is still empty and whose gradient is all zeros is left
        alone (no state, no move): from zero state the learned step is not zero, so
        without this a parameter that has seen no signal yet would drift. (Not named
        ``_init_group``: torch.compile treats a method of that name specially.)
        """
        items = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    "LearnedOptimizer does not support sparse gradients; use dense gradients "
                    "(for nn.Embedding, sparse=False)"
                )
            state = self.state[p]
            if len(state) == 0:
                if p.numel() and not p.grad.any():
                    continue
                sparse = has_empty_rows(p.grad)
                state.update(init_state(p, moment_rows(self.parts, sparse)))
                state["nonfinite_skips"] = 0
                state["sparse_rows"] = sparse
                state["step"] = torch.zeros((), dtype=state["v"].dtype, device=p.device)
            fit_state_rows(state, self.parts)  # saved, or kept, for a rule reading others
            if "log_lr" not in state:  # state saved before step sizes were adapted
                state["log_lr"] = init_state(p.new_empty(()))["log_lr"]
            if "step" not in state:  # state saved when the group counted the steps
                state["step"] = torch.tensor(
                    float(group["step"]), dtype=state["v"].dtype, device=p.device
                )
            fit_gram_state(state, p, cfg)
            items.append((p, p.grad, state))
        return items

    def _rule(self) -> NetConfig:
        """The config this optimizer steps with: its network's, through
        ``config_transform`` where one is set (the rule under gossip)."""
        cfg = self.net.config
        return cfg if self.config_transform is None else self.config_transform(cfg)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None):
        """One optimisation step; returns the closure's loss (None without a closure)."""
        closure_loss = None
        if closure is not None:
            with torch.enable_grad():
                closure_loss = closure()
        cfg, parts = self._rule(), self.parts
        # one kernel call per device and compute dtype for all the groups (see
        # Kernels.step_groups): (group index, Group) each
        by_kind: dict[tuple, list[tuple[int, Group]]] = {}
        for index, group in enumerate(self.param_groups):
            lr = checked_lr(group["lr"], f"param_groups[{index}]['lr']")
            decay = checked_weight_decay(
                group.get("weight_decay"), f"param_groups[{index}]['weight_decay']"
            )
            items = self._group_items(group, cfg)
            if not items:
                continue
            rule = cfg if decay is None else with_weight_decay(cfg, decay)
            group["step"] += 1
            kinds: dict[tuple, list] = {}
            for item in items:
                kinds.setdefault((item[0].device, item[2]["v"].dtype), []).append(item)
            for kind, kind_items in kinds.items():
                params, grads, states = zip(*kind_items)
                by_kind.setdefault(kind, []).append((index, Group(rule, params, grads, states, lr)))
        stepped = skipped = 0
        for (device, dtype), groups in by_kind.items():
            flags = self._kernels.step_groups(
                self.theta(device, dtype), parts, [g for _, g in groups]
            )
            for (index, g), oks in zip(groups, flags):
                for p, state, ok in zip(g.params, g.states, oks):
                    if ok:
                        stepped += 1
                    else:
                        skipped += 1
                        self._skipped(index, self.param_groups[index], p, state)
        if skipped or stepped:
            self._stalled = 0 if stepped else self._stalled + 1
            if self.stall_steps is not None and self._stalled >= self.stall_steps:
                raise StalledError(self._stall_message())
        return closure_loss

    def _stall_message(self) -> str:
        """Why every update was skipped: the parameters that hold NaN or Inf, named, or
        else the gradients."""
        bad = []
        for index, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for position, p in enumerate(group["params"]):
                if p.grad is not None and not bool(torch.isfinite(p).all()):
                    name = names[position] if names else f"parameter {position}"
                    bad.append(f"{name} of param group {index} (shape {tuple(p.shape)})")
        steps = f"on the last {self._stalled} steps"
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            return (
                f"LearnedOptimizer: training has stalled: every update was skipped {steps}, "
                f"because parameters hold NaN or Inf: {', '.join(bad[:3])}{more}. A parameter "
                "that holds NaN or Inf makes the loss and every gradient non-finite, so no "
                "later step can recover: restart from a checkpoint saved before it, with a "
                "lower lr multiplier, or check the data and the loss"
            )
        return (
            f"LearnedOptimizer: training has stalled: every update was skipped {steps}, "
            "because every gradient held NaN or Inf (the parameters are finite): check the "
            "loss and the data; with mixed precision, torch.amp.GradScaler skips such steps "
            "before they reach the optimizer"
        )

    def _skipped(self, index: int, group: dict, p: Tensor, state: dict) -> None:
        """Count a skipped update, and warn once per parameter that itself holds NaN or Inf
        (a non-finite gradient alone is skipped silently, as a loss scaler expects)."""
        state["nonfinite_skips"] = state.get("nonfinite_skips", 0) + 1
        position = next(i for i, q in enumerate(group["params"]) if q is p)
        if (index, position) not in self._warned and not bool(torch.isfinite(p).all()):
            self._warned.add((index, position))
            warnings.warn(
                f"LearnedOptimizer: parameter {position} of param group {index} (shape "
                f"{tuple(p.shape)}) holds NaN or Inf; its updates are skipped from now on "
                f"(counted in nonfinite_skips: {self.nonfinite_skips})",
                RuntimeWarning,
                stacklevel=4,
            )

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state. State tensors take the dtype a fresh state of the parameter
        would have (float32 for float32/bf16/fp16 parameters, float64 for float64 ones,
        whatever they were saved in) and the parameter's device; so a run resumed on the
        same parameters continues bit-for-bit.

        A state dict of another optimizer, or one saved for parameters of other shapes, is
        refused with a one-line :class:`~learned_opt._state_dict.StateDictError` (a
        ``ValueError``) naming the parameter and what differs; nothing is loaded then."""
        from ._state_dict import check_state_dict

        check_state_dict(self.param_groups, state_dict)
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, Tensor) and value.is_floating_point():
                    self.state[p][key] = value.to(p.device, compute_dtype(p), copy=True)
                elif isinstance(value, Tensor):
                    self.state[p][key] = value.to(p.device, copy=True)
            if "m" in self.state[p]:  # saved by a rule that read other momenta
                fit_state_rows(self.state[p], self.parts)

    def save_checkpoint(self, path: str | os.PathLike, card: dict | None = None):
        """Export this optimizer's network (theta and config) as a deployable checkpoint."""
        return save_checkpoint(self.net, path, card if card is not None else self.card)

    @classmethod
    def load(cls, params, path: str | os.PathLike, **kwargs) -> LearnedOptimizer:
        """Build an optimizer for ``params`` from a checkpoint file or shipped name."""
        return cls(params, checkpoint=path, **kwargs)


def fit_gram_state(state: dict, p: Tensor, cfg) -> None:
    """Give a parameter's state the Gram polynomial ``q`` that its matrix keeps between
    Newton-Schulz iterations under ``cfg`` (:func:`~learned_opt.orthogonal.reuses_gram`;
    a row-sparse matrix is never orthogonalised), or drop one it no longer keeps. A new
    ``q`` is the identity: a fresh state's first step iterates, and a state saved
    without one (an older release, another rule) steps once along its unit-norm momentum
    at most, until its next iteration."""
    keeps = not state.get("sparse_rows") and reuses_gram(tuple(p.shape), cfg)
    if not keeps:
        state.pop("q", None)
    elif "q" not in state:
        r = min(p.shape)
        state["q"] = torch.eye(r, dtype=state["v"].dtype, device=p.device)
