"""A training loop on gossip workers: ``torchrun --nproc_per_node=N examples/gossip_torchrun.py``.

Each rank trains its own copy of a small regression model on its own data and, after
every local step, averages with its neighbours on a ring. Run without torchrun it is one
worker (there is nothing to mix, and a warning says so).
"""

import os

import torch
import torch.distributed as dist

from learned_opt import LearnedOptimizer
from learned_opt.distributed import GossipOptimizer, get_topology

if "WORLD_SIZE" in os.environ:  # started by torchrun
    dist.init_process_group("gloo")
else:  # one process on its own
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
rank, world_size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(rank)  # each rank its own data
x = torch.randn(256, 8)
y = x @ torch.ones(8, 1) + 0.1 * torch.randn(256, 1)
model = torch.nn.Linear(8, 1)

local = LearnedOptimizer(model.parameters())  # the shipped rule, alone or under gossip
opt = GossipOptimizer(local, topology=get_topology("ring", world_size), mixing="learned")
for _ in range(20):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step(loss=loss.detach())  # local step, exchange with neighbours, learned mix
print(f"rank {rank}: loss {loss.item():.4f}")
dist.barrier()  # every rank done before any closes its connections
dist.destroy_process_group()
