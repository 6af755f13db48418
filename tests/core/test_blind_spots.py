"""The shipped rule has no blind spot for embeddings or for tensors that start late."""

from __future__ import annotations

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
    would take all of it (0.32 at 50,000 rows). A row-sparse matrix takes the Adam form."""
    adam = _touched_row_step(rows, lambda p: torch.optim.Adam(p, lr=1e-3))
    ours = _touched_row_step(rows, LearnedOptimizer)
    assert ours <= 3 * adam
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
