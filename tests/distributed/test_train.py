"""The torchrun entry point, run through the local launcher (one spawn, several configs)."""

import subprocess
import sys
import warnings
from types import SimpleNamespace

import dist_workers as w
import pytest
import torch

from learned_opt import LearnedOptimizer, load_checkpoint
from learned_opt.distributed import GossipOptimizer, launch_local
from learned_opt.distributed.train import format_summary, launched, parse_args

CONFIGS = [
    ["--optimizer", "learned", "--mixing", "learned", "--topology", "ring"],
    ["--optimizer", "adam", "--mixing", "metropolis", "--topology", "complete"],
    ["--optimizer", "sgd", "--mixing", "uniform", "--topology", "exponential"],
    ["--optimizer", "sgd", "--mixing", "allreduce"],
    ["--optimizer", "adam", "--mixing", "learned", "--overlap"],
    ["--optimizer", "adam", "--compression", "topk:0.1", "--drift-correction", "0.01"],
    ["--optimizer", "adam", "--compression", "topk:0.1"],
    ["--optimizer", "adam", "--local-steps", "4", "--compression", "topk:0.2"],
]


def _run_all(rank, world_size, logdir):
    out = []
    for i, cfg in enumerate(CONFIGS):
        argv = ["--task", "iris_mlp", "--steps", "15", "--metrics-every", "5", *cfg]
        argv += ["--timeout", str(w.COLLECTIVE_TIMEOUT)]
        if i == 0:
            argv += ["--logdir", logdir]
        out.append(launched(rank, world_size, argv))
    return out


@pytest.mark.timeout(w.test_timeout())
def test_train_entry_point_all_optimizers(tmp_path):
    results = launch_local(
        _run_all, 2, str(tmp_path), timeout=w.launch_timeout(), pg_timeout=w.STARTUP
    )
    for per_config in zip(*results):
        a, b = per_config
        assert a["test_loss"] == pytest.approx(b["test_loss"])  # the averaged model, on every rank
        assert a["workers"] == 2 and a["steps"] == 15
        assert torch.isfinite(torch.tensor(a["train_loss"]))
        assert "test_loss=" in format_summary(a)
        assert a["survivors"] == [0, 1] and a["failures"] == []
    assert results[0][3]["consensus_distance"] == pytest.approx(0.0, abs=1e-10)  # allreduce
    assert results[0][5]["drift_correction"] == 0.01  # passed down to the communicator
    assert results[0][6]["drift_correction"] == pytest.approx(0.005)  # topk:0.1's default
    assert results[0][0]["drift_correction"] is None  # exact exchange
    local_steps, exact = results[0][7], results[0][1]
    assert local_steps["local_steps"] == 4 and "local_steps=4" in format_summary(local_steps)
    # 4 rounds (the last after 3 steps, at the end) of a fifth of the entries, against every
    # parameter every step
    assert local_steps["bytes_per_step"] < exact["bytes_per_step"] / 5
    assert local_steps["drift_correction"] == pytest.approx(0.01)  # topk:0.2's default
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_parse_args_defaults():
    args = parse_args(["--optimizer", "adam"])
    assert args.mixing == "metropolis" and args.partition == "dirichlet" and args.alpha == 0.1
    assert parse_args([]).mixing == "learned"
    with pytest.raises(SystemExit):
        parse_args(["--topology", "nope"])
    with pytest.raises(SystemExit):
        parse_args(["--kill-rank", "1"])  # needs --kill-step
    assert parse_args([]).on_failure == "exclude"
    # moments shared unless asked not to (GossipOptimizer decides for None)
    assert parse_args([]).share_state is None
    assert parse_args(["--no-share-state"]).share_state is False
    assert parse_args([]).share_state_every == 2
    assert parse_args(["--share-state-every", "4"]).share_state_every == 4
    # local steps mix with Metropolis weights whatever the local optimizer
    local = parse_args(["--local-steps", "4"])
    assert local.mixing == "metropolis" and local.outer is None and local.outer_lr is None


def test_gossip_optimizer_validates_arguments():
    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(ValueError, match="unknown mixing"):
        GossipOptimizer(sgd, "ring", mixing="bogus")
    with pytest.raises(ValueError, match="needs a topology or a communicator"):
        GossipOptimizer(sgd, mixing="metropolis")
    with pytest.raises(RuntimeError, match="init_process_group"):
        GossipOptimizer(sgd, "ring", mixing="metropolis")
    with pytest.raises(ValueError, match="on_failure must be one of"):
        GossipOptimizer(sgd, "ring", mixing="metropolis", on_failure="ignore")
    given = SimpleNamespace(topology=None, on_failure="exclude", compression=None)
    with pytest.raises(ValueError, match="compression='sign' applies to the default"):
        GossipOptimizer(sgd, communicator=given, mixing="metropolis", compression="sign")
    with pytest.raises(ValueError, match="drift_correction=0.1 applies to the default"):
        GossipOptimizer(sgd, communicator=given, mixing="metropolis", drift_correction=0.1)
    with pytest.raises(ValueError, match="on_failure='raise' applies to the default"):
        GossipOptimizer(sgd, communicator=given, mixing="metropolis", on_failure="raise")


def _under_gossip(opt: LearnedOptimizer) -> bool:
    transform = opt.config_transform
    return transform is not None and transform(opt.config) == opt.net.mixing.under_gossip(
        opt.config
    )


def test_gossip_takes_a_checkpoint_that_adapts_step_sizes():
    p = torch.zeros(4, requires_grad=True)
    local = LearnedOptimizer([p], checkpoint="adapt_init")
    with pytest.raises(RuntimeError, match="init_process_group"):  # past every other check
        GossipOptimizer(local, "ring")
    assert not _under_gossip(local)  # a failed construction leaves the optimizer as it was
    args = parse_args(["--checkpoint", "adapt_init"])
    assert args.checkpoint == "adapt_init"


def test_the_shipped_rule_is_one_rule_wherever_the_optimizer_steps():
    from datetime import timedelta

    import torch.distributed as dist

    from learned_opt.checkpoint import DEFAULT_CHECKPOINT
    from learned_opt.distributed import ProcessGroupCommunicator, get_topology

    shipped = load_checkpoint(DEFAULT_CHECKPOINT)[1]
    p = torch.zeros(4, requires_grad=True)
    fresh, named = LearnedOptimizer([p]), LearnedOptimizer([p], checkpoint="gossip_adapt")
    assert fresh.card == shipped and fresh.net.config.adapts_lr
    stepped = LearnedOptimizer([p])
    p.grad = torch.ones(4)
    stepped.step()
    with pytest.raises(RuntimeError, match="init_process_group"):
        GossipOptimizer(fresh, "ring")
    assert not _under_gossip(fresh)  # a failed construction changes nothing
    store, timeout = dist.HashStore(), timedelta(seconds=w.COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    try:
        comm = ProcessGroupCommunicator(get_topology("ring", 1))
        wrapped = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, opt in (("fresh", fresh), ("named", named), ("stepped", stepped)):
                wrapped[name] = GossipOptimizer(opt, communicator=comm)
    finally:
        dist.destroy_process_group()
    said = [str(c.message) for c in caught]
    assert said and all("nothing to mix" in m for m in said)  # world size 1, and only that
    # every optimizer keeps its network, whose edge head the learned mixing shares, and
    # steps under gossip's bounds on its adapted step sizes
    for name, opt in (("fresh", fresh), ("named", named), ("stepped", stepped)):
        assert _under_gossip(opt) and wrapped[name].net is opt.net
    assert fresh.card == stepped.card == shipped and named.card != shipped
    assert wrapped["fresh"].mixing == "learned"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--task", "nope"], "--task: unknown task 'nope'"),
        (["--partition", "skewed"], "--partition: must be one of"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--share-state-every", "0"], "--share-state-every must be >= 1"),
        (["--alpha", "-1"], "--alpha must be > 0"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--lr", "nan"], "--lr must be finite and >= 0"),
        (["--checkpoint", "./missing.pt"], "--checkpoint: ./missing.pt: no such file"),
        (["--topology", "torus"], "--topology:"),
        (["--compression", "topk:2"], "--compression: top-k ratio must be in (0, 1]"),
        (["--compression", "fp4"], "--compression: unknown compression 'fp4'"),
        (["--consensus-step", "0"], "--consensus-step must be in (0, 1]"),
        (["--drift-correction", "-1"], "--drift-correction must be in [0, 1.0]"),
        (
            ["--compression", "topk:0.01", "--drift-correction", "0.1"],
            "--drift-correction must be in [0, 0.04]",
        ),
        (["--step-deadline", "0"], "--step-deadline must be in (0, --timeout)"),
        (["--step-deadline", "1", "--overlap"], "--step-deadline goes with neither"),
        (["--kill-rank", "1"], "--kill-rank and --kill-step go together"),
        (["--local-steps", "0"], "--local-steps must be >= 1"),
        (["--local-steps", "2", "--overlap"], "not with --overlap"),
        (["--local-steps", "2", "--mixing", "allreduce"], "not with --mixing allreduce"),
        (["--local-steps", "2", "--mixing", "learned"], "not with --mixing learned"),
        (["--local-steps", "2", "--robust", "clip"], "not with --robust"),
        (["--local-steps", "2", "--outer-lr", "0"], "--outer-lr must be finite and > 0"),
        (["--outer", "nesterov"], "--outer and --outer-lr go with --local-steps"),
        (["--outer-lr", "0.5"], "--outer and --outer-lr go with --local-steps"),
        (
            ["--local-steps", "2", "--drift-correction", "0.01"],
            "--consensus-step and --drift-correction need --compression",
        ),
    ],
)
def test_argument_mistakes_are_one_line_with_exit_code_2(argv, fragment, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as under torchrun; a 3-worker torus is invalid
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and fragment in errors[0], errors
    monkeypatch.setenv("RANK", "1")  # the other ranks exit alike, silently
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert capsys.readouterr().err == ""


def test_argument_mistake_in_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "learned_opt.distributed.train", "--task", "nope"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in proc.stderr, proc.stderr
    assert "unknown task 'nope'" in lines[-1]


def test_consensus_distance_is_logged_only_when_measured():
    from datetime import timedelta

    import torch.distributed as dist

    from learned_opt.distributed import ProcessGroupCommunicator, get_topology

    class Recorder:
        def __init__(self):
            self.steps: dict[str, list[int]] = {}

        def add_scalar(self, tag, value, step):
            self.steps.setdefault(tag, []).append(step)

    store, timeout = dist.HashStore(), timedelta(seconds=w.COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    try:
        params = [torch.zeros(3, requires_grad=True)]
        writer = Recorder()
        comm = ProcessGroupCommunicator(get_topology("ring", 1))
        opt = GossipOptimizer(
            torch.optim.SGD(params, lr=0.1), communicator=comm, metrics_every=3, writer=writer
        )
        for _ in range(7):
            params[0].grad = torch.ones(3)
            opt.step()
    finally:
        dist.destroy_process_group()
    assert writer.steps["gossip/consensus_distance"] == [0, 3, 6]
    assert writer.steps["gossip/bytes_sent"] == list(range(7))


def test_the_torch_local_optimizers_are_fused_where_torch_supports_it():
    """D-Adam, D-SGD and the entry's local Adam/SGD step with torch's fused kernels on CPU
    (one pass per tensor), and step as the unfused ones do; the integer buffer of a
    parameter list that holds one is left to torch's default."""
    from learned_opt.distributed.gossip import fused_where_supported
    from learned_opt.distributed.train import _local_optimizer

    params = [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.1}]
    assert fused_where_supported(params) == (params, {"fused": True})
    assert fused_where_supported(iter(groups)) == (groups, {"fused": True})
    lazy = [{"params": (p for p in params), "lr": 0.1}]  # a generator is read once
    assert fused_where_supported(lazy) == ([{"params": params, "lr": 0.1}], {"fused": True})
    assert fused_where_supported([torch.zeros(2, dtype=torch.long)])[1] == {}
    assert fused_where_supported([])[1] == {}
    for name in ("adam", "sgd"):
        args = SimpleNamespace(optimizer=name, lr=0.01, checkpoint=None)
        assert _local_optimizer(args, params).defaults["fused"] is True
    fused = [p.detach().clone().requires_grad_() for p in params]
    plain = [p.detach().clone().requires_grad_() for p in params]
    opts = [torch.optim.Adam(fused, lr=0.01, fused=True), torch.optim.Adam(plain, lr=0.01)]
    for step in range(5):
        for group, opt in zip((fused, plain), opts):
            for p in group:
                p.grad = torch.full_like(p, float(step + 1)) * torch.arange(p.numel()).view(p.shape)
            opt.step()
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b)


def test_compressed_local_steps_need_a_static_topology(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ["--local-steps", "2", "--compression", "topk:0.1", "--topology", "one_peer_ring"]
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert "needs a static topology; one_peer_ring changes every step" in capsys.readouterr().err
    assert parse_args(argv[:2] + ["--topology", "one_peer_ring"]).local_steps == 2  # exact: any
