"""The shipped rule has no blind spot for embeddings or for tensors that start late."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from learned_opt import LearnedOptimizer
from learned_opt.optimizer import has_empty_rows


def _touched_row_step(rows: int, make_opt) -> float:
    """RMS move of the 8 rows of an ``rows``-row embedding that one step touches."""
    torch.manual_seed(0)
    emb = nn.Embedding(rows, 32, _weight=torch.randn(rows, 32) * 0.02)
    opt = make_opt(emb.parameters())
    touched = torch.arange(8)
    before = emb.weight.detach().clone()
    (emb(touched) * torch.randn(8, 32)).sum().backward()
    opt.step()
    return float((emb.weight.detach()[touched] - before[touched]).square().mean().sqrt())


@pytest.mark.parametrize("rows", [64, 50_000])
def test_embedding_rows_move_like_adams_whatever_the_table_size(rows):
    """An orthogonalised step has a fixed RMS over the whole matrix: the 8 rows present
    would take all of it (0.32 at 50,000 rows). A row-sparse matrix takes the Adam form,
    at its base step times the table's factor (NetConfig.table_step_mult)."""
    from learned_opt.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint

    cfg = load_checkpoint(DEFAULT_CHECKPOINT)[0].config
    adam = _touched_row_step(rows, lambda p: torch.optim.Adam(p, lr=1e-3))
    ours = _touched_row_step(rows, LearnedOptimizer)
    table_adam = cfg.step_mult * cfg.table_step_mult / 1e-3 * adam  # Adam at that rate
    assert 0.5 * table_adam <= ours <= 1.5 * table_adam
    assert ours == pytest.approx(_touched_row_step(64, LearnedOptimizer), rel=1e-3)


def test_empty_rows_mark_embeddings_not_layers_with_dead_units():
    grad = torch.randn(6, 4)
    assert not has_empty_rows(grad) and not has_empty_rows(torch.randn(6))
    grad[2] = 0  # a dead ReLU unit: the layer stays orthogonalised
    assert not has_empty_rows(grad)
    grad[3:5] = 0  # half the rows absent from the batch: an embedding table
    assert has_empty_rows(grad)
    assert not has_empty_rows(torch.zeros(1, 4))


def test_a_tensor_that_starts_late_takes_a_fresh_first_step():
    """Bias correction counts each tensor's own steps: a vector whose first gradient
    arrives at step 200 takes the first step a fresh one takes (the group's count gave
    it about 3x at step 2000)."""
    gen = torch.Generator().manual_seed(0)
    early, late = nn.Parameter(torch.randn(10, generator=gen)), nn.Parameter(torch.zeros(10))
    grad = torch.randn(10, generator=gen)
    opt = LearnedOptimizer([early, late])
    for _ in range(200):
        early.grad = torch.randn(10, generator=gen)
        opt.step()
    late.grad = grad.clone()
    opt.step()
    fresh = nn.Parameter(torch.zeros(10))
    fresh.grad = grad.clone()
    LearnedOptimizer([fresh]).step()
    assert float(opt.state[late]["step"]) == 1.0
    torch.testing.assert_close(late.detach(), fresh.detach())


def test_an_embedding_table_adapts_its_step_against_the_slow_momentum():
    """A table row sits in a batch now and then: the adaptation reads the cosine with the
    0.99 momentum (a second row of ``m``, kept for tables alone), and the rule's other
    tensors keep one row, as before."""
    torch.manual_seed(0)
    emb, dense = nn.Embedding(200, 8), nn.Linear(8, 8)
    opt = LearnedOptimizer([*emb.parameters(), *dense.parameters()], compile=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        rows = torch.randint(0, 200, (6,), generator=gen)
        dense(emb(rows)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    table = opt.state[emb.weight]
    assert table["sparse_rows"] and table["m"].shape == (2, 200, 8)
    assert opt.state[dense.weight]["m"].shape == (1, 8, 8)
    # the second row is the 0.99 momentum of the gradients (zero rows included)
    assert table["m"][1].abs().sum() > 0
    assert not torch.allclose(table["m"][0], table["m"][1])


def test_the_adaptation_reads_each_segment_s_own_momentum():
    """In a flat view mixing tables and other tensors, each segment's cosine is taken
    against its own row: the 0.99 momentum for a table, the 0.9 momentum elsewhere."""
    from learned_opt.segments import FlatLayout
    from learned_opt.step import adapt_momentum

    layout = FlatLayout(("a", "b", "c"), ((2, 3), (4,), (2, 2)), (True, False, True))
    m = torch.arange(2 * 14, dtype=torch.float32).view(1, 2, 14)
    got = adapt_momentum(m, layout)[0]
    fast, slow = m[0, 0], m[0, 1]
    torch.testing.assert_close(got, torch.cat([slow[:6], fast[6:10], slow[10:]]))
    dense = FlatLayout(("b",), ((4,),))
    torch.testing.assert_close(adapt_momentum(m[..., :4], dense), m[:, 0, :4])


def test_a_table_s_base_step_takes_its_factor():
    """``table_step_mult`` scales the first step of a row-sparse table's present rows, and
    of nothing else: not its absent rows, not a dense tensor."""
    from dataclasses import replace

    from learned_opt import LearnedOptimizer
    from learned_opt.config import NetConfig
    from learned_opt.features import shape_stats
    from learned_opt.network import LearnedOptimizerNet

    cfg = NetConfig(output="ortho", table_step_mult=5.0)
    stats = shape_stats(((10, 4), (4,)), cfg, torch.zeros(()), (False, False), (True, False))
    assert stats[:, 2].tolist() == pytest.approx([math.log(5.0), 0.0])

    def first_step(mult):
        table = torch.nn.Parameter(torch.zeros(10, 4))
        bias = torch.nn.Parameter(torch.zeros(4))
        opt = LearnedOptimizer(
            [table, bias], net=LearnedOptimizerNet(replace(cfg, table_step_mult=mult))
        )
        table.grad = torch.zeros(10, 4)
        table.grad[:3] = 1.0  # 7 of 10 rows absent: a row-sparse table
        bias.grad = torch.ones(4)
        opt.step()
        assert opt.state[table]["sparse_rows"]
        return table.detach().clone(), bias.detach().clone()

    (t1, b1), (t5, b5) = first_step(1.0), first_step(5.0)
    torch.testing.assert_close(t5[:3], 5 * t1[:3])
    assert not t5[3:].any() and not t1[3:].any()
    torch.testing.assert_close(b5, b1)


def test_building_an_optimizer_leaves_the_global_random_stream_alone():
    """A user's sampling, dropout and shuffling do not depend on whether (or how many
    times) an optimizer was built: its network's layers draw nothing from torch's global
    generator."""
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    LearnedOptimizer([nn.Parameter(torch.zeros(3))])
    LearnedOptimizer([nn.Parameter(torch.zeros(3, 3))])
    torch.testing.assert_close(torch.rand(4), expected)


def test_dead_units_leave_no_subnormal_state():
    """A unit whose gradient turns exactly zero (a dead unit) keeps a momentum that decays
    geometrically: 0.9^t falls below float32's smallest normal number by step ~830, and
    every op reading a subnormal runs several times slower on a CPU. The step flushes
    those entries to zero, and the live units' state is untouched."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    opt = LearnedOptimizer(layer.parameters(), compile=False)
    tiny = torch.finfo(torch.float32).tiny
    x = torch.randn(32, 16)
    for step in range(1000):
        opt.zero_grad()
        out = layer(x)
        if step >= 5:  # units 4..7 die: their rows get exactly zero gradient from now on
            out = torch.cat([out[:, :4], out[:, 4:].detach()], dim=1)
        out.square().mean().backward()
        opt.step()
    m = opt.state[layer.weight]["m"]
    assert not bool(((m != 0) & (m.abs() < tiny)).any())
    assert m.shape[-2:] == (8, 16)
    assert bool((m[:, 4:] == 0).all())  # the dead units' momenta
    assert bool((m[:, :4] != 0).any())
