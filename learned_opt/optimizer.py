"""``LearnedOptimizer``: the learned optimizer as a drop-in ``torch.optim.Optimizer``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from itertools import chain

import torch
from torch import Tensor
from torch.optim import Optimizer

from .checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, save_checkpoint
from .features import init_state
from .functional import DEFAULT_CHUNK, SMALL_TENSOR_SIZE, learned_step
from .network import LearnedOptimizerNet, Theta
from .workers import ChunkRunner


class LearnedOptimizer(Optimizer):
    """A meta-trained optimizer, used like any ``torch.optim`` optimizer.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        checkpoint: a shipped name (see :func:`learned_opt.list_pretrained`) or a file path.
            Ignored when ``net`` is given.
        lr: a multiplier on the learned step (default 1.0), so every
            ``torch.optim.lr_scheduler`` works unchanged.
        net: an in-memory :class:`LearnedOptimizerNet` to use instead of a checkpoint.
        chunk_size: elements processed at a time on the fast path on CPU (accelerators
            use :data:`learned_opt._chunked.ACCELERATOR_CHUNK`).
        small_tensor_size: tensors of at most this many elements (biases, norms) are
            stepped together in one batched call instead of one call each; 0 turns
            batching off (see :func:`learned_opt.functional.learned_step`).
        workers: threads that step CPU chunks in parallel, each with one intra-op
            thread (see :mod:`learned_opt.workers`); default ``torch.get_num_threads()``
            at each step.
        stack_same_shape: step large tensors of one shape together, stacked
            (see :func:`learned_opt.functional.learned_step`): a few dozen kernel launches per shape
            instead of per tensor. Default (``None``): on accelerators, where the step is
            bound by launches, but not on CPU, where the chunked path keeps data in cache.

    Per-parameter state (``self.state[p]``): momenta ``m`` (3 decays) and second moment
    ``v`` in float32 (float64 for float64 parameters), and ``nonfinite_skips``: how many
    steps this tensor's update was skipped because its gradient or the parameter itself
    held NaN or Inf. Such a gradient never reaches the parameter or the state, and a
    non-finite parameter never spreads to the rest of its tensor. The step count is per param group
    (``group["step"]``). Theta lives in ``self.net``, not in ``state_dict()``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        checkpoint: str | os.PathLike = DEFAULT_CHECKPOINT,
        lr: float = 1.0,
        *,
        net: LearnedOptimizerNet | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        small_tensor_size: int = SMALL_TENSOR_SIZE,
        workers: int | None = None,
        stack_same_shape: bool | None = None,
    ):
        if not isinstance(lr, (int, float)) or not lr >= 0.0:
            raise ValueError(f"Invalid learning-rate multiplier: {lr!r} (must be >= 0)")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"Invalid chunk_size: {chunk_size!r} (must be a positive int)")
        if not isinstance(small_tensor_size, int) or small_tensor_size < 0:
            raise ValueError(
                f"Invalid small_tensor_size: {small_tensor_size!r} (must be an int >= 0)"
            )
        if net is None:
            net, card = load_checkpoint(checkpoint)
        else:
            card = {}
        self.net = net
        self.card = card
        self.chunk_size = chunk_size
        self.small_tensor_size = small_tensor_size
        self.last_loss: Tensor | float | None = None
        self._theta_cache: dict[tuple, Theta] = {}
        self._runner = ChunkRunner(workers)  # also holds the reused scratch buffers
        self.stack_same_shape = stack_same_shape
        super().__init__(params, dict(lr=lr, step=0))

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if isinstance(p, Tensor) and not p.is_floating_point():
                raise ValueError(f"LearnedOptimizer needs floating-point parameters, got {p.dtype}")
        super().add_param_group({**param_group, "params": params})

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("step", 0)
            group.setdefault("lr", 1.0)

    @property
    def config(self):
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

    def _init_group(self, group: dict) -> list[tuple[Tensor, Tensor, dict]]:
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
                state.update(init_state(p))
                state["nonfinite_skips"] = 0
            items.append((p, p.grad, state))
        return items

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None, *, loss=None):
        """One optimisation step. ``loss`` (the batch loss) is kept as ``self.last_loss`` for
        learned mixing in :class:`~learned_opt.distributed.GossipOptimizer`."""
        closure_loss = None
        if closure is not None:
            with torch.enable_grad():
                closure_loss = closure()
        self.last_loss = loss if loss is not None else closure_loss
        for group in self.param_groups:
            items = self._init_group(group)
            if not items:
                continue
            group["step"] += 1
            params, grads, states = zip(*items)
            oks = learned_step(
                self.theta, self.config, params, grads, states, group["step"],
                float(group["lr"]), chunk_size=self.chunk_size,
                small_tensor_size=self.small_tensor_size,
                stack_same_shape=self.stack_same_shape, runner=self._runner,
            )  # fmt: skip
            for state, ok in zip(states, oks):
                state["nonfinite_skips"] += not ok
        return closure_loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state; state tensors keep their saved dtype (float32 for bf16
        parameters), so a resumed run continues bit-for-bit."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)

    def save_checkpoint(self, path: str | os.PathLike, card: dict | None = None):
        """Export this optimizer's network (theta and config) as a deployable checkpoint."""
        return save_checkpoint(self.net, path, card if card is not None else self.card)

    @classmethod
    def load(cls, params, path: str | os.PathLike, **kwargs) -> LearnedOptimizer:
        """Build an optimizer for ``params`` from a checkpoint file or shipped name."""
        return cls(params, checkpoint=path, **kwargs)
