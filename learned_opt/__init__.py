"""learned-opt: meta-trained learned optimizers for PyTorch, deployed on gossip workers.

Public API::

    from learned_opt import LearnedOptimizer, list_pretrained
    opt = LearnedOptimizer(model.parameters())          # the shipped default checkpoint

The core (this package) imports torch only: never Lightning or TensorBoard.
"""

from .checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    list_pretrained,
    load_checkpoint,
    save_checkpoint,
)
from .chunked import learned_update, tensor_step_, tensor_steps_
from .config import NetConfig
from .core import init_state, tensor_step
from .network import LearnedOptimizerNet
from .optimizer import LearnedOptimizer

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "LearnedOptimizer",
    "LearnedOptimizerNet",
    "NetConfig",
    "init_state",
    "learned_update",
    "list_pretrained",
    "load_checkpoint",
    "save_checkpoint",
    "tensor_step",
    "tensor_step_",
    "tensor_steps_",
]
