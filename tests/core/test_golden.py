"""Both implementations of the step give the shipped checkpoints' recorded updates, to 1e-5.

The reference (``data/golden_updates.pt``, see ``golden.py``) was recorded from the pure
step; a refactor must keep it. The eager in-place step here skips the networks whose heads
are zero (:func:`learned_opt.step.active_parts`) and must still match; the compiled kernel
is checked against the same references in ``test_kernel.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
from golden import GOLDEN, LR, STEP, golden_inputs, pure_step

from learned_opt import list_pretrained, load_checkpoint, step
from learned_opt.kernel import step_tensors
from learned_opt.segments import FlatLayout
from learned_opt.step import active_parts, flat_step, moment_rows

REFERENCE = torch.load(GOLDEN, weights_only=True)


def _tensor_step(theta, cfg, inputs):
    return {k: pure_step(theta, cfg, t) for k, t in inputs.items()}


def _flat_step(theta, cfg, inputs):
    """All tensors as segments of one flat vector, on two identical rows (workers)."""
    layout = FlatLayout(tuple(inputs), tuple(t["p"].shape for t in inputs.values()))
    flat = {key: layout.flatten({k: t[key] for k, t in inputs.items()}, 0) for key in "pgv"}
    m = torch.cat([t["m"].reshape(3, -1) for t in inputs.values()], dim=-1)
    p, g, v = (flat[k].expand(2, -1) for k in "pgv")
    log_lr = None
    if cfg.adapts_lr:
        log_lr = torch.stack([t["log_lr"] for t in inputs.values()]).expand(2, -1)
    out = flat_step(theta, cfg, layout, p, g, m.expand(2, 3, -1), v, STEP, LR, log_lr=log_lr)
    new_p, new_m, new_v = out[:3]
    assert torch.equal(new_p[0], new_p[1])
    ps, vs = layout.unflatten(new_p[0]), layout.unflatten(new_v[0])
    ms = new_m[0].split(layout.numels, dim=-1)
    lrs = out[3][0].unbind() if log_lr is not None else [None] * len(inputs)
    return {
        k: {"p": ps[k], "m": m.reshape(3, *ps[k].shape), "v": vs[k], "log_lr": lr}
        for k, m, lr in zip(inputs, ms, lrs)
    }


def in_place(fn, theta, cfg, inputs):
    """Run ``fn`` (:func:`~learned_opt.kernel.step_tensors`, eager or compiled) on copies of
    the golden inputs, each tensor at step count ``STEP``; return the new tensors."""
    params = [t["p"].clone() for t in inputs.values()]
    states = [
        {**{key: t[key].clone() for key in ("m", "v", "log_lr")}, "step": torch.tensor(STEP - 1.0)}
        for t in inputs.values()
    ]
    grads = [t["g"] for t in inputs.values()]
    oks = fn(theta, cfg, active_parts(theta), params, grads, states, torch.tensor(LR))
    assert oks.all()
    assert all(float(s["step"]) == STEP for s in states)
    return {k: {"p": p, **s} for k, p, s in zip(inputs, params, states)}


PATHS = {
    "tensor_step": _tensor_step,
    "flat_step": _flat_step,
    "step_tensors": lambda theta, cfg, inputs: in_place(step_tensors, theta, cfg, inputs),
}


def check_recorded(
    checkpoint: str, got: dict, inputs: dict, adapts_lr: bool, rows: int = 3
) -> None:
    """``got`` (new tensors per golden input) equals the recorded updates of ``checkpoint``:
    the first ``rows`` momenta (the step's :func:`~learned_opt.step.moment_rows`) updated,
    the others as they were."""
    for name, ref in REFERENCE[checkpoint].items():
        new = got[name]
        update = (ref["p"] - inputs[name]["p"]).abs().max()
        err = (new["p"] - ref["p"]).abs().max()
        assert err <= 1e-5 * update + 1e-9, f"{name}: {err:.2e} of update {update:.2e}"
        torch.testing.assert_close(new["m"][:rows], ref["m"][:rows], rtol=1e-5, atol=1e-8)
        assert torch.equal(new["m"][rows:], inputs[name]["m"][rows : len(new["m"])])
        torch.testing.assert_close(new["v"], ref["v"], rtol=1e-5, atol=1e-10)
        if adapts_lr:
            torch.testing.assert_close(new["log_lr"], ref["log_lr"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("checkpoint", list_pretrained())
def test_every_path_gives_the_recorded_updates(checkpoint, path):
    net, _ = load_checkpoint(checkpoint)
    inputs = golden_inputs()
    got = PATHS[path](net.theta(), net.config, inputs)
    # the in-place step evaluates only the active parts, and updates the momenta they read
    rows = moment_rows(active_parts(net.theta())) if path == "step_tensors" else 3
    check_recorded(checkpoint, got, inputs, net.config.adapts_lr, rows)


def _doubled_update(
    cfg, p, d, log_mag, m1, v, step, scale, shapes, matrices=None, q=None, refresh=True,
    g=None,
):  # fmt: skip
    """A changed output stage (twice the update), to be swapped into ``apply_update``."""
    new, new_q = _original_apply_update(  # noqa: F821
        cfg, p, d, log_mag, m1, v, step, scale, shapes, matrices, q, refresh, g
    )
    return new + (new - p), new_q


def test_changing_the_output_stage_once_changes_every_path(monkeypatch):
    """The output parameterisation is one function: swapping its code changes all paths."""
    net, _ = load_checkpoint("default")
    inputs = golden_inputs()
    before = {path: fn(net.theta(), net.config, inputs) for path, fn in PATHS.items()}
    original = types.FunctionType(
        step.apply_update.__code__, step.__dict__, "apply_update", step.apply_update.__defaults__
    )
    monkeypatch.setitem(step.__dict__, "_original_apply_update", original)
    monkeypatch.setattr(step.apply_update, "__code__", _doubled_update.__code__)
    for path, fn in PATHS.items():
        after = fn(net.theta(), net.config, inputs)
        for name, t in inputs.items():
            old_upd = before[path][name]["p"] - t["p"]
            new_upd = after[name]["p"] - t["p"]
            torch.testing.assert_close(new_upd, 2 * old_upd, rtol=1e-4, atol=1e-9, msg=path)
