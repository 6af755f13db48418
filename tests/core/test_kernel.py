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
from types import SimpleNamespace

import pytest
import torch
from golden import LR, STEP, golden_inputs
from test_golden import check_recorded

from learned_opt import LearnedOptimizer, kernel
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.kernel import COMPILE_AFTER, COMPILE_ENV
from learned_opt.step import active_parts, moment_rows

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
            state[key].copy_(t[key][: len(state[key])] if key == "m" else t[key])
        state["step"].fill_(STEP - 1)


@pytest.fixture(scope="module")
def compiled():
    """An optimizer of the shipped rule whose kernel is compiled, and how its steps went."""
    if not kernel.BACKGROUND_COMPILE:
        pytest.skip("this torch steps the eager reference")
    mp = pytest.MonkeyPatch()
    mp.setenv(COMPILE_ENV, "1")
    mp.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)  # tiny tensors: compile them anyway
    mp.setattr(kernel, "CHILD_NICE", 0)  # on a busy test machine a niced child waits long
    children = []  # whether each child process compiled
    in_child = kernel._Worker._compile_in_child
    mp.setattr(kernel._Worker, "_compile_in_child",
               lambda self, args: children.append(in_child(self, args)) or children[-1])  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (conftest): else each recompiles on its thread
    try:
        inputs, params, opt = _golden_optimizer()
        for _ in range(COMPILE_AFTER):
            opt.step()
        queued_while_stepping = not opt.wait_compiled(timeout=0)
        ready = opt.wait_compiled(timeout=COMPILE_TIMEOUT)
        opt.children = children
        torch.set_num_threads(threads)
        yield inputs, params, opt, queued_while_stepping, ready
    finally:
        torch.set_num_threads(threads)
        mp.undo()


def test_step_returns_before_the_kernel_is_compiled(compiled):
    *_, queued_while_stepping, ready = compiled
    assert queued_while_stepping, "step() waited for the compile"
    assert ready, "the kernel did not compile"


def test_a_child_process_compiled_each_kernel_first(compiled):
    """The compile runs in a child process first (see ``_Worker._compile_in_child``):
    traced in this one, it would stall the training thread."""
    _, _, opt, *_ = compiled
    assert opt.children and all(opt.children), opt.children
    assert len(opt.children) == len(opt._kernels._entries)


def _job_args():
    from learned_opt.config import NetConfig
    from learned_opt.step import Parts

    p = torch.zeros(3)
    state = {"m": torch.zeros(3, 3), "v": torch.zeros(3), "step": torch.zeros(())}
    return {}, NetConfig(), Parts(), [p], [p.clone()], [state], torch.ones(())


@pytest.mark.parametrize("child", ["import sys; sys.exit(3)", None])
def test_a_child_that_fails_leaves_the_compile_to_this_process(monkeypatch, child):
    """A child that exits with an error, or cannot start, returns False quietly: the
    compile in this process then does all the work (and any error is raised there)."""
    if child is None:
        monkeypatch.setattr(kernel.sys, "executable", "/nonexistent/python")
    else:
        monkeypatch.setattr(kernel, "_CHILD", child)
    worker = kernel._Worker()
    assert worker._compile_in_child(_job_args()) is False
    assert worker.child is None


def test_kernel_gives_the_recorded_updates(compiled, monkeypatch):
    inputs, params, opt, *_ = compiled
    monkeypatch.setenv(COMPILE_ENV, "1")
    entries = list(opt._kernels._entries.values())
    eager_steps = [e.eager_steps for e in entries]
    _set_golden_state(opt, params, inputs)
    opt.step()
    assert [e.eager_steps for e in entries] == eager_steps, "a bucket ran the reference"
    got = {name: {"p": p.detach(), **opt.state[p]} for name, p in zip(inputs, params)}
    rows = moment_rows(active_parts(opt.net.theta()))
    check_recorded(DEFAULT_CHECKPOINT, got, inputs, opt.config.adapts_lr, rows)


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


def test_another_thread_count_steps_eagerly_instead_of_recompiling(compiled, monkeypatch):
    """A kernel compiled at one thread count would recompile on the training thread at
    another (its guards read the count): a changed count is a new kind of bucket, stepped
    by the reference until its own compile (none here), and the old kernel returns when
    the count does."""
    inputs, params, opt, *_ = compiled
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", float("inf"))
    kernels = opt._kernels
    compiled_kinds = dict(kernels._entries)
    threads = torch.get_num_threads()
    _set_golden_state(opt, params, inputs)
    try:
        torch.set_num_threads(threads + 1)
        with torch.compiler.set_stance("fail_on_recompile"):
            opt.step()
        new = [e for k, e in kernels._entries.items() if k not in compiled_kinds]
        assert new and all(e.fn is None and e.eager_steps == 1 for e in new)
        torch.set_num_threads(threads)
        eager_steps = [e.eager_steps for e in compiled_kinds.values()]
        with torch.compiler.set_stance("fail_on_recompile"):
            opt.step()
        assert [e.eager_steps for e in compiled_kinds.values()] == eager_steps
    finally:
        torch.set_num_threads(threads)
        kernels._entries = compiled_kinds


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
from learned_opt import LearnedOptimizer, kernel
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = LearnedOptimizer(m.parameters())
kernel.COMPILE_AFTER_SECONDS = 0.0  # so that the compile starts after the third step
for _ in range(6):
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


class _Submissions:
    """A stand-in for the compile worker that records which step queued a compile."""

    def __init__(self):
        self.at_step: list[int] = []
        self.step = 0

    def submit(self, entry, args):
        self.at_step.append(self.step)


def test_a_compile_is_queued_once_the_eager_steps_took_compile_after_seconds(monkeypatch):
    """A small model's short run never pays for a compile (it slows the training thread
    many times over while it traces): the compile is queued once the eager steps of a kind
    have taken ``COMPILE_AFTER_SECONDS`` in all, and never twice."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setattr(kernel, "BACKGROUND_COMPILE", True)
    worker = _Submissions()
    monkeypatch.setattr(kernel, "_worker", lambda: worker)
    ticks = iter(range(10**6))  # each eager step of a bucket takes 0.5 s of this clock
    monkeypatch.setattr(kernel, "time", SimpleNamespace(perf_counter=lambda: 0.5 * next(ticks)))
    _, _, opt = _golden_optimizer()
    default = kernel.COMPILE_AFTER_SECONDS
    with kernel.compile_after_seconds(2.0):
        for step in range(1, 9):
            worker.step = step
            opt.step()
    assert kernel.COMPILE_AFTER_SECONDS == default
    kinds = len(opt._kernels._entries)
    assert worker.at_step == [5] * kinds  # steps 1-4 took 2 s; the fifth queued each kind


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
