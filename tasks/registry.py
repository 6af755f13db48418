"""The fixed tasks, by name. ``digits_mlp`` is the reference task other packages use.

Two kinds of fixed task live here: the held-in tasks (``TASK_SPECS``, used for
validation and the benchmarks) and the held-out tasks (:mod:`learned_opt.tasks.heldout`),
marked so that meta-training can never sample or validate on them:
:func:`check_not_held_out` is called on every meta-training config. The validation tasks
(:mod:`learned_opt.tasks.validation`), on which choices about the rule are made, carry
the same refusal.
"""

from __future__ import annotations

import functools

from .base import Task, TaskSpec, from_description
from .families import get_family
from .heldout import HELDOUT_BUILDERS
from .validation import VALIDATION_BUILDERS

__all__ = [
    "TASK_SPECS",
    "check_not_held_out",
    "get_task",
    "is_held_out",
    "is_validation",
    "list_heldout_tasks",
    "list_tasks",
    "list_validation_tasks",
]

TASK_SPECS: dict[str, TaskSpec] = {
    s.name: s
    for s in [
        TaskSpec("linear", "quadratic_ill", batch_size=64, name="quadratic_ill"),
        TaskSpec("linear", "breast_cancer", batch_size=32, name="logreg_breast_cancer"),
        TaskSpec("linear", "logreg_synth", batch_size=64, name="logreg_synth"),
        TaskSpec("linear", "diabetes", batch_size=32, name="linreg_diabetes"),
        TaskSpec("mlp", "diabetes", (32, 32), "tanh", batch_size=32, name="diabetes_mlp"),
        TaskSpec("mlp", "digits", (64, 64), "relu", batch_size=64, name="digits_mlp"),
        TaskSpec("mlp", "wine", (32,), "relu", batch_size=32, name="wine_mlp"),
        TaskSpec("mlp", "iris", (16,), "tanh", batch_size=16, name="iris_mlp"),
        TaskSpec("mlp", "spirals", (64, 64), "tanh", batch_size=64, name="spirals_mlp"),
        TaskSpec("cnn", "digits", (8, 16), "relu", batch_size=64, name="digits_cnn"),
        TaskSpec(
            "transformer",
            "chars",
            (32, 2),
            "gelu",
            batch_size=32,
            context=32,
            name="char_transformer",
        ),
        TaskSpec("gru", "chars", (32, 64), batch_size=32, context=32, name="char_gru"),
        # Validation look-alikes of the held-out autoencoder, L2 logistic regression and
        # batch-norm conv net (other datasets or architectures; never the held-out ones).
        TaskSpec(
            "autoencoder", "wine", (16, 4, 16), "tanh", batch_size=32, name="wine_autoencoder"
        ),
        # wine has 142 training examples, so batch 64 is below the full training set
        TaskSpec("linear", "wine", batch_size=64, l2=1e-2, name="logreg_wine_l2"),
        TaskSpec(
            "cnn", "digits", (8, 16), "relu", batch_size=64, norm="batch", name="digits_cnn_bn"
        ),
    ]
}


def list_tasks() -> list[str]:
    """Names of the fixed held-in tasks, in registry order (held-out ones excluded)."""
    return list(TASK_SPECS)


def list_heldout_tasks() -> list[str]:
    """Names of the held-out evaluation tasks, which meta-training never sees."""
    return list(HELDOUT_BUILDERS)


def list_validation_tasks() -> list[str]:
    """Names of the validation tasks, where choices about the rule are made."""
    return list(VALIDATION_BUILDERS)


def is_validation(name: str) -> bool:
    """Whether ``name`` is a validation task."""
    return name in VALIDATION_BUILDERS


def is_held_out(name: str) -> bool:
    """Whether ``name`` is a held-out task or the name of a held-out family."""
    if name in HELDOUT_BUILDERS:
        return True
    try:
        return get_family(name).held_out
    except ValueError:
        return False


def check_not_held_out(names) -> None:
    """Raise ``ValueError`` if any of ``names`` (task or family names) is held out or is
    a validation task.

    Meta-training calls this on every config field that names tasks or families it
    samples or validates on.
    """
    names = [names] if isinstance(names, str) else list(names)
    bad = [n for n in names if is_held_out(n)]
    if bad:
        raise ValueError(
            f"{bad} held out for evaluation: meta-training may never sample or validate on "
            f"held-out tasks or families (held-out tasks: {list_heldout_tasks()})"
        )
    chosen_on = [n for n in names if is_validation(n)]
    if chosen_on:
        raise ValueError(
            f"{chosen_on} kept for choosing the rule: meta-training may never sample or "
            f"validate on validation tasks (validation tasks: {list_validation_tasks()})"
        )


@functools.cache
def _cached(name: str) -> Task:
    if name in HELDOUT_BUILDERS:
        return HELDOUT_BUILDERS[name]()
    if name in VALIDATION_BUILDERS:
        return VALIDATION_BUILDERS[name]()
    return Task(TASK_SPECS[name])


def get_task(name: str) -> Task:
    """A fixed task (held-in, held-out or validation) by name, or any task from a ``describe()`` line
    (contains "=").

    Raises ``ValueError`` naming the valid choices for an unknown name.
    """
    if "=" in name:
        return from_description(name)
    if name not in TASK_SPECS and name not in HELDOUT_BUILDERS and name not in VALIDATION_BUILDERS:
        valid = list_tasks() + list_heldout_tasks() + list_validation_tasks()
        raise ValueError(f"unknown task {name!r}; valid choices: {valid}")
    return _cached(name)
