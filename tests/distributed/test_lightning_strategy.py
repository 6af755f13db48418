"""GossipStrategy: a Lightning Trainer on 4 local CPU ranks (gloo), checked against the
torchrun entry point. All multi-process checks share one start of the ranks (importing torch
and Lightning in 4 processes is most of the time on a loaded 2-core machine)."""

import subprocess
import sys

import lightning_workers as w  # tests/distributed is on sys.path under pytest
import pytest
import torch

from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.distributed import get_topology, launch_local
from learned_opt.distributed.lightning import CHECKPOINT_KEY, GossipStrategy, own_rank_view

N = 4
EPOCHS = 2  # of 25 steps
LAUNCH_S = 600  # generous: 4 ranks importing Lightning on a shared 2-core machine
PG_S = 120


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lightning"))
    return launch_local(w.suite, N, root, EPOCHS, timeout=LAUNCH_S, pg_timeout=PG_S)


@pytest.mark.timeout(LAUNCH_S + 60)
def test_matches_the_torchrun_entry_point(results):
    for r in results:
        assert r["full"] == pytest.approx(r["entry"], rel=0.05)  # the bar
        assert r["full_rule"] == (DEFAULT_CHECKPOINT, True)  # the shipped rule under gossip, capped
        assert r["full"] == pytest.approx(results[0]["full"])  # the averaged model, on every rank
    assert results[0]["full"] < 0.1  # it trained (digits_mlp starts near log(10))


@pytest.mark.timeout(LAUNCH_S + 60)
def test_resume_continues_exactly_like_an_uninterrupted_run(results):
    for r in results:
        assert r["resumed"] == r["full"]
        assert all(torch.equal(a, b) for a, b in zip(r["full_params"], r["resumed_params"]))
    (full, _), (resumed, _) = results[0]["full_ckpt"], results[0]["resumed_ckpt"]
    assert full["world_size"] == resumed["world_size"] == N
    assert full["step_counts"] == resumed["step_counts"] == [EPOCHS * w.STEPS_PER_EPOCH]
    for a, b in zip(full["ranks"], resumed["ranks"]):
        assert a["state_dict"].keys() == b["state_dict"].keys()
        assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
        sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
        for pid in sa:
            assert all(torch.equal(sa[pid][k], sb[pid][k]) for k in ("m", "v"))


@pytest.mark.timeout(LAUNCH_S + 60)
def test_checkpoint_holds_the_averaged_model_and_every_rank(results):
    gossip, averaged = results[0]["full_ckpt"]
    ranks = [r["state_dict"] for r in gossip["ranks"]]
    assert len(ranks) == N
    assert not torch.equal(ranks[0]["net.layers.0.weight"], ranks[1]["net.layers.0.weight"])
    for k, v in averaged.items():
        torch.testing.assert_close(v, torch.stack([r[k] for r in ranks]).mean(0))


@pytest.mark.timeout(LAUNCH_S + 60)
def test_validation_and_the_end_of_fit_use_the_averaged_model(results):
    for r in results:  # every rank validates the same (averaged) parameters
        assert r["val_params"] == results[0]["val_params"]
        assert r["features"]["val_params"] == results[0]["features"]["val_params"]
        assert all(  # average_at_end: every rank ends with the averaged model
            torch.equal(a, b) for a, b in zip(r["full_params"], results[0]["full_params"])
        )
    own = [r["features"]["own_params"] for r in results]  # average_at_end=False
    assert len(set(own)) == N  # the ranks' own models differ ...
    last_val = results[0]["features"]["val_params"][-1]
    assert last_val == pytest.approx(sum(own) / N, rel=1e-5)  # ... and validation saw their mean


@pytest.mark.timeout(LAUNCH_S + 60)
def test_gossip_metrics_go_through_the_trainers_logger(results):
    m = results[0]["metrics"]
    consensus = m["gossip/consensus_distance"]
    assert len(consensus) == EPOCHS * w.STEPS_PER_EPOCH // 5  # log_every_n_steps=5
    # mixing holds the ranks together: without it their label-skewed drift would grow the
    # distance about tenfold from step 5 to step 50; with it, it stays at its first level
    assert all(c >= 0 for c in consensus) and consensus[-1] < 2 * consensus[0]
    assert all(b > 0 for b in m["gossip/bytes_sent"])
    assert all(0 < e <= 0.5 for e in m["gossip/edge_weight_mean"])  # ring: degree 2
    for e, s in zip(m["gossip/edge_weight_mean"], m["gossip/self_weight_mean"]):
        assert s == pytest.approx(1 - 2 * e, abs=1e-6)
    assert m["gossip/nonfinite_excluded"] == [0.0] * len(consensus)
    assert "train/loss" in m and "val/loss" in m
    assert "gossip/consensus_distance" in results[0]["features"]["metrics"]


@pytest.mark.timeout(LAUNCH_S + 60)
def test_any_optimizer_with_scheduler_clipping_accumulation_and_bf16(results):
    for r in results:
        f = r["features"]
        assert f["gossip_steps"] == [8] and f["global_step"] == 8  # 2 x 8 batches, 2 per step
        assert f["lr"] == pytest.approx(1e-3 * 0.5**2)  # StepLR stepped once per epoch
        assert f["hook_optimizers"] == ["Adam"]  # Lightning's hooks see the user's optimizer
        assert len(f["grad_norms"]) == 8
        assert all(g <= 0.05 * (1 + 1e-4) for g in f["grad_norms"])  # clipped before the step


@pytest.mark.timeout(LAUNCH_S + 60)
def test_allreduce_mixing_keeps_the_ranks_identical(results):
    first = results[0]["allreduce"]["params"]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, r["allreduce"]["params"]))


@pytest.mark.timeout(LAUNCH_S + 60)
def test_manual_optimization_gossips_at_each_step(results):
    for r in results:
        assert r["manual"] == {"gossip_steps": [4], "changed": True}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_300_steps_match_the_torchrun_entry_point(tmp_path):
    res = launch_local(
        w.parity_and_resume, N, str(tmp_path), 12, timeout=1700, pg_timeout=PG_S
    )  # 12 epochs of 25 steps: the entry point's default --steps 300
    for r in res:
        assert r["full"] == pytest.approx(r["entry"], rel=0.05)
        assert r["resumed"] == r["full"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_spawned_ranks_hand_back_the_averaged_model(tmp_path):
    model = w.RankDigits()
    before = w.param_sum(model)
    strategy = GossipStrategy("ring", timeout=300, start_method="spawn")
    w.trainer(str(tmp_path), N, 1, strategy=strategy).fit(model)
    assert w.param_sum(model) != before  # rank 0's final (averaged) model came back
    ckpt = torch.load(w._only_checkpoint(str(tmp_path)), map_location="cpu", weights_only=True)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, ckpt["state_dict"][name])  # the averaged model
    assert len(ckpt[CHECKPOINT_KEY]["ranks"]) == N


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"mixing": "gossipy"}, "unknown mixing"),
        ({"topology": "moebius"}, "unknown topology"),
        ({"metrics_every": -1}, "metrics_every"),
        ({"timeout": 0}, "timeout"),
        ({"gossip_kwargs": {"communicator": None}}, "set by GossipStrategy"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, error):
    with pytest.raises(ValueError, match=error):
        GossipStrategy(**kwargs)
    with pytest.raises(TypeError, match="topology"):
        GossipStrategy(topology=4)


def test_accepts_a_topology_object_and_passes_other_checkpoints_through():
    strategy = GossipStrategy(get_topology("torus", 4), "metropolis", average_at_end=False)
    assert strategy.topology.name == "torus" and not strategy.average_at_end
    plain = {"state_dict": {"w": torch.zeros(2)}}
    assert own_rank_view(plain, 0, 4) is plain


def test_own_rank_view_picks_this_ranks_states_and_checks_the_world_size():
    ranks = [{"state_dict": {"w": torch.full((2,), float(r))}} for r in range(4)]
    ckpt = {"state_dict": {"w": torch.full((2,), 1.5)}, CHECKPOINT_KEY: {"world_size": 4}}
    ckpt[CHECKPOINT_KEY]["ranks"] = ranks
    assert torch.equal(own_rank_view(ckpt, 2, 4)["state_dict"]["w"], torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="holds the states of 4 gossip ranks but this run has 2"):
        own_rank_view(ckpt, 0, 2, "run.ckpt")


class _Payload:  # unpickling it would run code
    pass


def test_checkpoints_are_read_as_weights_only(tmp_path):
    strategy = GossipStrategy()
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": _Payload()}, path)
    with pytest.raises(ValueError, match="weights_only=True only"):
        strategy.load_checkpoint(path, weights_only=False)
    with pytest.raises(Exception, match="Weights only load failed"):
        strategy.load_checkpoint(path)
    torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    assert torch.equal(strategy.load_checkpoint(path)["state_dict"]["w"], torch.ones(2))


def test_the_distributed_package_does_not_import_lightning():
    probe = "import sys, learned_opt.distributed; print(any(m.startswith('lightning') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
