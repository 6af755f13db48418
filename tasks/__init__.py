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

from .base import MODEL_KINDS, Task, TaskSpec, WorkerBatches, from_description, stack_params
from .datasets import Dataset, list_datasets, load_dataset
from .families import TaskFamily, get_family, list_families
from .partition import PARTITION_SCHEMES, label_skew, partition_indices
from .registry import get_task, list_tasks

__all__ = [
    "MODEL_KINDS",
    "PARTITION_SCHEMES",
    "Dataset",
    "Task",
    "TaskFamily",
    "TaskSpec",
    "WorkerBatches",
    "from_description",
    "get_family",
    "get_task",
    "label_skew",
    "list_datasets",
    "list_families",
    "list_tasks",
    "load_dataset",
    "partition_indices",
    "stack_params",
]
