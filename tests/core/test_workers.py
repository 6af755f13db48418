"""The chunk runner and the multi-tensor fast path on worker threads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from optim_table import perturbed_net

from learned_opt import LearnedOptimizer, workers
from learned_opt._chunked import chunked_step_
from learned_opt.features import init_state
from learned_opt.flat import tensor_step
from learned_opt.workers import ChunkRunner


def test_map_keeps_task_order_and_gives_each_worker_its_own_workspace():
    runner = ChunkRunner(workers=2)
    seen = []

    def task(i, workspace):
        workspace.setdefault("owner", threading.get_ident())
        seen.append((workspace["owner"], threading.get_ident()))
        return i * i

    assert runner.map(task, list(range(50))) == [i * i for i in range(50)]
    assert all(owner == ident for owner, ident in seen)  # a workspace never changes thread
    assert runner.map(task, []) == []


def test_map_runs_inline_with_one_worker():
    caller = threading.get_ident()
    assert ChunkRunner(workers=1).map(lambda t, ws: threading.get_ident(), [0, 1]) == [caller] * 2


def test_map_raises_a_task_error_and_stays_usable():
    runner = ChunkRunner(workers=2)

    def task(i, workspace):
        if i == 7:
            raise ValueError("bad chunk 7")
        return i

    with pytest.raises(ValueError, match="bad chunk 7"):
        runner.map(task, list(range(20)))
    assert runner.map(task, [1, 2]) == [1, 2]


def test_workers_use_one_intra_op_thread_and_leave_the_caller_alone():
    before = torch.get_num_threads()
    runner = ChunkRunner(workers=2)
    inside = runner.map(lambda t, ws: torch.get_num_threads(), [0, 1, 2, 3])
    assert inside == [1] * 4
    assert torch.get_num_threads() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("learned-opt")]


def test_tasks_run_in_the_callers_grad_mode():
    runner = ChunkRunner(workers=2)
    with torch.no_grad():
        assert runner.map(lambda t, ws: torch.is_grad_enabled(), [0, 1, 2]) == [False] * 3
    assert runner.map(lambda t, ws: torch.is_grad_enabled(), [0, 1, 2]) == [True] * 3


def test_invalid_worker_count():
    with pytest.raises(ValueError, match="workers"):
        ChunkRunner(workers=0)


def test_optimizer_with_runner_survives_deepcopy():
    params, opt = _run(workers=2, steps=1)
    clone = copy.deepcopy(opt)
    clone.step()


def _model_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 40), (300,), (5, 7, 9), (0, 4), (1000,)]
    return [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in shapes]


def _run(workers, steps=4, chunk=64):
    params = _model_params()
    opt = LearnedOptimizer(
        params, net=perturbed_net(8), chunk_size=chunk, small_tensor_size=0, workers=workers
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_threaded_steps_are_bitwise_repeatable_and_match_serial():
    a, _ = _run(workers=2)
    b, _ = _run(workers=2)
    serial, _ = _run(workers=1)
    for x, y, z in zip(a, b, serial):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, rtol=1e-6, atol=1e-7)


def test_multi_tensor_step_skips_only_the_nonfinite_tensor():
    net = perturbed_net(8)
    theta, cfg = net.theta(), net.config
    params = [t.detach().clone() for t in _model_params()]
    grads = [torch.randn_like(p) for p in params]
    grads[2][1, 2, 3] = float("nan")
    states = [init_state(p) for p in params]
    expected = [
        tensor_step(theta, cfg, p, g, s["m"], s["v"], 1, 1.0)[0]
        for p, g, s in zip(params, grads, states)
    ]
    before = [p.clone() for p in params]
    oks = chunked_step_(theta, cfg, params, grads, states, 1, 1.0, chunk=50, runner=ChunkRunner(2))
    assert oks == [True, True, False, True, True]
    assert torch.equal(params[2], before[2])
    assert not states[2]["m"].any() and not states[2]["v"].any()
    for i in (0, 1, 4):
        torch.testing.assert_close(params[i], expected[i], rtol=1e-5, atol=1e-7)


def test_runnable_threads_reads_procs_running(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nctxt 99\nprocs_running 3\nprocs_blocked 0\n")
    assert workers.runnable_threads(str(stat)) == 3
    stat.write_text("cpu  1 2 3\n")  # the line missing
    assert workers.runnable_threads(str(stat)) is None
    stat.write_text("procs_running many\n")  # malformed
    assert workers.runnable_threads(str(stat)) is None
    assert workers.runnable_threads(str(tmp_path / "absent")) is None


def test_own_runnable_threads_counts_this_process_threads_in_state_r(tmp_path):
    for tid, state in [(10, "R"), (11, "S"), (12, "R")]:
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "stat").write_text(f"{tid} (py thr) {state} 1 2 3\n")
    (tmp_path / "13").mkdir()  # a thread that ended while the folder was read
    assert workers.own_runnable_threads(str(tmp_path)) == 2
    assert workers.own_runnable_threads(str(tmp_path / "absent")) == 1  # at least the caller
    assert workers.own_runnable_threads() >= 1  # this process, for real


@pytest.mark.parametrize(
    ("load", "running", "own", "threads", "free"),
    [
        (0.5, 1, 1, 2, True),  # only the caller runs: room for a second thread
        (0.5, 2, 2, 2, True),  # our own OpenMP team still spinning is no other load
        (0.5, 3, 1, 2, False),  # two other threads just started: the load average lags
        (3.5, 1, 1, 2, False),  # busy for the last minute
        (0.5, None, 1, 2, True),  # no instant count: the load average decides
        (0.5, 1, 1, 3, False),  # more threads than cores
        (0.0, 1, 1, 1, False),  # one thread needs no team
    ],
)
def test_machine_is_free_needs_the_load_and_the_instant_count_to_leave_room(
    monkeypatch, load, running, own, threads, free
):
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(workers.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(workers, "runnable_threads", lambda: running)
    monkeypatch.setattr(workers, "own_runnable_threads", lambda: own)
    assert workers.machine_is_free(threads) is free
