"""The Task: a model, a dataset and a loss, with a functional face and a module face.

A task is fully described by a :class:`TaskSpec`; ``task.describe()`` prints the spec
as one line and :func:`from_description` rebuilds the identical task from it.

Batches are drawn with replacement from each worker's shard. The batch of worker ``i``
at step ``t`` depends only on ``(seed, num_workers, partition, alpha, i, t)``, and
``task.batches(...)`` (one worker) and ``task.worker_batches(...).get(t)`` (all
workers stacked) return the same tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .datasets import DATASET_KINDS, RATINGS, Dataset, load_dataset
from .models import ACTIVATIONS, CNN, GRU, MLP, MatrixFactorisation, Model, Transformer
from .partition import partition_indices

__all__ = [
    "MODEL_KINDS",
    "NORMS",
    "TaskSpec",
    "Task",
    "Workload",
    "WorkerBatches",
    "from_description",
    "stack_params",
]

Params = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


class Workload(NamedTuple):
    """A task as a user writes a training job: a model, a loss of a batch, and batches."""

    model: nn.Module  # parameters initialised from the task's seed
    loss_fn: Callable[[Batch], torch.Tensor]  # loss_fn(batch) -> scalar loss of ``model``
    batches: Iterator[Batch]  # endless iterator of (inputs, targets)


MODEL_KINDS = ("linear", "mlp", "cnn", "transformer", "gru", "autoencoder", "mf")
NORMS = ("none", "batch")  # TaskSpec.norm; "batch" is batch norm, see models.batch_norm
_NORM_MODELS = ("mlp", "cnn")  # the model kinds that take norm="batch"
#: Fields added after the first description format: ``describe()`` writes them only when
#: they differ from their defaults, so older descriptions (and caches keyed on them) stay.
_LATER_FIELDS = ("l2", "norm")


@dataclass(frozen=True)
class TaskSpec:
    """Everything that defines a task. Two equal specs give identical tasks.

    ``model="autoencoder"`` is an MLP from the features through ``hidden`` back to the
    features, fitted to reconstruct its inputs (mean squared error); the labels only
    steer the label-skew partitions.
    """

    model: str  # one of MODEL_KINDS
    dataset: str  # a name from tasks.datasets.list_datasets()
    # mlp, autoencoder: widths; cnn: (c1, c2); transformer: (dim, heads); gru: (embed,
    # hidden); mf: (dim,)
    hidden: tuple[int, ...] = ()
    activation: str = "relu"  # one of models.ACTIVATIONS
    init_scale: float = 1.0  # multiplies every initial weight's standard deviation
    batch_size: int = 64  # examples per worker per step
    label_noise: float = 0.0  # training-label corruption, see datasets.load_dataset
    context: int = 32  # characters per window (language models only)
    name: str = ""  # display name; registered tasks use their registry name
    l2: float = 0.0  # adds 0.5 * l2 * (sum of squares of every weight of rank >= 2)
    norm: str = "none"  # one of NORMS; "batch" (mlp, cnn): batch norm before activations

    def describe(self) -> str:
        """One line of ``key=value`` fields that :func:`from_description` parses back."""
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _LATER_FIELDS and v == f.default:
                continue
            if f.name == "hidden":
                v = "x".join(str(h) for h in v) or "-"
            parts.append(f"{f.name}={v}")
        return " ".join(parts)


def _parse_spec(line: str) -> TaskSpec:
    fields = {f.name: f for f in dataclasses.fields(TaskSpec)}
    kwargs: dict = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"bad task description token {token!r}; valid keys: {sorted(fields)}")
        if key == "hidden":
            kwargs[key] = () if value == "-" else tuple(int(h) for h in value.split("x"))
        elif key in ("init_scale", "label_noise", "l2"):
            kwargs[key] = float(value)
        elif key in ("batch_size", "context"):
            kwargs[key] = int(value)
        else:
            kwargs[key] = value
    missing = {"model", "dataset"} - kwargs.keys()
    if missing:
        raise ValueError(f"task description lacks {sorted(missing)}: {line!r}")
    return TaskSpec(**kwargs)


def from_description(line: str) -> Task:
    """Rebuild the task that ``task.describe()`` printed."""
    return Task(_parse_spec(line))


def stack_params(params: list[Params]) -> Params:
    """Stack per-worker parameter dicts along a new leading dimension (for vmap)."""
    return {k: torch.stack([p[k] for p in params]) for k in params[0]}


def _seed_hash(*values) -> int:
    """A 63-bit seed from a tuple of ints/strings, stable across processes."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_l2(l2) -> None:
    """``ValueError`` unless ``l2`` (an L2 penalty coefficient) is a finite number >= 0."""
    ok = isinstance(l2, numbers.Real) and not isinstance(l2, bool)
    if not (ok and math.isfinite(l2) and l2 >= 0):
        raise ValueError(f"l2 must be a finite number >= 0, got {l2!r}")


def _build_model(spec: TaskSpec, data: Dataset) -> Model:
    if spec.model not in MODEL_KINDS:
        raise ValueError(f"unknown model {spec.model!r}; valid choices: {MODEL_KINDS}")
    if spec.activation not in ACTIVATIONS:
        raise ValueError(
            f"unknown activation {spec.activation!r}; valid choices: {sorted(ACTIVATIONS)}"
        )
    if spec.norm not in NORMS:
        raise ValueError(f"unknown norm {spec.norm!r}; valid choices: {NORMS}")
    if spec.norm != "none" and spec.model not in _NORM_MODELS:
        raise ValueError(
            f"norm={spec.norm!r} fits models {_NORM_MODELS} only; for model {spec.model!r} "
            f"valid choices: norm='none'"
        )
    if any(h < 1 for h in spec.hidden):
        raise ValueError(f"hidden sizes must be >= 1, got {spec.hidden}")
    if (spec.model == "mf") != (spec.dataset in RATINGS):
        valid = f"dataset in {sorted(RATINGS)}" if spec.model == "mf" else "model='mf'"
        raise ValueError(
            f"model {spec.model!r} does not fit dataset {spec.dataset!r}; valid choices: {valid}"
        )
    if spec.model == "mf":
        if len(spec.hidden) != 1:
            raise ValueError(f"model 'mf' takes hidden=(dim,), got {spec.hidden}")
        return MatrixFactorisation(*RATINGS[spec.dataset], spec.hidden[0])
    lm = data.kind == "lm"
    if lm and spec.model == "autoencoder":
        vectors = sorted(n for n, k in DATASET_KINDS.items() if k != "lm")
        raise ValueError(
            f"an autoencoder reconstructs feature vectors, not {spec.dataset!r}'s token "
            f"windows; valid choices: dataset in {vectors}"
        )
    if lm != (spec.model in ("transformer", "gru")):
        valid = "transformer, gru" if lm else "linear, mlp, cnn, autoencoder"
        raise ValueError(
            f"model {spec.model!r} does not fit dataset {spec.dataset!r}; valid choices: {valid}"
        )
    out = data.num_classes if data.kind in ("classification", "lm") else 1
    bn = spec.norm == "batch"
    if spec.model == "linear":
        if spec.hidden:
            raise ValueError("a linear model takes hidden=() ('-')")
        return MLP(data.num_features, (), out, spec.activation)
    if spec.model == "mlp":
        return MLP(data.num_features, spec.hidden, out, spec.activation, batch_norm=bn)
    if spec.model == "autoencoder":
        if not spec.hidden:
            raise ValueError("an autoencoder needs hidden widths, e.g. hidden=16x4x16; got ()")
        if spec.label_noise:
            raise ValueError(
                f"an autoencoder fits its inputs, not the labels label_noise corrupts; "
                f"valid choices: label_noise=0.0, got {spec.label_noise}"
            )
        return MLP(data.num_features, spec.hidden, data.num_features, spec.activation)
    if len(spec.hidden) != 2:
        raise ValueError(f"model {spec.model!r} needs hidden of length 2, got {spec.hidden}")
    if spec.model == "cnn":
        if spec.dataset != "digits":
            raise ValueError(
                f"the cnn runs on 8x8 images; valid choices: dataset='digits', got {spec.dataset!r}"
            )
        return CNN(spec.hidden, out, spec.activation, batch_norm=bn)
    if spec.model == "transformer":
        return Transformer(
            data.num_classes, spec.context, spec.hidden[0], spec.hidden[1], spec.activation
        )
    return GRU(data.num_classes, spec.hidden[0], spec.hidden[1])


class Task:
    """A training problem with a functional face (``init``/``loss``) and a module face.

    Attributes: ``name``, ``kind`` ("classification", "regression", "quadratic", "lm",
    "reconstruction"), ``spec``, ``batch_size``, ``l2``, ``num_params``, ``data`` (the
    :class:`Dataset`). A "reconstruction" task (an autoencoder) fits its inputs: its
    targets are the batch's inputs, and the batch's labels go unused.
    """

    def __init__(self, spec: TaskSpec):
        if spec.dataset not in DATASET_KINDS:
            raise ValueError(
                f"unknown dataset {spec.dataset!r}; valid choices: {sorted(DATASET_KINDS)}"
            )
        if any(c.isspace() or c == "=" for c in spec.name):
            raise ValueError(f"task name must not contain whitespace or '=': {spec.name!r}")
        self.spec = spec
        self.data = load_dataset(spec.dataset, spec.label_noise, spec.context)
        if isinstance(spec.batch_size, bool) or not isinstance(spec.batch_size, int):
            raise ValueError(f"batch_size must be an int, got {spec.batch_size!r}")
        if not 1 <= spec.batch_size <= self.data.num_train:
            raise ValueError(
                f"bad batch_size {spec.batch_size}; valid choices: 1 to {self.data.num_train}"
            )
        if not spec.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {spec.init_scale}")
        check_l2(spec.l2)
        if spec.norm == "batch" and spec.batch_size < 2:
            raise ValueError(
                f"batch norm needs batch statistics; valid choices: batch_size >= 2, "
                f"got {spec.batch_size}"
            )
        self.model = _build_model(spec, self.data)
        self.name = spec.name or f"{spec.model}_{spec.dataset}"
        self.kind = "reconstruction" if spec.model == "autoencoder" else self.data.kind
        self.l2 = float(spec.l2)
        self.batch_size = spec.batch_size
        self.init_scale = spec.init_scale
        self.num_params = self.model.num_params

    def __repr__(self) -> str:
        return f"Task({self.describe()!r})"

    def describe(self) -> str:
        """One line that :func:`from_description` turns back into this task."""
        return self.spec.describe()

    # ------------------------------------------------------------------ functional face
    def init(self, generator: torch.Generator | None = None, device=None) -> Params:
        """Fresh parameters as ``dict[str, Tensor]``, drawn from ``generator``."""
        params = self.model.init(generator, self.init_scale)
        return {k: v.to(device) for k, v in params.items()} if device is not None else params

    def apply(self, params: Params, inputs: torch.Tensor) -> torch.Tensor:
        """Model outputs (logits or predictions) for a batch of inputs. Pure."""
        return self.model.apply(params, inputs)

    def targets(self, batch: Batch) -> torch.Tensor:
        """What the outputs are fitted to: the labels, or the inputs for "reconstruction"."""
        return batch[0] if self.kind == "reconstruction" else batch[1]

    def criterion(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of outputs against targets (cross-entropy, MSE, or half MSE).

        For "reconstruction" pass ``self.targets(batch)`` (the inputs) as ``targets``.
        """
        if self.kind == "classification":
            return F.cross_entropy(outputs, targets)
        if self.kind == "lm":
            return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
        if self.kind == "reconstruction":
            return F.mse_loss(outputs, targets)  # mean over examples and features
        err = F.mse_loss(outputs.squeeze(-1), targets)
        return 0.5 * err if self.kind == "quadratic" else err

    def penalty(self, params: Params) -> torch.Tensor | float:
        """The L2 term ``0.5 * l2 * sum(w**2)`` over the weights of rank >= 2 (biases and
        norm scales excluded); 0 when ``l2`` is 0. Pure, like :meth:`loss`."""
        if self.l2 == 0.0:
            return 0.0
        return 0.5 * self.l2 * sum((w * w).sum() for w in params.values() if w.dim() >= 2)

    def loss(self, params: Params, batch: Batch) -> torch.Tensor:
        """Scalar training loss (with the L2 term). Pure: usable under ``vmap`` and ``grad``."""
        outputs = self.model.apply(params, batch[0])
        return self.criterion(outputs, self.targets(batch)) + self.penalty(params)

    # ------------------------------------------------------------------ module face
    def module(self, generator: torch.Generator | None = None) -> nn.Module:
        """An ``nn.Module`` whose parameters are ``self.init(generator)``."""
        m = self.model.module()
        self.load_params(m, self.init(generator))
        return m

    def load_params(self, module: nn.Module, params: Params) -> nn.Module:
        """Copy a params dict into the module's parameters (names must match exactly)."""
        named = dict(module.named_parameters())
        if named.keys() != params.keys():
            raise ValueError(
                f"parameter names differ: module {sorted(named)} vs params {sorted(params)}"
            )
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(params[k])
        return module

    def params_of(self, module: nn.Module) -> Params:
        """Detached copies of the module's parameters, as a params dict."""
        return {k: p.detach().clone() for k, p in module.named_parameters()}

    def module_loss(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """The same loss as :meth:`loss`, computed through the module."""
        outputs = module(batch[0])
        return self.criterion(outputs, self.targets(batch)) + self.penalty(
            dict(module.named_parameters())
        )

    def workload(self, seed: int = 0) -> Workload:
        """The task as a plain ``(model, loss_fn, batches)``, for any ``torch.optim`` optimizer.

        ``model`` is initialised from ``seed``; ``batches`` is one worker's endless batch
        iterator for the same seed (so two workloads of one seed see the same data).
        """
        model = self.module(torch.Generator().manual_seed(int(seed)))
        return Workload(
            model, lambda batch: self.module_loss(model, batch), self.batches(seed=int(seed))
        )

    # ------------------------------------------------------------------ data
    def worker_batches(
        self,
        seed: int = 0,
        num_workers: int = 1,
        partition: str = "iid",
        alpha: float = 1.0,
        device=None,
    ) -> WorkerBatches:
        """Batches for all workers at once: ``.get(step)`` is stacked with leading dim ``num_workers``."""
        return WorkerBatches(self, seed, num_workers, partition, alpha, device)

    def batches(
        self,
        generator: torch.Generator | None = None,
        worker: int = 0,
        num_workers: int = 1,
        partition: str = "iid",
        alpha: float = 1.0,
        *,
        seed: int | None = None,
        device=None,
    ) -> Iterator[Batch]:
        """Endless iterator of one worker's ``(inputs, targets)`` batches.

        The seed is ``seed`` if given, else one draw from ``generator`` (else 0). Batch
        ``t`` equals ``self.worker_batches(seed, num_workers, partition, alpha).get(t)[.][worker]``.
        """
        if seed is None:
            seed = (
                0 if generator is None else int(torch.randint(0, 2**62, (1,), generator=generator))
            )
        wb = self.worker_batches(seed, num_workers, partition, alpha, device)
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} out of range; valid choices: 0 to {num_workers - 1}")
        return (wb.worker(step, worker) for step in itertools.count())

    @torch.no_grad()
    def evaluate(
        self,
        params: Params,
        split: str = "test",
        max_examples: int = 2048,
        indices: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Loss (and accuracy for classification and LM) on the test or train split.

        ``indices``: evaluate on these examples of the split instead (repeats count as
        often as they appear; ``max_examples`` is then not applied). The loss includes
        the L2 term. Batch norm normalises with the evaluated examples' own statistics
        (there are no running statistics).
        """
        if split not in ("test", "train"):
            raise ValueError(f"unknown split {split!r}; valid choices: ('test', 'train')")
        x, y = (
            (self.data.x_test, self.data.y_test)
            if split == "test"
            else (self.data.x_train, self.data.y_train)
        )
        device = next(iter(params.values())).device
        rows = slice(max_examples) if indices is None else indices.cpu()
        x, y = x[rows].to(device), y[rows].to(device)
        out = self.model.apply(params, x)
        loss = self.criterion(out, self.targets((x, y))) + self.penalty(params)
        result = {"loss": float(loss)}
        if self.kind in ("classification", "lm"):
            result["accuracy"] = float((out.argmax(-1) == y).float().mean())
        return result


class WorkerBatches:
    """Per-step batches for ``num_workers`` workers, stacked along dim 0.

    Each worker samples ``task.batch_size`` indices with replacement from its own shard,
    so all workers' batches have the same shape whatever their shard sizes.

    ``get(step)`` -> ``(inputs [N, B, ...], targets [N, B, ...])``;
    ``worker(step, i)`` -> worker ``i``'s batch, equal to ``get(step)`` row ``i``.
    ``shards`` holds each worker's training-set indices.
    """

    def __init__(
        self, task: Task, seed: int, num_workers: int, partition: str, alpha: float, device=None
    ):
        self.task, self.seed, self.num_workers = task, int(seed), num_workers
        self.batch_size = task.batch_size
        gen = torch.Generator().manual_seed(_seed_hash(self.seed, "partition"))
        self.shards = partition_indices(
            task.data.partition_labels, num_workers, partition, alpha, gen
        )
        self.sizes = torch.tensor([len(s) for s in self.shards])
        self._offsets = torch.cumsum(self.sizes, 0) - self.sizes
        self._flat = torch.cat(self.shards)
        self.to(device)

    def to(self, device) -> WorkerBatches:
        """Keep the training data and shard indices on ``device`` (None: CPU)."""
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._x = self.task.data.x_train.to(self.device)
        self._y = self.task.data.y_train.to(self.device)
        return self

    def indices(self, step: int) -> torch.Tensor:
        """Training-set indices of every worker's batch at ``step``: LongTensor [N, B]."""
        gen = torch.Generator().manual_seed(_seed_hash(self.seed, "step", int(step)))
        u = torch.rand(self.num_workers, self.batch_size, generator=gen, dtype=torch.float64)
        local = (u * self.sizes[:, None]).long().clamp_max(self.sizes[:, None] - 1)
        return self._flat[self._offsets[:, None] + local]

    def get(self, step: int) -> Batch:
        """All workers' batches at ``step``, stacked: leading dim ``num_workers``."""
        idx = self.indices(step).to(self.device)
        return self._take(self._x, idx), self._take(self._y, idx)

    @staticmethod
    def _take(data: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return data.index_select(0, idx.reshape(-1)).reshape(*idx.shape, *data.shape[1:])

    def worker(self, step: int, worker: int) -> Batch:
        """Worker ``worker``'s batch at ``step`` (unstacked)."""
        idx = self.indices(step)[worker].to(self.device)
        return self._take(self._x, idx), self._take(self._y, idx)
