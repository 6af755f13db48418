"""The fixed tasks, by name. ``digits_mlp`` is the reference task other packages use."""

from __future__ import annotations

import functools

from .base import Task, TaskSpec, from_description

__all__ = ["TASK_SPECS", "get_task", "list_tasks"]

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
    ]
}


def list_tasks() -> list[str]:
    """Names of the fixed tasks, in registry order."""
    return list(TASK_SPECS)


@functools.cache
def _cached(name: str) -> Task:
    return Task(TASK_SPECS[name])


def get_task(name: str) -> Task:
    """A fixed task by name, or any task from a ``describe()`` line (contains "=").

    Raises ``ValueError`` naming the valid choices for an unknown name.
    """
    if "=" in name:
        return from_description(name)
    if name not in TASK_SPECS:
        raise ValueError(f"unknown task {name!r}; valid choices: {list_tasks()}")
    return _cached(name)
