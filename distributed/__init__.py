"""Decentralized training: topologies, mixing, communicators and ``GossipOptimizer``.

Installed as ``learned_opt.distributed``. Topologies are pure data; ``mix`` is the
one mixing function shared by the single-process simulator and real
``torch.distributed`` workers (gloo on CPU, NCCL on GPU).
"""

from .mixing import learned_edge_weight, metropolis_weight, mix
from .simulated import RULES, SimulatedCommunicator
from .topology import Topology, get_topology, list_topologies

__all__ = [
    "RULES",
    "SimulatedCommunicator",
    "Topology",
    "get_topology",
    "learned_edge_weight",
    "list_topologies",
    "metropolis_weight",
    "mix",
]
