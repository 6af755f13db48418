"""Decentralized training: topologies, mixing, communicators and ``GossipOptimizer``.

Installed as ``learned_opt.distributed``. Topologies are pure data; ``mix`` is the
one mixing function shared by the single-process simulator and real
``torch.distributed`` workers (gloo on CPU, NCCL on GPU).
"""
