"""Worker functions for the multi-process tests (importable by spawned processes).

Each function runs on one rank of a gloo group started by ``launch_local`` and returns
plain data to the parent. The tiny model, its data and its optimizers are shared with the
single-process reference in ``test_process_group.py``.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from learned_opt import LearnedOptimizer, LearnedOptimizerNet
from learned_opt.config import MixingConfig, NetConfig
from learned_opt.distributed import (
    GossipError,
    GossipOptimizer,
    GradientTracking,
    ProcessGroupCommunicator,
    get_topology,
)
from learned_opt.distributed.packing import Layout

STEPS = 20
KINDS = {
    "sgd": "ring",
    "adam": "one_peer_exponential",
    "learned": "ring",
    "adapt": "ring",
    "adapt_every3": "ring",
}
#: The kinds whose local optimizer is a LearnedOptimizer (they mix with learned weights);
#: "adapt" adapts its per-tensor step sizes, with a ceiling under gossip that binds;
#: "learned" shares its moments in every exchange, "adapt" in one of every 2 (the
#: default), "adapt_every3" in one of every 3.
LEARNED_KINDS = ("learned", "adapt", "adapt_every3")
#: ``GossipOptimizer(share_state_every=...)`` per kind (None: the default, 2).
SHARE_STATE_EVERY = {"sgd": None, "adam": None, "learned": 1, "adapt": None, "adapt_every3": 3}

# ----------------------------------------------------------------------------- time limits
# CI shares its machine: at a load of 6-8 on 2 cores, starting 4 interpreters that import
# torch takes tens of seconds and a neighbour can lag by seconds. Every limit of these
# tests derives from two numbers; none is tight. A dead neighbour is still noticed at once
# (gloo sees the closed connection), so a generous timeout costs nothing when all is well.

#: Seconds any one wait of a collective may take.
COLLECTIVE_TIMEOUT = 30.0
#: Seconds for spawning the workers, importing torch and joining the process group.
STARTUP = 120.0


def launch_timeout(waits: int = 2) -> float:
    """Deadline of one ``launch_local``: start-up, plus ``waits`` collective timeouts that
    may expire one after another (a failure noticed by one rank, then by its neighbours),
    plus the work itself."""
    return STARTUP + waits * COLLECTIVE_TIMEOUT + 60.0


def test_timeout(waits: int = 2) -> float:
    """pytest-timeout of a test that launches once: the launch deadline plus clean-up."""
    return launch_timeout(waits) + 30.0


test_timeout.__test__ = False  # a helper, not a test


# ----------------------------------------------------------------------------- shared model


def init_params(rank: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    shapes = [(8, 5), (8,), (1, 8)]
    return [(0.5 * torch.randn(s, generator=gen)).requires_grad_(True) for s in shapes]


def batch(rank: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * seed + 100 * step + rank)
    x = torch.randn(16, 5, generator=gen)
    return x, (x[:, :1] * (rank + 1)).sin()  # a different target per rank


def loss_fn(params: list[torch.Tensor], data) -> torch.Tensor:
    w1, b1, w2 = params
    x, y = data
    return F.mse_loss(torch.tanh(x @ w1.T + b1) @ w2.T, y)


def make_net(seed: int = 0, adapt: bool = False) -> LearnedOptimizerNet:
    """A network with a random (non-Metropolis) edge head and a mildly random update;
    ``adapt``: it adapts per-tensor step sizes, at most e^0.5 under gossip."""
    cfg = NetConfig(lr_adapt_rate=0.5) if adapt else NetConfig()
    net = LearnedOptimizerNet(cfg, MixingConfig(lr_adapt_max_gossip=0.5))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("edge_out.weight", "edge_out.bias", "edge_in.bias"):
            p = net.get_parameter(name)
            p.copy_(torch.randn(p.shape, generator=gen))
        for name in ("tensor_out.weight", "elem_out.weight"):
            p = net.get_parameter(name)
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return net


def make_local(kind: str, params, seed: int = 0):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return LearnedOptimizer(params, net=make_net(seed, adapt=kind.startswith("adapt")))


def _payload(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7 * rank + 1000 * step)
    return [
        torch.randn(3, 4, generator=gen) * 1e3,
        torch.randn(5, generator=gen, dtype=torch.float64) / 3,
        torch.randn(2, 3, generator=gen).to(torch.bfloat16),
        torch.randint(-1000, 1000, (4,), generator=gen),
        torch.randn(7, generator=gen),
    ]


# ----------------------------------------------------------------------------- suites


def robust_payload(rank: int) -> torch.Tensor:
    """What ``rank`` sends in :func:`_robust_mix`: rank 1 sends finite bad values."""
    return torch.full((4,), 1e6 if rank == 1 else float(rank))


_HONEST_PACK = Layout.pack


def _forged_pack(layout, ys, loss, buf) -> bool:
    """``Layout.pack`` of a malicious rank: NaN sent with the finite flag set."""
    _HONEST_PACK(layout, ys, loss, buf)
    layout.header(buf)[1] = 1.0
    return True


#: Local steps on real ranks (``local_steps_run``): rounds, local steps per round, inner lr.
LOCAL_ROUNDS, LOCAL_H, LOCAL_LR = 5, 3, 0.2
#: Local steps after the last whole round, which ``LocalSteps.flush`` sends.
LOCAL_TAIL = 2


def local_targets(n: int) -> torch.Tensor:
    """Each rank's quadratic's minimum, ``[n, 6, 3]`` (label skew in miniature)."""
    return torch.randn(n, 6, 3, generator=torch.Generator().manual_seed(11)) * 3.0


def local_start() -> torch.Tensor:
    """The parameters every rank starts from (a seeded initialisation, as LocalSteps needs)."""
    return torch.randn(6, 3, generator=torch.Generator().manual_seed(12))


def local_steps_run(rank: int, n: int) -> dict:
    """``LocalSteps`` through a real ``ProcessGroupCommunicator``: SGD local steps on the
    rank's own quadratic, compressed rounds with tracking, outer Nesterov. Returns the
    final parameters and the bytes sent (the simulator runs the same in the parent)."""
    from learned_opt.distributed.local_steps import LocalSteps, nesterov

    topo = get_topology("ring", n)
    param = local_start()
    target = local_targets(n)[rank]
    ls = LocalSteps(
        [param], nesterov(0.5), local_steps=LOCAL_H, topology=topo, rank=rank,
        compression="topk:0.25", communicator=ProcessGroupCommunicator(topo, timeout=COLLECTIVE_TIMEOUT),
    )  # fmt: skip
    rounds = 0
    for _ in range(LOCAL_ROUNDS * LOCAL_H + LOCAL_TAIL):
        param.sub_(LOCAL_LR * (param - target))  # the inner step: SGD on ||p - target||^2 / 2
        rounds += ls.step()
    flushed = ls.flush()  # the last LOCAL_TAIL steps' round
    return {"param": param.clone(), "bytes_sent": ls.bytes_sent, "rounds": rounds,
            "flushed": flushed, "flushed_again": ls.flush()}  # fmt: skip


def compiled_robust_mix(rank: int, n: int, kernel_dir: str) -> dict:
    """``robust="clip"`` on the ring with compiling on (a kernel folder of the test's own):
    the first exchanges measure eagerly and queue the distances' kernel (one rank of the
    host builds it, the others load it), then rank 1 sends 1e6 and, at the next step, NaN
    under a forged finite flag, through the kernel."""
    import os

    from learned_opt import kernel
    from learned_opt.kernel import (
        COMPILE_AFTER,
        COMPILE_ENV,
        KERNEL_DIR_ENV,
        compile_after_seconds,
    )

    os.environ[COMPILE_ENV], os.environ[KERNEL_DIR_ENV] = "1", kernel_dir
    kernel.CHILD_NICE = 0  # a busy test machine: no waiting child
    comm = ProcessGroupCommunicator(
        get_topology("ring", n), timeout=COLLECTIVE_TIMEOUT, robust="clip"
    )
    with compile_after_seconds(0):
        for step in range(COMPILE_AFTER):
            comm.mix([torch.full((4,), float(rank))], step)
    built = comm.distances.wait(timeout=600)
    dist.barrier()  # every rank's kernel is loaded before the next exchange
    mixed, info = comm.mix([robust_payload(rank)], COMPILE_AFTER)
    nan = robust_payload(rank)
    if rank == 1:
        nan[0] = float("nan")
        with mock.patch.object(Layout, "pack", _forged_pack):
            comm.mix([nan], COMPILE_AFTER + 1)
        return {"built": built, "mixed": mixed[0].tolist()}
    forged, forged_info = comm.mix([nan], COMPILE_AFTER + 1)
    return {
        "built": built, "mixed": mixed[0].tolist(), "excluded": info["excluded"],
        "forged": forged[0].tolist(), "forged_excluded": forged_info["excluded"],
    }  # fmt: skip


def _robust_mix(rank: int, n: int) -> dict:
    """``robust="clip"`` on the ring: step 0 rank 1 sends 1e6, step 1 it sends NaN, step 2
    NaN with a forged finite flag; then the same forged NaN through a top-k exchange."""
    comm = ProcessGroupCommunicator(
        get_topology("ring", n), timeout=COLLECTIVE_TIMEOUT, robust="clip"
    )
    mixed, _ = comm.mix([robust_payload(rank)], 0)
    in_place = [robust_payload(rank)]  # mixed into the tensors it sent, all read first
    comm.mix(in_place, 0, out=in_place)
    nan = robust_payload(rank)
    if rank == 1:
        nan[0] = float("nan")
        try:
            comm.mix([nan], 1)
        except GossipError:
            pass
        with mock.patch.object(Layout, "pack", _forged_pack):
            comm.mix([nan], 2)
        squeezed = ProcessGroupCommunicator(
            get_topology("ring", n), timeout=COLLECTIVE_TIMEOUT, robust="clip",
            compression="topk:1.0",
        )  # fmt: skip
        squeezed.mix([robust_payload(rank)], 0)  # the first exchange is sent whole
        with mock.patch.object(Layout, "pack", _forged_pack):
            squeezed.mix([nan], 1)
        return {
            "mixed": mixed[0].tolist(), "in_place": in_place[0].tolist(), "excluded": [1],
            "forged": [[1], True, [1], True],
        }  # fmt: skip
    _, info = comm.mix([nan], 1)
    forged, forged_info = comm.mix([robust_payload(rank)], 2)
    squeezed = ProcessGroupCommunicator(
        get_topology("ring", n), timeout=COLLECTIVE_TIMEOUT, robust="clip", compression="topk:1.0"
    )
    squeezed.mix([robust_payload(rank)], 0)
    topk, topk_info = squeezed.mix([robust_payload(rank)], 1)
    return {
        "mixed": mixed[0].tolist(),
        "in_place": in_place[0].tolist(),
        "excluded": info["excluded"],
        "topk_mixed": topk[0].tolist(),
        "forged": [
            forged_info["excluded"], bool(torch.isfinite(forged[0]).all()),
            topk_info["excluded"], bool(torch.isfinite(topk[0]).all()),
        ],
    }  # fmt: skip


def exchange_suite(rank: int, n: int) -> dict:
    """Exact exchange, start-up validation, NaN exclusion, consensus, DSGT."""
    out: dict = {}
    for name in ("ring", "one_peer_exponential"):
        topo = get_topology(name, n)
        comm = ProcessGroupCommunicator(topo, timeout=COLLECTIVE_TIMEOUT)
        checks = []
        for step in range(topo.period + 1):
            peers, tensors, losses, finite = comm.exchange(
                _payload(rank, step), step, 10 * rank + step
            )
            assert peers == topo.neighbors(rank, step)
            for k, peer in enumerate(peers):
                exact = all(torch.equal(a, b) for a, b in zip(tensors[k], _payload(peer, step)))
                checks.append((peer, exact, losses[k] == 10 * peer + step, finite[k]))
        out[name] = checks

    try:
        ProcessGroupCommunicator(get_topology("ring", n + 1))
    except ValueError as exc:
        out["world_size_error"] = str(exc)
    comm = ProcessGroupCommunicator(get_topology("ring", n), timeout=COLLECTIVE_TIMEOUT)
    layout = [torch.zeros(3), torch.zeros(4 if rank == 2 else 5)]
    try:
        comm.check_layout(layout)
    except ValueError as exc:
        out["layout_error"] = str(exc)

    ys = [torch.full((4,), float(rank)), torch.full((2,), 2.0 * rank, dtype=torch.float64)]
    if rank == 1:
        ys[0][2] = float("nan")
        try:  # it sends its tensors marked non-finite, then raises
            comm.mix(ys, 0)
        except GossipError as exc:
            out["own_nan_error"] = str(exc)
        out["nan"] = ([], 0, [])
    else:
        mixed, info = comm.mix(ys, 0)
        out["nan"] = (info["excluded"], comm.nonfinite_excluded, [m.tolist() for m in mixed])

    out["robust"] = _robust_mix(rank, n)
    out["local_steps"] = local_steps_run(rank, n)

    gen = torch.Generator().manual_seed(rank)
    params = [torch.randn(6, 3, generator=gen), torch.randn(4, generator=gen)]
    writer = _Recorder()
    opt = GossipOptimizer(
        torch.optim.SGD(params, lr=0.0),
        "ring",
        "metropolis",
        metrics_every=1,
        writer=writer,
        timeout=COLLECTIVE_TIMEOUT,
    )
    before = opt.communicator.consensus_distance(params)
    total = torch.cat([p.reshape(-1) for p in params]).clone()
    for _ in range(10):
        opt.step()
    mean_change = opt.communicator.all_reduce(torch.cat([p.reshape(-1) for p in params]) - total, 0)
    out["consensus"] = (float(before), writer.series("gossip/consensus_distance"))
    out["mean_change"] = float(mean_change.abs().max())
    out["bytes_sent"] = opt.metrics["gossip/bytes_sent"]

    # topk:0.25 runs with its default drift correction (beta 0.0125), so the real exchange
    # checks that it keeps the average too
    for spec, rule in (("topk:0.25", "metropolis"), ("sign", "metropolis"), ("int8", "learned")):
        gen = torch.Generator().manual_seed(rank)
        params = [torch.randn(6, 3, generator=gen), torch.randn(4, generator=gen)]
        start = torch.cat([p.reshape(-1) for p in params]).clone()
        net = make_net() if rule == "learned" else None
        opt = GossipOptimizer(
            torch.optim.SGD(params, lr=0.0),
            "ring",
            rule,
            net=net,
            compression=spec,
            consensus_step=0.5,
            metrics_every=0,
        )
        before = opt.communicator.consensus_distance(params)
        for _ in range(30):
            opt.step()
        moved = torch.cat([p.reshape(-1) for p in params]) - start
        out[spec] = {
            "mean_change": float(opt.communicator.all_reduce(moved, 0).abs().max()),
            "consensus": (float(before), float(opt.communicator.consensus_distance(params))),
            "bytes": opt.metrics["gossip/bytes_sent"],
        }

    target = torch.full((3,), float(rank))  # f_i(x) = |x - target_i|^2 / 2, optimum mean = 1.5
    x = torch.zeros(3, requires_grad=True)
    dsgt = GradientTracking([x], lr=0.2, topology="ring")
    for _ in range(150):
        x.grad = (x - target).detach()
        dsgt.step()
    out["dsgt"] = x.detach().tolist()
    return out


class _Recorder:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def add_scalar(self, tag, value, step):
        self.values.setdefault(tag, []).append(value)

    def series(self, tag):
        return self.values.get(tag, [])


def equivalence_run(rank: int, n: int, seed: int) -> dict:
    """D-SGD, D-Adam and the learned optimizer, STEPS steps each, blocking and overlapped;
    returns the final params per ``(kind, overlap)``."""
    results = {}
    for overlap in (False, True):
        for kind, topo in KINDS.items():
            params = init_params(rank, seed)
            mixing = "learned" if kind in LEARNED_KINDS else "metropolis"
            local = make_local(kind, params, seed)
            every = SHARE_STATE_EVERY[kind]
            options = {} if every is None else {"share_state_every": every}
            opt = GossipOptimizer(local, topo, mixing, timeout=COLLECTIVE_TIMEOUT,
                                  overlap=overlap, **options)  # fmt: skip
            for step in range(STEPS):
                opt.zero_grad()
                loss = loss_fn(params, batch(rank, step, seed))
                loss.backward()
                opt.step(loss=loss.detach())
            results[kind, overlap] = [p.detach().clone() for p in params]
    return results
