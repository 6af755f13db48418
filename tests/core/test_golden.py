"""Every path of the step gives the shipped checkpoints' recorded updates, to 1e-5.

The reference (``data/golden_updates.pt``, see ``golden.py``) was recorded from the pure
step before the step math was written once; a refactor of any layout must keep it.
"""

from __future__ import annotations

import types

import pytest
import torch
from golden import GOLDEN, LR, STEP, golden_inputs, pure_step

from learned_opt import list_pretrained, load_checkpoint, stages
from learned_opt._chunked import chunked_step_
from learned_opt._fused import fused_step_, fuses_whole
from learned_opt._stacked import packed_step_, stacked_step_
from learned_opt.flat import flat_step
from learned_opt.functional import learned_step
from learned_opt.orthogonal import needs_whole_tensor
from learned_opt.segments import FlatLayout
from learned_opt.workers import ChunkRunner

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


def _in_place(fn):
    def run(theta, cfg, inputs):
        params = [t["p"].clone() for t in inputs.values()]
        states = [{key: t[key].clone() for key in ("m", "v", "log_lr")} for t in inputs.values()]
        grads = [t["g"] for t in inputs.values()]
        oks = fn(theta, cfg, params, grads, states)
        assert all(bool(ok) for ok in oks)
        return {k: {"p": p, **s} for k, p, s in zip(inputs, params, states)}

    return run


def _stacked(theta, cfg, params, grads, states):
    (w1, w2), rest = (0, 1), range(2, len(params))
    flags = stacked_step_(
        theta, cfg, *([x[i] for i in (w1, w2)] for x in (params, grads, states)), STEP, LR
    )
    for i in rest:
        flags = torch.cat(
            [flags, stacked_step_(theta, cfg, [params[i]], [grads[i]], [states[i]], STEP, LR)]
        )
    return flags.tolist()


PATHS = {
    "tensor_step": _tensor_step,
    "flat_step": _flat_step,
    "packed": _in_place(lambda th, c, *a: packed_step_(th, c, *a, STEP, LR)),
    "stacked": _in_place(_stacked),
    "chunked": _in_place(
        lambda th, c, *a: chunked_step_(th, c, *a, STEP, LR, chunk=100, runner=ChunkRunner(2))
    ),
    "learned_step": _in_place(
        lambda th, c, *a: learned_step(th, c, *a, STEP, LR, small_tensor_size=300)
    ),
    # the fused pass uncompiled (compiled: test_fused.py, slow), every tensor one call
    "fused": _in_place(lambda th, c, *a: fused_step_(th, c, *a, STEP, LR, compiled=False)),
    "fused_packed": _in_place(  # the small tensors packed into one pass
        lambda th, c, *a: fused_step_(th, c, *a, STEP, LR, compiled=False, small_tensor_size=300)
    ),
    "learned_step_fused": _in_place(
        lambda th, c, *a: learned_step(th, c, *a, STEP, LR, small_tensor_size=8, fused="eager")
    ),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("checkpoint", list_pretrained())
def test_every_path_gives_the_recorded_updates(checkpoint, path):
    net, _ = load_checkpoint(checkpoint)
    inputs = golden_inputs()
    shapes = [t["p"].shape for t in inputs.values()]
    if path == "chunked":  # the dispatcher never sends such tensors there
        refused = any(needs_whole_tensor(net.config, s) for s in shapes)
    else:  # the fused step takes "ortho" matrices (direction pass, then Newton-Schulz)
        refused = path.startswith("fused") and not all(fuses_whole(net.config, s) for s in shapes)
    if refused:
        with pytest.raises(ValueError, match="cannot step them"):
            PATHS[path](net.theta(), net.config, inputs)
        return
    got = PATHS[path](net.theta(), net.config, inputs)
    for name, ref in REFERENCE[checkpoint].items():
        new = got[name]
        update = (ref["p"] - inputs[name]["p"]).abs().max()
        err = (new["p"] - ref["p"]).abs().max()
        assert err <= 1e-5 * update + 1e-9, f"{name}: {err:.2e} of update {update:.2e}"
        torch.testing.assert_close(new["m"], ref["m"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(new["v"], ref["v"], rtol=1e-5, atol=1e-10)
        if net.config.adapts_lr:
            torch.testing.assert_close(new["log_lr"], ref["log_lr"], rtol=1e-5, atol=1e-7)


def _doubled_update(cfg, p, d, log_mag, m1, v, step, scale, scratch=None, shapes=None):
    """A changed output stage (twice the update), to be swapped into ``apply_update``."""
    before = p.clone()
    new = _original_apply_update(cfg, p, d, log_mag, m1, v, step, scale, scratch, shapes)  # noqa: F821
    return torch.add(new, new - before, out=new if scratch is not None else None)


def test_changing_the_output_stage_once_changes_every_path(monkeypatch):
    """The output parameterisation is one function: swapping its code changes all paths."""
    net, _ = load_checkpoint("default")
    inputs = golden_inputs()
    before = {path: fn(net.theta(), net.config, inputs) for path, fn in PATHS.items()}
    original = types.FunctionType(
        stages.apply_update.__code__,
        stages.__dict__,
        "apply_update",
        stages.apply_update.__defaults__,
    )
    monkeypatch.setitem(stages.__dict__, "_original_apply_update", original)
    monkeypatch.setattr(stages.apply_update, "__code__", _doubled_update.__code__)
    for path, fn in PATHS.items():
        after = fn(net.theta(), net.config, inputs)
        for name, t in inputs.items():
            old_upd = before[path][name]["p"] - t["p"]
            new_upd = after[name]["p"] - t["p"]
            torch.testing.assert_close(new_upd, 2 * old_upd, rtol=1e-4, atol=1e-9, msg=path)
