"""The torchrun entry point, run through the local launcher (one spawn, several configs)."""

import dist_workers as w
import pytest
import torch

from learned_opt.distributed import GossipOptimizer, launch_local
from learned_opt.distributed.train import format_summary, launched, parse_args

CONFIGS = [
    ["--optimizer", "learned", "--mixing", "learned", "--topology", "ring"],
    ["--optimizer", "adam", "--mixing", "metropolis", "--topology", "complete"],
    ["--optimizer", "sgd", "--mixing", "uniform", "--topology", "exponential"],
    ["--optimizer", "sgd", "--mixing", "allreduce"],
    ["--optimizer", "adam", "--mixing", "learned"],
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
    assert results[0][3]["consensus_distance"] == pytest.approx(0.0, abs=1e-10)  # allreduce
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_parse_args_defaults():
    args = parse_args(["--optimizer", "adam"])
    assert args.mixing == "metropolis" and args.partition == "dirichlet" and args.alpha == 0.1
    assert parse_args([]).mixing == "learned"
    with pytest.raises(SystemExit):
        parse_args(["--topology", "nope"])


def test_gossip_optimizer_validates_arguments():
    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(ValueError, match="unknown mixing"):
        GossipOptimizer(sgd, "ring", mixing="bogus")
    with pytest.raises(ValueError, match="needs a topology or a communicator"):
        GossipOptimizer(sgd, mixing="metropolis")
    with pytest.raises(RuntimeError, match="init_process_group"):
        GossipOptimizer(sgd, "ring", mixing="metropolis")
