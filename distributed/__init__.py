"""Decentralized training: topologies, mixing, communicators and ``GossipOptimizer``.

Installed as ``learned_opt.distributed``. Topologies are pure data; ``mix`` is the
one mixing function shared by the single-process simulator and real
``torch.distributed`` workers (gloo on CPU, NCCL on GPU).
"""

from .gossip import GossipOptimizer, dadam, dsgd
from .launch import LaunchError, RankFailure, launch_local
from .membership import Failure
from .mixing import RULES, learned_edge_weight, metropolis_weight, mix
from .process_group import GossipError, ProcessGroupCommunicator
from .simulated import SimulatedCommunicator
from .topology import Topology, get_topology, list_topologies
from .tracking import GradientTracking

__all__ = [
    "RULES",
    "Failure",
    "GossipError",
    "GossipOptimizer",
    "GradientTracking",
    "LaunchError",
    "ProcessGroupCommunicator",
    "RankFailure",
    "SimulatedCommunicator",
    "Topology",
    "dadam",
    "dsgd",
    "get_topology",
    "launch_local",
    "learned_edge_weight",
    "list_topologies",
    "metropolis_weight",
    "mix",
]
