"""The compiled kernel: the path users get after their first steps, compiled once here.

The suite turns compiling off (``tests/conftest.py``); this module turns it on for one
optimizer of the shipped single-worker rule on the golden tensors, so the session pays
for one compile. It checks that ``step()`` does not wait for the compile, that the kernel
gives the recorded updates, and that it continues a run exactly where the reference left it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from golden import LR, STEP, golden_inputs
from test_golden import check_recorded

from learned_opt import LearnedOptimizer, kernel
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.kernel import COMPILE_AFTER, COMPILE_ENV

#: generous: a cold compile of the golden tensors takes tens of seconds on a loaded machine
COMPILE_TIMEOUT = 600
#: the tests of the compiled kernel need a torch that compiles it (see
#: ``kernel.BACKGROUND_COMPILE_TORCH``); older ones step the reference, tested below
needs_compile = pytest.mark.skipif(
    not kernel.BACKGROUND_COMPILE, reason="this torch steps the eager reference"
)


def _golden_optimizer():
    inputs = golden_inputs()
    params = [torch.nn.Parameter(t["p"].clone()) for t in inputs.values()]
    for p, t in zip(params, inputs.values()):
        p.grad = t["g"].clone()
    return inputs, params, LearnedOptimizer(params, lr=LR)


def _set_golden_state(opt, params, inputs) -> None:
    for p, t in zip(params, inputs.values()):
        p.data.copy_(t["p"])
        p.grad = t["g"].clone()
        state = opt.state[p]
        for key in ("m", "v", "log_lr"):
            state[key].copy_(t[key])
        state["step"].fill_(STEP - 1)


@pytest.fixture(scope="module")
def compiled():
    """An optimizer of the shipped rule whose kernel is compiled, and how its steps went."""
    if not kernel.BACKGROUND_COMPILE:
        pytest.skip("this torch steps the eager reference")
    mp = pytest.MonkeyPatch()
    mp.setenv(COMPILE_ENV, "1")
    try:
        inputs, params, opt = _golden_optimizer()
        for _ in range(COMPILE_AFTER):
            opt.step()
        queued_while_stepping = not opt.wait_compiled(timeout=0)
        ready = opt.wait_compiled(timeout=COMPILE_TIMEOUT)
        yield inputs, params, opt, queued_while_stepping, ready
    finally:
        mp.undo()


def test_step_returns_before_the_kernel_is_compiled(compiled):
    *_, queued_while_stepping, ready = compiled
    assert queued_while_stepping, "step() waited for the compile"
    assert ready, "the kernel did not compile"


def test_kernel_gives_the_recorded_updates(compiled, monkeypatch):
    inputs, params, opt, *_ = compiled
    monkeypatch.setenv(COMPILE_ENV, "1")
    entries = list(opt._kernels._entries.values())
    eager_steps = [e.eager_steps for e in entries]
    _set_golden_state(opt, params, inputs)
    opt.step()
    assert [e.eager_steps for e in entries] == eager_steps, "a bucket ran the reference"
    got = {name: {"p": p.detach(), **opt.state[p]} for name, p in zip(inputs, params)}
    check_recorded(DEFAULT_CHECKPOINT, got, inputs, opt.config.adapts_lr)


def test_kernel_continues_the_reference_run(compiled, monkeypatch):
    """Steps of the kernel and of the reference from the same state agree to 1e-5."""
    inputs, params, opt, *_ = compiled
    monkeypatch.setenv(COMPILE_ENV, "1")
    _set_golden_state(opt, params, inputs)
    ref_params = [torch.nn.Parameter(t["p"].clone()) for t in inputs.values()]
    reference = LearnedOptimizer(ref_params, lr=LR, compile=False)
    _set_golden_state_fresh(reference, ref_params, inputs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(params, ref_params):
            g = 1e-2 * torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["v"], reference.state[q]["v"])


def _set_golden_state_fresh(opt, params, inputs) -> None:
    """:func:`_set_golden_state` on an optimizer that has not stepped: one step creates its
    state, which is then overwritten."""
    for p, t in zip(params, inputs.values()):
        p.grad = t["g"].clone()
    opt.step()
    _set_golden_state(opt, params, inputs)


def test_kernel_runs_without_recompiling_inside_autocast(compiled, monkeypatch):
    """A step inside an autocast region (a training loop's ``with autocast():`` that also
    holds ``opt.step()``) runs the kernel as compiled: a recompile would happen on the
    training thread, and the stance below makes it an error."""
    inputs, params, opt, *_ = compiled
    monkeypatch.setenv(COMPILE_ENV, "1")
    _set_golden_state(opt, params, inputs)
    with torch.compiler.set_stance("fail_on_recompile"):
        opt.step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            opt.step()


def test_compile_thread_exits_when_its_queue_is_empty(compiled):
    """The compiling thread's OpenMP team slows every torch op of the process while the
    thread lives (see :class:`learned_opt.kernel._Worker`): once the kernels are compiled,
    no compile thread is left."""
    import threading

    *_, ready = compiled
    assert ready
    alive = [t.name for t in threading.enumerate() if t.name == "learned-opt-compile"]
    assert alive == []


EXIT_MID_COMPILE = """
import torch
from learned_opt import LearnedOptimizer
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = LearnedOptimizer(m.parameters())
for _ in range(6):  # the compile starts after the third step
    m(torch.randn(8, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
print("done")
"""


@needs_compile
def test_a_script_that_ends_while_the_kernel_compiles_exits_cleanly(tmp_path):
    """A compile still running while the interpreter finalises crashed the process
    (segmentation fault, or ``terminate called without an active exception`` on a
    torchrun rank); at exit the worker now stops quietly."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop(COMPILE_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", EXIT_MID_COMPILE], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]
    assert "Warning" not in out.stderr and "terminate" not in out.stderr, out.stderr[-2000:]


def test_a_closed_worker_queues_nothing_and_releases_its_waiters():
    worker = kernel._Worker()
    worker.close()
    entry = kernel._Entry()
    worker.submit(entry, (None, None, None, [], [], [], torch.zeros(())))
    assert entry.done.is_set() and worker.jobs.empty() and worker.thread is None


@pytest.mark.parametrize(("version", "safe"), [("2.11.0+cu130", False), ("2.12.1", False),
                                               ("2.13.0+cpu", True), ("2.14.1", True)])  # fmt: skip
def test_background_compile_needs_torch_2_13(version, safe):
    assert kernel.compiles_in_background(version) is safe


def test_torch_older_than_2_13_keeps_the_reference_and_says_so(monkeypatch):
    """torch 2.11's compiler cannot run beside the training thread (a kernel called while
    another compiles raises, and the process can crash): there the reference steps, and
    one warning says so; nothing is queued for compiling."""
    monkeypatch.setattr(kernel, "BACKGROUND_COMPILE", False)
    monkeypatch.setattr(kernel, "_warned_old_torch", False)
    monkeypatch.setenv(COMPILE_ENV, "1")
    inputs, params, opt = _golden_optimizer()
    with pytest.warns(RuntimeWarning, match="eager reference steps instead") as caught:
        for _ in range(COMPILE_AFTER + 1):
            opt.step()
    assert len(caught) == 1
    assert not opt._kernels._entries, "a compile was queued on an old torch"
