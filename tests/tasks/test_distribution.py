"""The task distribution: coverage, reproducibility, descriptions and clear errors."""

import collections
import math

import pytest
import torch

from learned_opt.tasks.distribution import KINDS, build, draw, from_description

N = 1000


@pytest.fixture(scope="module")
def specs():
    return [draw(seed) for seed in range(N)]


def test_a_thousand_draws_cover_every_kind_and_all_build(specs):
    counts = collections.Counter(s.kind for s in specs)
    assert set(counts) == set(KINDS) and len(KINDS) >= 12
    assert min(counts.values()) > N / len(KINDS) / 2  # roughly uniform
    for spec in specs:  # every draw builds (the pytest timeout bounds the time)
        job = build(spec)
        assert isinstance(job.model, torch.nn.Module)
        assert sum(p.numel() for p in job.model.parameters()) > 0


def test_draws_span_horizons_batches_and_scales(specs):
    horizons = [s.horizon for s in specs]
    assert 100 <= min(horizons) < 150 and 4000 < max(horizons) <= 5000
    assert sum(h <= 500 for h in horizons) > N / 2  # short draws are most of them
    assert any(s.batch_size == 0 for s in specs)  # full batch
    assert len({s.batch_size for s in specs}) >= 5
    assert len({s.init_scale for s in specs}) > 100
    for kind in KINDS:  # within a kind, the options vary
        assert len({s.options for s in specs if s.kind == kind}) > 10


def test_a_seed_builds_the_same_job():
    for seed in (3, 17, 101):
        a, b = build(draw(seed)), build(draw(seed))
        for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
            assert torch.equal(p, q), name
        for _ in range(3):
            assert torch.equal(a.loss_fn(next(a.batches)), b.loss_fn(next(b.batches)))
    assert draw(5) != draw(6)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_trains(kind):
    seed = next(s for s in range(10_000) if draw(s).kind == kind)
    job = build(draw(seed))
    opt = torch.optim.AdamW(job.model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = job.loss_fn(next(job.batches))
        assert loss.dim() == 0 and math.isfinite(loss.item())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is not None for p in job.model.parameters() if p.requires_grad)
    assert sum(losses[-5:]) < sum(losses[:5])


def test_descriptions_round_trip_and_restricted_draws():
    for seed in range(30):
        spec = draw(seed)
        assert from_description(spec.describe()) == spec
    only = draw(4, ("graph",))
    assert only.kind == "graph" and from_description(only.describe()) == only


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        draw(-1)
    with pytest.raises(ValueError, match="unknown kinds"):
        draw(0, ("quantum",))
    with pytest.raises(ValueError, match="lacks seed"):
        from_description("kind=mlp horizon=100")
    line = draw(2).describe().replace("horizon=", "horizon=9")
    with pytest.raises(ValueError, match="does not match"):
        from_description(line)
