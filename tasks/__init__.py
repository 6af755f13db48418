"""Task library: the training problems used for meta-training, evaluation and demos.

Installed as ``learned_opt.tasks``. Each task has a functional face (``init``,
pure ``loss``, usable under ``torch.func.vmap``) and a module face (an
``nn.Module`` plus batches). Families sample random tasks. Data ships offline
(scikit-learn datasets, synthetic data, ``pydoc_data.topics``); nothing is
downloaded. Imports torch, numpy and scikit-learn only.

Example::

    task = get_task("digits_mlp")
    params = task.init(torch.Generator().manual_seed(0))
    wb = task.worker_batches(seed=0, num_workers=8, partition="dirichlet", alpha=0.1)
    stacked = stack_params([params] * 8)
    losses = torch.func.vmap(task.loss)(stacked, wb.get(step=0))  # [8]
"""

from .base import (
    MODEL_KINDS,
    NORMS,
    Task,
    TaskSpec,
    WorkerBatches,
    Workload,
    from_description,
    stack_params,
)
from .datasets import Dataset, list_datasets, load_dataset
from .families import TaskFamily, get_family, list_families
from .module_task import ModuleTask
from .partition import PARTITION_SCHEMES, label_skew, partition_indices
from .registry import (
    check_not_held_out,
    get_task,
    is_held_out,
    is_validation,
    list_heldout_tasks,
    list_tasks,
    list_validation_tasks,
)

__all__ = [
    "MODEL_KINDS",
    "NORMS",
    "PARTITION_SCHEMES",
    "Dataset",
    "Task",
    "TaskFamily",
    "TaskSpec",
    "ModuleTask",
    "WorkerBatches",
    "Workload",
    "check_not_held_out",
    "from_description",
    "get_family",
    "get_task",
    "is_held_out",
    "is_validation",
    "label_skew",
    "list_datasets",
    "list_families",
    "list_heldout_tasks",
    "list_tasks",
    "list_validation_tasks",
    "load_dataset",
    "partition_indices",
    "stack_params",
]
