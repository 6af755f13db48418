"""learned-opt: a learned optimizer for PyTorch, meta-trainable and deployed on gossip workers
(the shipped rule is hand-set, not meta-trained).

Public API::

    from learned_opt import LearnedOptimizer, list_pretrained
    opt = LearnedOptimizer(model.parameters())          # the shipped default checkpoint

The step is written once, in :mod:`learned_opt.step` (differentiable: meta-training
unrolls it, and it is the eager path), and :mod:`learned_opt.kernel` runs it compiled. The core (this package) imports torch only: never Lightning or TensorBoard.
"""

from .checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    list_pretrained,
    load_checkpoint,
    save_checkpoint,
)
from .config import MixingConfig, NetConfig
from .network import LearnedOptimizerNet
from .optimizer import LearnedOptimizer, StalledError
from .schedules import wsd_schedule

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "LearnedOptimizer",
    "LearnedOptimizerNet",
    "MixingConfig",
    "NetConfig",
    "StalledError",
    "list_pretrained",
    "load_checkpoint",
    "save_checkpoint",
    "wsd_schedule",
]
