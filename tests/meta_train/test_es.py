"""The es estimator: the rule's constants as meta-parameters, antithetic evolution strategies
on whole runs, its data-parallel split, and families given by class path."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learned_opt import LearnedOptimizer, load_checkpoint
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.config import MixingConfig, NetConfig
from learned_opt.meta_train import es
from learned_opt.meta_train.cli import export, meta_cli_main
from learned_opt.meta_train.data import step_seeds
from learned_opt.meta_train.families import FamilyJob, resolve_family
from learned_opt.meta_train.meta_cli import CONFIG_DIR
from learned_opt.meta_train.module import MetaTrainModule, mean_across_ranks
from learned_opt.meta_train.rule_space import (
    DEFAULT_NAMES,
    SPACE,
    apply_theta,
    base_fields,
    base_value,
    rule_fields,
)
from learned_opt.network import with_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def shipped():
    return load_checkpoint(DEFAULT_CHECKPOINT)[0]


# ----------------------------------------------------------------------------- rule space
def test_theta_zero_is_exactly_the_hand_set_rule(shipped):
    names = tuple(SPACE)
    net = apply_theta(shipped, names, torch.zeros(len(names)))
    fields = base_fields(shipped)
    for name in names:  # a None field (lr_adapt_max_ortho) takes its fallback's value
        assert base_fields(net)[name] == base_value(fields, name)
    assert net.config.step_mult == shipped.config.step_mult == 2e-3
    assert net.mixing == shipped.mixing
    same = with_config(shipped, rule_fields(fields, DEFAULT_NAMES, [0.0] * len(DEFAULT_NAMES)))
    assert same.config == shipped.config


@pytest.mark.parametrize("scale", [1e-3, 0.5, 3.0, 40.0])
def test_every_theta_is_a_valid_rule_within_the_bounds(shipped, scale):
    names = tuple(SPACE)
    for sign in (1.0, -1.0):
        theta = sign * scale * torch.linspace(0.3, 1.0, len(names))
        fields = rule_fields(base_fields(shipped), names, theta)
        net = apply_theta(shipped, names, theta)  # NetConfig and MixingConfig validate it
        assert isinstance(net.config, NetConfig) and isinstance(net.mixing, MixingConfig)
        for name, value in fields.items():
            assert SPACE[name].lo <= value <= SPACE[name].hi, (name, value)
    # monotone, and a positive scale moves by about a factor e per unit near the base
    up = rule_fields(base_fields(shipped), ["step_mult"], [0.1])["step_mult"]
    assert 2e-3 * math.exp(0.099) < up < 2e-3 * math.exp(0.1)
    nesterov = rule_fields(base_fields(shipped), ["ortho_nesterov"], [0.01])["ortho_nesterov"]
    assert nesterov == pytest.approx(0.1 + 0.001, rel=1e-3)  # a tenth of its range per unit


def test_a_constant_whose_base_is_outside_its_range_is_refused():
    # the Adam rule does not adapt its steps: its rate is 0, outside a log scale's range
    with pytest.raises(ValueError, match="es_constants: rule constant lr_adapt_rate"):
        MetaTrainModule(
            estimator="es", family="distribution", init_checkpoint="adam_init",
            es_constants=["lr_adapt_rate"],
        )  # fmt: skip


# ----------------------------------------------------------------------------- pure ES
def test_population_is_antithetic_and_draws_are_disjoint_across_steps():
    eps = es.perturbations(es.META_SEEDS, 3, pairs=2, dim=4)
    assert torch.equal(eps, es.perturbations(es.META_SEEDS, 3, 2, 4))
    assert not torch.equal(eps, es.perturbations(es.META_SEEDS, 4, 2, 4))
    theta = torch.arange(4.0)
    members = es.population(theta, eps, 0.1)
    assert torch.allclose(members[0] - theta, theta - members[1])
    assert torch.allclose(members[2] - theta, 0.1 * eps[1])
    seeds = es.draw_seeds(es.META_SEEDS, 0, 3) + es.draw_seeds(es.META_SEEDS, 1, 3)
    assert seeds == list(range(es.META_SEEDS, es.META_SEEDS + 6))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_ranks_share_every_run_once(world):
    units = es.work_units(members=4, draws=3)
    assert len(units) == len(set(units)) == 3 + 4 * 3
    shares = [es.share(units, r, world) for r in range(world)]
    assert sorted(u for s in shares for u in s) == sorted(units)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    for d in range(3):  # every rank runs about as many runs of each draw
        per_rank = [sum(u[1] == d for u in s) for s in shares]
        assert max(per_rank) - min(per_rank) <= 1


@pytest.mark.parametrize("world", [2, 3])
def test_the_shares_balance_the_draws_costs(world):
    units = es.work_units(members=8, draws=4)
    costs = [100.0, 1.0, 7.0, 30.0]  # the draws' costs differ by orders of magnitude
    shares = es.balanced_shares(units, costs, world)
    assert sorted(u for s in shares for u in s) == sorted(units)
    loads = [sum(costs[d] for _, d in s) for s in shares]
    assert max(loads) - min(loads) <= max(costs)
    assert statistics.fmean(loads) / max(loads) > 0.95
    assert es.balanced_shares(units, costs, world) == shares  # every rank computes it alike
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 1))
    job = FamilyJob(model, None, iter(()), horizon=50)
    assert es.job_cost(job, 30) == 30 * (121 + 4 * 2_000)


def test_gradient_is_the_antithetic_estimate_and_climbs():
    eps = es.perturbations(es.META_SEEDS, 0, pairs=400, dim=3)
    a = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    scores = es.population(torch.zeros(3), eps, 0.1) @ a  # a linear score
    g = es.gradient(eps, scores, 0.1)
    assert torch.allclose(g, (eps @ a)[:, None].mul(eps).mean(0))  # (a . eps) eps
    assert torch.allclose(g, a, atol=0.3)
    # ES with Adam on a quadratic score reaches its peak
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    peak = torch.tensor([0.5, -0.3, 0.2], dtype=torch.float64)
    opt = torch.optim.Adam([theta], lr=0.05)
    for step in range(200):
        eps = es.perturbations(1, step, 4, 3)
        members = es.population(theta, eps, 0.05)
        theta.grad = -es.gradient(eps, -((members - peak) ** 2).sum(1), 0.05)
        opt.step()
    assert torch.allclose(theta.detach(), peak, atol=0.05)


def test_log_speedup_scores_steps_to_the_common_level_and_divergence_as_the_clip():
    base = [1.0 - 0.01 * i for i in range(60)]
    fast = [1.0 - 0.02 * i for i in range(30)] + [0.42] * 30
    assert es.log_speedup(base, base) == 0.0
    assert es.log_speedup(fast, base) > 0 > es.log_speedup(base, fast)
    blown = base[:10] + [math.inf] * 50
    assert es.log_speedup(blown, base, clip=20.0) == -math.log(20.0)
    assert es.log_speedup(base, blown, clip=20.0) == math.log(20.0)
    assert es.log_speedup(blown, blown) == 0.0 or math.isfinite(es.log_speedup(blown, blown))


def test_the_final_losses_tell_runs_apart_that_reach_the_common_level_together():
    base = [1.0 - 0.01 * i for i in range(20)]
    better = base[:-1] + [0.5]  # the same run but for a lower last loss
    assert es.log_speedup(better, base) == 0.0  # both reach the level at their last step
    assert es.draw_score(better, base) > 0 > es.draw_score(base, better)
    assert es.draw_score(better, base, final_weight=0.0) == 0.0
    blown = base[:5] + [math.inf] * 15
    assert es.draw_score(blown, base, clip=20.0) == -2 * math.log(20.0)


def test_a_run_is_the_curve_of_the_job_and_ends_on_a_non_finite_loss():
    model = torch.nn.Linear(2, 1)
    job = FamilyJob(model, lambda b: model(b).pow(2).mean(), iter(torch.ones(50, 4, 2)), 10)
    curve = es.run_curve(job, lambda p: torch.optim.SGD(p, lr=0.1), es.horizon(job, 30), 0)
    assert len(curve) == 10 and curve[-1] < curve[0]
    bad = FamilyJob(model, lambda b: model(b).sum() * math.inf, iter(torch.ones(50, 4, 2)))
    curve = es.run_curve(bad, lambda p: torch.optim.SGD(p, lr=0.1), es.horizon(bad, 7), 0)
    assert curve == [math.inf] * 7


# ----------------------------------------------------------------------------- data parallel
def test_each_rank_takes_its_own_share_of_the_seeds():
    one = step_seeds(0, 5, 4)
    shares = [step_seeds(0, 5, 2, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat(shares), one)
    assert not torch.equal(shares[0], shares[1])
    assert torch.equal(step_seeds(0, 5, 4, 0, 1), one)  # one process: the seeds as before


def test_outside_a_process_group_the_mean_across_ranks_is_the_tensor():
    t = [torch.ones(2), torch.zeros(3)]
    assert mean_across_ranks(t) is t


#: What a launcher leaves in the environment (Lightning's, after a data-parallel fit in this
#: process): a child that finds them waits for ranks nobody starts.
LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")  # fmt: skip


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return {**env, "OMP_NUM_THREADS": "1"}


def _run_ranks(cmd: list[str]) -> None:
    """Run a data-parallel fit; once more if the port its launcher picked was taken
    meanwhile (by another process on the machine)."""
    for _ in range(2):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_child_env())
        if out.returncode == 0 or "Address already in use" not in out.stderr:
            break
    assert out.returncode == 0, out.stdout + out.stderr


def _es_args(root, *extra):
    return [
        "fit", "--config", str(CONFIG_DIR / "es_smoke.yaml"), f"--trainer.default_root_dir={root}",
        "--trainer.limit_val_batches=0", *extra,
    ]  # fmt: skip


def _theta_c(root: Path) -> torch.Tensor:
    ckpt = sorted(root.glob("lightning_logs/version_*/checkpoints/last.ckpt"))[-1]
    return torch.load(ckpt, weights_only=True)["state_dict"]["theta_c"]


def test_two_processes_make_the_update_of_one(tmp_path):
    """``learned-opt-meta fit --config es_smoke --trainer.devices 2 --trainer.strategy ddp``
    (gloo on CPU): 2 pairs x 2 draws at 20 steps, split across the ranks and gathered, give
    the constants one process gives over the same population and draws."""
    meta_cli_main(_es_args(tmp_path / "one"))
    cmd = [
        sys.executable, "-m", "learned_opt.meta_train.cli_entry",
        *_es_args(tmp_path / "two", "--trainer.devices=2", "--trainer.strategy=ddp"),
    ]  # fmt: skip
    _run_ranks(cmd)
    one, two = _theta_c(tmp_path / "one"), _theta_c(tmp_path / "two")
    assert one.abs().min() > 0  # two outer steps moved every constant
    assert torch.allclose(one, two, rtol=0, atol=1e-12), (one, two)


def test_two_processes_of_truncated_unrolls_make_the_update_of_one_with_twice_the_tasks(tmp_path):
    """The smoke config (tbptt) with 1 task per step on each of 2 ranks: each rank samples
    its own share of the tasks and the meta-gradient is averaged across them, so theta
    moves as one process with 2 tasks per step moves it."""
    common = [
        f"--config={CONFIG_DIR / 'smoke.yaml'}", "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0", "--model.histogram_every=0",
    ]  # fmt: skip
    meta_cli_main(
        [
            "fit",
            *common,
            f"--trainer.default_root_dir={tmp_path / 'one'}",
            "--model.tasks_per_step=2",
        ]
    )
    cmd = [
        sys.executable, "-m", "learned_opt.meta_train.cli_entry", "fit", *common,
        f"--trainer.default_root_dir={tmp_path / 'two'}", "--model.tasks_per_step=1",
        "--trainer.devices=2", "--trainer.strategy=ddp",
    ]  # fmt: skip
    _run_ranks(cmd)

    def theta(root):
        ckpt = sorted(root.glob("lightning_logs/version_*/checkpoints/last.ckpt"))[-1]
        state = torch.load(ckpt, weights_only=True)["state_dict"]
        return {k: v for k, v in state.items() if k.startswith("net.")}

    one, two = theta(tmp_path / "one"), theta(tmp_path / "two")
    start = MetaTrainModule(width=8).net.state_dict()
    assert any(not torch.equal(one[k], start[k[4:]]) for k in one)  # theta moved
    for k in one:
        assert torch.allclose(one[k], two[k], rtol=1e-4, atol=1e-6), k


# ----------------------------------------------------------------------------- own family
FAMILY = """
import torch

class TinyFamily:
    def __call__(self, seed):
        gen = torch.Generator().manual_seed(seed)
        model = torch.nn.Linear(3, 1)
        w = torch.randn(3, generator=gen)

        def batches():
            while True:
                x = torch.randn(16, 3, generator=gen)
                yield x, x @ w

        loss = lambda b: ((model(b[0])[:, 0] - b[1]) ** 2).mean()
        return model, batches(), loss
"""


@pytest.fixture
def my_pkg(tmp_path, monkeypatch):
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "tasks.py").write_text(FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_family_by_class_path_gives_the_same_job_for_a_seed(my_pkg):
    make = resolve_family("my_pkg.tasks:TinyFamily")
    a, b = make(3), make(3)
    assert torch.equal(a.model.weight, b.model.weight)  # its default init follows the seed
    assert torch.equal(next(a.batches)[0], next(b.batches)[0])
    assert not torch.equal(make(4).model.weight, a.model.weight)
    assert resolve_family("my_pkg.tasks.TinyFamily")(3).horizon is None


@pytest.mark.parametrize(
    ("family", "estimator", "message"),
    [
        ("my_pkg.tasks:Missing", "es", "cannot be imported"),
        ("mlp_family", "es", "the es estimator trains on 'distribution'"),
        ("my_pkg.tasks:TinyFamily", "tbptt", "unknown family"),
    ],
)
def test_bad_families_name_the_field(my_pkg, family, estimator, message):
    with pytest.raises(ValueError, match=f"'family': .*{message}"):
        MetaTrainModule(family=family, estimator=estimator)


def test_meta_training_on_your_own_family_exports_a_checkpoint(my_pkg, tmp_path):
    """``learned-opt-meta fit --model.family my_pkg.tasks:TinyFamily``, exported with
    ``learned-opt export`` and loaded by ``LearnedOptimizer(checkpoint=...)``."""
    root = tmp_path / "run"
    meta_cli_main(_es_args(root, "--model.family=my_pkg.tasks:TinyFamily", "--trainer.max_steps=1"))
    ckpt = sorted(root.glob("lightning_logs/version_*/checkpoints/last.ckpt"))[-1]
    out = export(str(ckpt), tmp_path / "mine.pt")
    net, card = load_checkpoint(out)
    theta_c = torch.load(ckpt, weights_only=True)["state_dict"]["theta_c"]
    fields = rule_fields(
        base_fields(load_checkpoint(DEFAULT_CHECKPOINT)[0]), DEFAULT_NAMES, theta_c
    )
    assert net.config.step_mult == fields["step_mult"] != 2e-3
    assert "my_pkg.tasks:TinyFamily" in card["data"] and "over the base rule" in card["summary"]
    model = torch.nn.Linear(3, 1)
    LearnedOptimizer(model.parameters(), checkpoint=str(out), compile=False)


def test_the_example_family_builds_and_trains():
    sys.path.insert(0, str(EXAMPLES))
    try:
        job = resolve_family("own_family:TeacherFamily")(5)
    finally:
        sys.path.remove(str(EXAMPLES))
    opt = LearnedOptimizer(job.model.parameters(), compile=False)
    curve = es.run_curve(job, lambda p: opt, 60, 5)
    assert job.horizon == 200 and min(curve[-10:]) < curve[0]
