"""The communicator on CUDA tensors, over a one-rank NCCL group (all one GPU allows: NCCL
refuses two ranks on one device). The packed byte buffer round-trips every dtype exactly,
its finite flag sees a NaN, the collectives run, and ``GossipOptimizer`` without
neighbours steps exactly like its local optimizer. Skipped without CUDA and NCCL; the
two-rank attempts are made by ``benchmarks/cuda_check.py``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_workers import _payload, make_net

from learned_opt import LearnedOptimizer
from learned_opt.distributed import GossipOptimizer, ProcessGroupCommunicator, get_topology

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()),
    reason="needs CUDA and NCCL",
)


@pytest.fixture(scope="module")
def comm():
    """A communicator on a one-rank NCCL group on ``cuda:0``."""
    torch.cuda.set_device(0)
    timeout = timedelta(seconds=30)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        yield ProcessGroupCommunicator(get_topology("ring", 1), timeout=timeout)
    finally:
        dist.destroy_process_group()


def _packed(comm, ys, loss):
    layout = comm._layout(ys)
    send, _ = comm._buffers_for(layout, ys[0].device, 0)
    layout.pack(ys, loss, send)
    return layout, send


def test_cuda_buffer_round_trips_every_dtype_exactly(comm):
    ys = [t.cuda() for t in _payload(0, 3)]
    layout, buf = _packed(comm, ys, 0.25)
    assert buf.is_cuda
    for got, want in zip(layout.unpack(buf), ys):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert layout.header(buf).tolist() == [0.25, 1.0]
    ys[2][0, 1] = float("nan")  # the bfloat16 tensor
    layout, buf = _packed(comm, ys, None)
    head = layout.header(buf).tolist()
    assert head[0] != head[0] and head[1] == 0.0  # loss absent (NaN), not finite


def test_collectives_on_cuda(comm):
    t = torch.arange(4.0, device="cuda")
    assert torch.equal(comm.all_reduce(t, 0), torch.arange(4.0, device="cuda"))
    ys = [t.cuda() for t in _payload(0, 1) if t.is_floating_point()]
    comm.check_layout(ys)
    dist_ = comm.consensus_distance(ys)
    assert dist_.is_cuda and float(dist_) == 0.0


def test_gossip_optimizer_without_neighbours_steps_like_its_local_optimizer(comm):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in [(64, 40), (40,), (3,)]]
    plain = [t.cuda().requires_grad_() for t in start]
    gossip = [t.cuda().requires_grad_() for t in start]
    local = LearnedOptimizer(plain, net=make_net(1))
    opt = GossipOptimizer(
        LearnedOptimizer(gossip, net=make_net(1)), communicator=comm, metrics_every=1
    )
    assert opt.mixing == "learned"
    for step in range(4):
        grads = [torch.randn(t.shape, generator=gen).cuda() for t in start]
        for a, b, g in zip(plain, gossip, grads):
            a.grad, b.grad = g.clone(), g.clone()
        local.step()
        opt.step(loss=torch.tensor(1.0 + step, device="cuda"))
    for a, b, s in zip(plain, gossip, start):
        assert not torch.equal(a.detach().cpu(), s)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # no neighbours: local step
    assert opt.metrics["gossip/consensus_distance"] == 0.0
