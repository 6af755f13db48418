"""Validation of meta-training settings: every bad field fails before training, by name."""

from __future__ import annotations

from types import SimpleNamespace

from learned_opt.distributed.topology import get_topology, list_topologies
from learned_opt.tasks import PARTITION_SCHEMES, check_not_held_out, get_task, list_families

from .es import META_SEEDS, VAL_SEEDS
from .estimators import ESTIMATORS, META_OBJECTIVES
from .families import DISTRIBUTION, is_class_path, user_family
from .inner import SCORES
from .rule_space import DEFAULT_NAMES, check_names

#: Every value of ``estimator``: the truncated ones and evolution strategies on whole runs.
ALL_ESTIMATORS = (*ESTIMATORS, "es")

#: The parts of the network that ``train_parts`` names, and the modules of each.
PART_MODULES = {
    "tensor": ("tensor_in", "tensor_out"),
    "element": ("elem_in", "elem_time", "elem_hidden", "elem_out"),
    "edge": ("edge_in", "edge_out"),
}


def _fail(field: str, message: str):
    raise ValueError(f"meta-training config field {field!r}: {message}")


def validate_settings(hp: dict) -> SimpleNamespace:
    """Check the ``MetaTrainModule`` arguments; returns them as attributes."""
    s = SimpleNamespace(**hp)
    if s.estimator not in ALL_ESTIMATORS:
        _fail("estimator", f"unknown estimator {s.estimator!r}; valid: {list(ALL_ESTIMATORS)}")
    if s.estimator == "es":
        _validate_es(s)
    elif s.family not in list_families():
        _fail(
            "family",
            f"unknown family {s.family!r}; valid: {list_families()} (the es estimator also "
            f"takes {DISTRIBUTION!r} and a family by class path)",
        )
    for name in (
        "tasks_per_step",
        "unroll_length",
        "min_length",
        "max_length",
        "val_horizon",
        "val_workers",
        "pes_pairs",
    ):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(name, f"must be a positive integer, got {value!r}")
    if s.min_length > s.max_length:
        _fail("min_length", f"{s.min_length} exceeds max_length {s.max_length}")
    if s.unroll_length > s.max_length:
        _fail("unroll_length", f"{s.unroll_length} exceeds max_length {s.max_length}")
    if s.val_horizon < 5 * s.unroll_length:
        _fail(
            "val_horizon",
            f"must be at least 5x unroll_length ({5 * s.unroll_length}), got {s.val_horizon}",
        )
    s.worker_counts = [int(n) for n in s.worker_counts]
    if not s.worker_counts or any(n < 1 or n > 64 for n in s.worker_counts):
        _fail(
            "worker_counts",
            f"must be a non-empty list of integers in 1..64, got {s.worker_counts!r}",
        )
    s.topologies = list(s.topologies)
    for t in s.topologies:
        if t not in list_topologies():
            _fail("topologies", f"unknown topology {t!r}; valid: {list_topologies()}")
    s.partitions = list(s.partitions)
    for p in s.partitions:
        if p not in PARTITION_SCHEMES:
            _fail("partitions", f"unknown partition {p!r}; valid: {list(PARTITION_SCHEMES)}")
    if s.meta_objective not in META_OBJECTIVES:
        _fail(
            "meta_objective",
            f"unknown meta-objective {s.meta_objective!r}; valid: {list(META_OBJECTIVES)}",
        )
    if isinstance(s.train_parts, str):
        _fail("train_parts", f"must be a list of parts, got {s.train_parts!r}")
    s.train_parts = list(s.train_parts)
    bad = [p for p in s.train_parts if p not in PART_MODULES]
    if bad or not s.train_parts or len(set(s.train_parts)) != len(s.train_parts):
        _fail(
            "train_parts",
            f"must be a non-empty list of distinct parts from {list(PART_MODULES)}, "
            f"got {s.train_parts!r}",
        )
    for name in ("augment_loss_scale", "augment_init_scale"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
            _fail(name, f"must be a number >= 1 (1 = off), got {value!r}")
    fraction = s.scheduled_fraction = getattr(s, "scheduled_fraction", 0.0)
    number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    if not number or not 0 <= fraction <= 1:
        _fail("scheduled_fraction", f"must be a number in [0, 1], got {fraction!r}")
    if s.decentralized_score not in SCORES:
        _fail("decentralized_score", f"unknown score {s.decentralized_score!r}; valid: {SCORES}")
    for name in ("alpha", "val_alpha", "pes_sigma", "loss_clip", "outer_lr", "grad_clip"):
        if not float(getattr(s, name)) > 0:
            _fail(name, f"must be > 0, got {getattr(s, name)!r}")
    s.val_tasks = list(s.val_tasks)
    if not s.val_tasks:
        _fail("val_tasks", "needs at least one task")
    for t in s.val_tasks:
        try:
            get_task(t)
        except ValueError as exc:
            _fail("val_tasks", str(exc))
    for field, names in (("family", [s.family]), ("val_tasks", s.val_tasks)):
        try:  # held-out tasks and families are for evaluation only
            check_not_held_out(names)
        except ValueError as exc:
            _fail(field, str(exc))
    try:
        get_topology(s.val_topology, s.val_workers)
    except ValueError as exc:
        _fail("val_topology", str(exc))
    if s.val_partition not in PARTITION_SCHEMES:
        _fail(
            "val_partition",
            f"unknown partition {s.val_partition!r}; valid: {list(PARTITION_SCHEMES)}",
        )
    return s


def _validate_es(s: SimpleNamespace) -> None:
    """The fields of the es estimator (their defaults where an older run lacks them)."""
    defaults = dict(
        es_constants=DEFAULT_NAMES, es_pairs=4, es_sigma=0.1, es_draws=4, es_horizon=300,
        es_clip=20.0, es_final_weight=1.0, es_kinds=None, es_first_seed=META_SEEDS, es_val_draws=8,
    )  # fmt: skip
    for name, value in defaults.items():
        if not hasattr(s, name):
            setattr(s, name, value)
    if s.family != DISTRIBUTION and not is_class_path(s.family):
        _fail(
            "family",
            f"the es estimator trains on {DISTRIBUTION!r} or a family by class path "
            f"(my_pkg.tasks:MyFamily), got {s.family!r}",
        )
    if is_class_path(s.family):
        try:
            user_family(s.family)
        except ValueError as exc:
            _fail("family", str(exc))
    try:
        s.es_constants = check_names(s.es_constants)
    except ValueError as exc:
        _fail("es_constants", str(exc))
    for name in ("es_pairs", "es_draws", "es_horizon"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(name, f"must be a positive integer, got {value!r}")
    value = s.es_val_draws
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _fail("es_val_draws", f"must be an integer >= 0, got {value!r}")
    if not float(s.es_sigma) > 0:
        _fail("es_sigma", f"must be > 0, got {s.es_sigma!r}")
    if not float(s.es_final_weight) >= 0:
        _fail("es_final_weight", f"must be >= 0, got {s.es_final_weight!r}")
    if not float(s.es_clip) > 1:
        _fail("es_clip", f"must be > 1, got {s.es_clip!r}")
    first = s.es_first_seed
    if isinstance(first, bool) or not isinstance(first, int) or not META_SEEDS <= first < VAL_SEEDS:
        _fail(
            "es_first_seed",
            f"meta-training draws seeds in [{META_SEEDS}, {VAL_SEEDS}) (below them: the "
            f"decisions and the reporting draw), got {first!r}",
        )
    if s.es_kinds is not None:
        from learned_opt.tasks.distribution import KINDS

        s.es_kinds = list(s.es_kinds)
        bad = [k for k in s.es_kinds if k not in KINDS]
        if bad or not s.es_kinds:
            _fail("es_kinds", f"must be None or kinds from {sorted(KINDS)}, got {s.es_kinds!r}")
