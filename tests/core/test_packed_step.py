"""Small tensors stepped together (``kernel.PACK_NUMEL``) take the step they take one by one.

On CPU outside compiling, :func:`learned_opt.kernel.step_tensors` steps the tensors of at
most ``PACK_NUMEL`` elements with the same dtypes and step count as the segments of one
flat vector. Each case runs one model twice, packed (the default) and one tensor per call
(``PACK_NUMEL = 0``), and compares every parameter and state tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from learned_opt import LearnedOptimizer, kernel, load_checkpoint
from learned_opt.distributed.local import gossip_local
from learned_opt.kernel import eager
from learned_opt.step import Parts, active_parts


class _Mixed(nn.Module):
    """Biases, a bf16 vector, small matrices (orthogonalised), a conv kernel, an embedding
    whose batches leave a third of its rows out (not row-sparse), two that leave half out
    (row-sparse: packed with the others, keeping their second momentum), and one matrix too large to
    pack."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 16)
        self.emb2 = nn.Embedding(30, 8)
        self.emb3 = nn.Embedding(20, 4)
        self.small = nn.Linear(16, 32)
        self.conv = nn.Conv1d(4, 8, 3)
        self.norm = nn.LayerNorm(32)
        self.large = nn.Linear(32, kernel.PACK_NUMEL // 32 + 8, bias=False)
        self.bf16 = nn.Parameter(torch.randn(24).to(torch.bfloat16))


class _Twins(_Mixed):
    """:class:`_Mixed` with a second linear layer and a second row-sparse table of the same
    shapes as its own: stacks of same-shape matrices, vectors and tables."""

    def __init__(self):
        super().__init__()
        self.twin = nn.Linear(16, 32)
        self.emb2_twin = nn.Embedding(30, 8)


def _grads(model, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = 1e-2 * torch.randn(p.shape, generator=gen).to(p.dtype)
    model.emb.weight.grad[step % 7 :: 3] = 0  # rows absent from the batch
    model.emb2.weight.grad[step % 2 :: 2] = 0
    model.emb3.weight.grad[(step + 1) % 2 :: 2] = 0
    if isinstance(model, _Twins):
        model.emb2_twin.weight.grad[(step + 1) % 2 :: 2] = 0


_STACK_KEY = eager._stack_key


def _run(
    model, monkeypatch, pack: bool, steps: int = 4, bad=None, late=None, net=None, stack=None
) -> LearnedOptimizer:
    """``steps`` steps; ``bad``: a parameter name whose gradient is NaN at step 2; ``late``:
    a parameter that has no gradient at step 0 (so its step count trails the others).
    ``pack``: small tensors packed; ``stack`` (default: ``pack``): tensors of one shape
    stacked. Without either, every tensor steps in a call of its own."""
    monkeypatch.setattr(kernel, "PACK_NUMEL", kernel.PACK_NUMEL if pack else 0)
    stack = pack if stack is None else stack
    monkeypatch.setattr(eager, "_stack_key", _STACK_KEY if stack else lambda p, g, s: id(p))
    opt = LearnedOptimizer(model.parameters(), net=net, compile=False)
    for step in range(steps):
        _grads(model, step)
        named = dict(model.named_parameters())
        if bad is not None and step == 2:
            named[bad].grad[0] = float("nan")
        if late is not None and step == 0:
            named[late].grad = None
        opt.step()
    return opt


def _assert_same(a_model, a_opt, b_model, b_opt) -> None:
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        bf16 = p.dtype == torch.bfloat16  # rounded to bf16 after the float32 step
        tol = {"rtol": 1e-2, "atol": 1e-3} if bf16 else {"rtol": 1e-5, "atol": 1e-7}
        torch.testing.assert_close(p, q, msg=name, **tol)
        sa, sb = a_opt.state[p], b_opt.state[q]
        assert sa.keys() == sb.keys(), name
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(
                    value, sb[key], rtol=1e-5, atol=1e-8, msg=f"{name}.{key}"
                )
            else:
                assert value == sb[key], f"{name}.{key}"


@pytest.mark.parametrize(
    "case", [{}, {"bad": "small.bias"}, {"bad": "bf16"}, {"late": "norm.weight"}],
    ids=["plain", "nan-gradient", "nan-bf16-gradient", "trailing-step-count"],
)  # fmt: skip
def test_packed_tensors_take_their_own_step(monkeypatch, case):
    model = _Mixed()
    one_by_one = copy.deepcopy(model)
    packed_opt = _run(model, monkeypatch, True, **case)
    single_opt = _run(one_by_one, monkeypatch, False, **case)
    _assert_same(model, packed_opt, one_by_one, single_opt)
    if "bad" in case:  # the NaN tensor alone skipped its update; its neighbours did not
        named = dict(model.named_parameters())
        skips = {n: packed_opt.state[p]["nonfinite_skips"] for n, p in named.items()}
        assert skips == {n: int(n == case["bad"]) for n in named}
        assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    if "late" in case:
        named = dict(model.named_parameters())
        assert float(packed_opt.state[named[case["late"]]]["step"]) == 3
        assert float(packed_opt.state[named["small.bias"]]["step"]) == 4


@pytest.mark.parametrize("where", ["traced", "eager"])
@pytest.mark.parametrize("rule", ["shipped", "default"], ids=["zero-heads", "networks"])
@pytest.mark.parametrize(
    "case", [{}, {"bad": "small.bias"}, {"bad": "twin.weight"}, {"late": "norm.weight"}],
    ids=["plain", "nan-vector", "nan-matrix", "trailing-step-count"],
)  # fmt: skip
def test_stacked_tensors_of_one_shape_take_their_own_step(monkeypatch, case, rule, where):
    """The tensors of one shape that are not packed step as the rows of one call, each with
    its own step count and finite flag: the same step as one call each. Traced (the
    kernel's graph, or an accelerator) every tensor may stack; eagerly on CPU those the
    packer leaves (none here: packing is off). The rule with networks reads the step
    counts in its time features too."""
    net = load_checkpoint(rule)[0] if rule == "default" else None
    model = _Twins()
    one_by_one = copy.deepcopy(model)
    single_opt = _run(one_by_one, monkeypatch, False, net=net, **case)
    stacks = []
    stack = eager._step_stacked
    monkeypatch.setattr(
        eager, "_step_stacked", lambda *a, **k: stacks.append(len(a[3])) or stack(*a, **k)
    )
    if where == "traced":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    stacked_opt = _run(model, monkeypatch, False, net=net, stack=True, **case)
    # at the first step every tensor stepped in a stack (one alone where its shape is its
    # own); those of more than one: the two weights, the two row-sparse tables and the
    # four 32-vectors (three, while one trails)
    stepped_first = len(list(model.parameters())) - ("late" in case)
    first = []
    while sum(first) < stepped_first:
        first.append(stacks[len(first)])
    assert sum(first) == stepped_first
    assert sorted(k for k in first if k > 1) == [2, 2, 3 if "late" in case else 4]
    _assert_same(model, stacked_opt, one_by_one, single_opt)
    if "bad" in case:
        named = dict(model.named_parameters())
        skips = {n: stacked_opt.state[p]["nonfinite_skips"] for n, p in named.items()}
        assert skips == {n: int(n == case["bad"]) for n in named}


def test_packed_step_moves_every_small_tensor(monkeypatch):
    """Packing writes each tensor's new values back where they belong (a step that moved
    the wrong slice, or none, would leave a tensor unchanged or change it by another's
    update)."""
    model = _Mixed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _run(model, monkeypatch, True, steps=1)
    for name, p in model.named_parameters():
        moved = (p.detach().float() - before[name].float()).abs()
        assert moved.max() > 0, name


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-by-one"])
def test_a_zero_head_rule_keeps_only_the_momentum_it_reads(monkeypatch, pack):
    """The shipped rule evaluates no network, so only the 0.9 momentum (``moment_rows``) is
    read, written and kept: 8 bytes of state per float32 parameter, as AdamW's; a
    row-sparse table keeps the 0.99 momentum too, which its step-size adaptation reads."""
    model = _Mixed()
    opt = _run(model, monkeypatch, pack, steps=2)
    assert active_parts(opt.net.theta()) == Parts(tensor_net=False, element_net=False)
    tables = {"emb2.weight", "emb3.weight"}
    for name, p in model.named_parameters():
        m = opt.state[p]["m"]
        assert opt.state[p]["sparse_rows"] == (name in tables), name
        rows = 2 if name in tables else 1
        assert m.shape == (rows, *p.shape) and m.reshape(rows, -1).abs().amax(1).min() > 0, name


def test_the_momenta_follow_the_rule_across_theta_changes_and_state_dicts(monkeypatch):
    """A rule with networks keeps all three momenta; swapping in theta that reads more rows
    starts them at zero, and a state dict saved with three rows loads into the shipped rule
    (its first row kept, and the second for a row-sparse table); both then step like a
    fresh run of the same rule would."""
    model = _Mixed()
    net, _ = load_checkpoint("default")
    assert active_parts(net.theta()) != Parts(tensor_net=False, element_net=False)
    opt = LearnedOptimizer(model.parameters(), net=net, compile=False)
    _grads(model, 0)
    opt.step()
    for name, p in model.named_parameters():
        assert (opt.state[p]["m"].reshape(3, -1).abs().amax(dim=1) > 0).all(), name
    shipped = LearnedOptimizer(model.parameters(), compile=False)
    shipped.load_state_dict(opt.state_dict())
    rows = {n: 1 + bool(opt.state[p]["sparse_rows"]) for n, p in model.named_parameters()}
    assert sorted(n for n, k in rows.items() if k == 2) == ["emb2.weight", "emb3.weight"]
    for name, p in model.named_parameters():  # converted on loading, before any step
        assert shipped.state[p]["m"].shape == (rows[name], *p.shape), name
    first = {n: opt.state[p]["m"][:2].clone() for n, p in model.named_parameters()}
    _grads(model, 1)
    shipped.step()
    for name, p in model.named_parameters():
        m = shipped.state[p]["m"]
        assert m.shape == (rows[name], *p.shape), name
        for row, decay in zip(range(rows[name]), (0.9, 0.99)):
            want = decay * first[name][row] + (1 - decay) * p.grad.float()
            torch.testing.assert_close(m[row], want, msg=name)
    # gossip mixes the rows every tensor has (in place: views of the state); a table's
    # 0.99 momentum stays its own, so ranks whose tables differ in it still agree in shape
    shared = gossip_local(shipped).shared_state()[len(rows) :]
    for p, m in zip(model.parameters(), shared):
        assert m.shape == (1, *p.shape) and m.data_ptr() == shipped.state[p]["m"].data_ptr()
    # theta that reads the slower momenta again: they start at zero, then move; state
    # shared for gossip before that step already has the rows the rule reads
    shipped.net = net
    shipped.refresh_theta()
    shared = gossip_local(shipped).shared_state()
    assert [tuple(t.shape) for t in shared[len(shared) // 2 :]] == [
        (3, *p.shape) for p in model.parameters()
    ]
    _grads(model, 2)
    shipped.step()
    for name, p in model.named_parameters():
        m = shipped.state[p]["m"]
        assert m.shape == (3, *p.shape), name
        torch.testing.assert_close(m[2], 1e-3 * p.grad.float(), msg=name)  # (1 - 0.999) g


def test_a_pack_of_tensors_averaging_split_min_mean_steps_bitwise_as_one_by_one(monkeypatch):
    """Packed tensors that average at least ``SPLIT_MIN_MEAN`` elements are summed one at a
    time, as each tensor's own step sums them: the packed step is the same, bitwise."""
    from learned_opt.segments import SPLIT_MIN_MEAN

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48))
    numels = [p.numel() for p in model.parameters()]
    assert sum(numels) >= SPLIT_MIN_MEAN * len(numels)
    assert max(numels) <= kernel.PACK_NUMEL
    one_by_one = copy.deepcopy(model)
    opts = []
    for pack, net in ((True, model), (False, one_by_one)):
        monkeypatch.setattr(kernel, "PACK_NUMEL", kernel.PACK_NUMEL if pack else 0)
        opts.append(LearnedOptimizer(net.parameters(), compile=False))
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            for p in net.parameters():
                p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
            opts[-1].step()
    packed_opt, single_opt = opts
    for (name, p), q in zip(model.named_parameters(), one_by_one.parameters()):
        assert torch.equal(p, q), name
        for key in ("m", "v", "log_lr"):
            assert torch.equal(packed_opt.state[p][key], single_opt.state[q][key]), name


def test_a_pack_keeps_its_state_flat_and_reads_entries_replaced_from_outside(monkeypatch):
    """Between eager steps the shipped rule's packed tensors keep their state as views of
    one flat buffer per entry (a step then copies only the parameters and gradients in,
    and the parameters out). An entry replaced from outside (set by hand, or a loaded
    state dict) is read at the next step, as the one-by-one step reads it."""
    import io

    model = _Mixed()
    one_by_one = copy.deepcopy(model)
    numel = kernel.PACK_NUMEL
    packed = _run(model, monkeypatch, True, steps=2)
    single = _run(one_by_one, monkeypatch, False, steps=2)
    flat = [model.emb.weight, model.small.weight, model.small.bias, model.norm.bias]
    for key in ("m", "v", "log_lr", "step"):
        buffers = {packed.state[p][key].untyped_storage().data_ptr() for p in flat}
        assert len(buffers) == 1, key
    for opt, net in ((packed, model), (single, one_by_one)):
        opt.state[net.small.weight]["m"] = 0.5 * opt.state[net.small.weight]["m"]
        opt.state[net.norm.bias]["log_lr"] = torch.tensor(-1.0)
    saved = io.BytesIO()
    torch.save(packed.state_dict(), saved)
    saved.seek(0)
    packed.load_state_dict(torch.load(saved, weights_only=True))
    for step in range(2, 4):
        for pack, net, opt in ((True, model, packed), (False, one_by_one, single)):
            monkeypatch.setattr(kernel, "PACK_NUMEL", numel if pack else 0)
            key = _STACK_KEY if pack else lambda p, g, s: id(p)
            monkeypatch.setattr(eager, "_stack_key", key)
            _grads(net, step)
            opt.step()
    _assert_same(model, packed, one_by_one, single)
    assert len({packed.state[p]["m"].untyped_storage().data_ptr() for p in flat}) == 1


@pytest.mark.parametrize("grad", [False, True])
def test_segment_sums_agree_across_methods_and_autograd_gets_a_differentiable_one(grad):
    """One row of small segments (a pack's) is summed with ``segment_reduce`` where the
    step is neither recorded nor traced, else with ``index_add``: both give every method's
    sums (an empty segment 0, a NaN only its own), and the recorded one is differentiable."""
    from learned_opt.segments import FlatLayout, segment_sum

    layout = FlatLayout(tuple("abcde"), ((3, 4), (0,), (5,), (7, 2), (1,)))
    torch.manual_seed(0)
    x = torch.randn(1, layout.size, dtype=torch.float64)
    x[0, 13] = float("nan")  # in the third segment
    expected = torch.stack([s.sum() for s in x[0].split(layout.numels)]).unsqueeze(0)
    for method in ("reduce", "index_add", "split", "padded", "blocked"):
        torch.testing.assert_close(segment_sum(x, layout, method), expected, equal_nan=True)
    x.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        sums = segment_sum(x, layout)
    torch.testing.assert_close(sums, expected, equal_nan=True)
    assert sums[0, 1] == 0 and sums[0, 2].isnan() and sums[0, [0, 3, 4]].isfinite().all()
    if grad:
        weights = torch.tensor([1.0, 2.0, 0.0, 3.0, 4.0], dtype=x.dtype)  # the NaN's: none
        sums[0].nan_to_num().mul(weights).sum().backward()
        assert torch.equal(x.grad[0], weights.repeat_interleave(layout.lengths()))
    with pytest.raises(ValueError, match="elements"):
        segment_sum(x.detach()[:, 1:], layout, "reduce")


@pytest.mark.parametrize("tables, dense", [(1, "bias"), (3, "bias"), (1, "layers"), (2, "layers")])
def test_row_sparse_tables_and_other_tensors_step_in_one_call(monkeypatch, tables, dense):
    """Row-sparse tables (an embedding whose batches leave rows out) and the other small
    tensors step in one call, the same step as one call each. The other tensors keep
    their state flat between steps (views of one buffer); a table's momenta stay its
    own, two rows, copied in and out around the step, and read where a test replaces them."""
    numel, counted = kernel.PACK_NUMEL, []
    flat_step = eager.flat_step
    monkeypatch.setattr(
        eager, "flat_step", lambda *a, **k: counted.append(1) or flat_step(*a, **k)
    )  # fmt: skip

    def model():
        torch.manual_seed(0)
        net = nn.Module()
        net.embs = nn.ModuleList(nn.Embedding(40, 8) for _ in range(tables))
        if dense == "bias":
            net.bias = nn.Parameter(torch.zeros(1))
        else:
            net.layers = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
        return net

    def run(pack: bool):
        net = model()
        monkeypatch.setattr(kernel, "PACK_NUMEL", numel if pack else 0)
        monkeypatch.setattr(eager, "_stack_key", _STACK_KEY if pack else lambda p, g, s: id(p))
        opt = LearnedOptimizer(net.parameters(), compile=False)
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            for p in net.parameters():
                p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
            for emb in net.embs:
                emb.weight.grad[step % 3 :: 2] = 0  # rows absent from the batch
            counted.clear()
            opt.step()
        assert all(opt.state[emb.weight]["sparse_rows"] for emb in net.embs)
        return net, opt, len(counted), len(list(net.parameters()))

    packed_net, packed, packed_calls, _ = run(True)
    single_net, single, single_calls, tensors = run(False)
    assert (packed_calls, single_calls) == (1, tensors)
    _assert_same(packed_net, packed, single_net, single)
    state = packed.state
    table_m = {state[e.weight]["m"].untyped_storage().data_ptr() for e in packed_net.embs}
    assert all(state[e.weight]["m"].shape[0] == 2 for e in packed_net.embs)
    others = [p for n, p in packed_net.named_parameters() if not n.startswith("embs")]
    flat = {state[p][k].untyped_storage().data_ptr() for p in others for k in ("m", "v")}
    assert len(flat) == 2 and not flat & table_m  # the others' m and v: two buffers
    for pack, opt, net in ((True, packed, packed_net), (False, single, single_net)):
        monkeypatch.setattr(kernel, "PACK_NUMEL", numel if pack else 0)
        monkeypatch.setattr(eager, "_stack_key", _STACK_KEY if pack else lambda p, g, s: id(p))
        opt.state[net.embs[0].weight]["m"] = 0.5 * opt.state[net.embs[0].weight]["m"]
        gen = torch.Generator().manual_seed(9)
        for p in net.parameters():
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
        opt.step()
    _assert_same(packed_net, packed, single_net, single)


def test_the_adam_form_spans_the_tensors_that_are_not_orthogonalised():
    """``adam_span``: from the first tensor that is not a matrix to the end of the last."""
    from learned_opt.step import adam_span

    shapes = ((4,), (8, 8), (3,), (2, 2), (16, 16))
    assert adam_span(shapes, (False, True, False, False, True)) == (0, 4 + 64 + 3 + 4)
    assert adam_span(shapes, (True, True, False, True, True)) == (68, 71)
    assert adam_span(shapes, (True,) * 5) == (0, 0)
    assert adam_span((), ()) == (0, 0)
