"""The compiled kernel: the path users get after their first steps, built once here.

The suite turns compiling off (``tests/conftest.py``); this module turns it on for one
optimizer of the shipped single-worker rule on the golden tensors, with a kernel folder
of its own, so the session pays for one build. It checks that ``step()`` does not wait
for the build, that the kernel gives the recorded updates, that it continues a run
exactly where the reference left it, and that a later optimizer loads the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from golden import LR, STEP, golden_inputs
from test_golden import check_recorded

from learned_opt import LearnedOptimizer, kernel
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.kernel import COMPILE_AFTER, COMPILE_ENV, KERNEL_DIR_ENV, export, kernels
from learned_opt.kernel import worker as kernel_worker
from learned_opt.step import active_parts, moment_rows

#: generous: a cold build of the golden tensors takes tens of seconds on a loaded machine
COMPILE_TIMEOUT = 600
#: the tests that wait for a build may take that long (the suite's default is 300 s): a
#: build that took 5 minutes beside a running benchmark failed the fixture's setup
pytestmark = pytest.mark.timeout(COMPILE_TIMEOUT + 120)


#: A tall matrix that keeps its Gram polynomial between Newton-Schulz iterations under the
#: shipped rule (NetConfig.ns_every), stepped after the golden tensors: its kernel branches
#: on the step's count.
GRAM_SHAPE = (96, 64)


def _golden_optimizer():
    """The golden tensors, and a :data:`GRAM_SHAPE` matrix after them (``"gram"``; its
    ``STEP`` runs Newton-Schulz, so the polynomial it kept does not matter there)."""
    inputs = golden_inputs()
    gen = torch.Generator().manual_seed(2)
    inputs["gram"] = {
        "p": 0.05 * torch.randn(GRAM_SHAPE, generator=gen),
        "g": 1e-2 * torch.randn(GRAM_SHAPE, generator=gen),
        "m": 1e-2 * torch.randn((3, *GRAM_SHAPE), generator=gen),
        "v": 1e-4 * torch.rand(GRAM_SHAPE, generator=gen),
        "log_lr": torch.tensor(0.5),
    }
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
def compiled(tmp_path_factory):
    """An optimizer of the shipped rule whose kernel is built (in a folder of its own),
    and how its steps went."""
    mp = pytest.MonkeyPatch()
    mp.setenv(COMPILE_ENV, "1")
    mp.setenv(KERNEL_DIR_ENV, str(tmp_path_factory.mktemp("kernels")))
    mp.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)  # tiny tensors: compile them anyway
    mp.setattr(kernel, "CHILD_NICE", 0)  # on a busy test machine a niced child waits long
    builds, children = [], []  # the packages a child process built; the children started
    build = kernel_worker._Worker._build_in_child

    def counted(self, jobs, built=lambda i: None, recipe=None):
        children.append(len(jobs))
        build(self, jobs, lambda i: built(i) or builds.append(jobs[i][1]), recipe)

    mp.setattr(kernel_worker._Worker, "_build_in_child", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (conftest): a kernel is built per count
    try:
        inputs, params, opt = _golden_optimizer()
        for _ in range(COMPILE_AFTER):
            opt.step()
        queued_while_stepping = not opt.wait_compiled(timeout=0)
        ready = opt.wait_compiled(timeout=COMPILE_TIMEOUT)
        opt.builds, opt.children = builds, children
        torch.set_num_threads(threads)
        yield inputs, params, opt, queued_while_stepping, ready
    finally:
        torch.set_num_threads(threads)
        mp.undo()


def test_step_returns_before_the_kernel_is_compiled(compiled):
    *_, queued_while_stepping, ready = compiled
    assert queued_while_stepping, "step() waited for the compile"
    assert ready, "the kernel did not compile"


def test_a_child_process_built_each_kernel_into_the_kernel_folder(compiled):
    """The build runs in a child process (see ``_Worker._build_in_child``): traced in
    this one, it would stall the training thread. Its package is a private file."""
    _, _, opt, *_ = compiled
    assert len(opt.builds) == len(opt._kernels._entries) > 0
    assert opt.children == [len(opt.builds)]  # one child built every kind, in one start-up
    for path in opt.builds:
        assert path.parent == kernel.kernel_dir() and path.is_file()
        assert path.stat().st_mode & 0o022 == 0


def test_a_later_optimizer_loads_the_package_without_building(compiled, monkeypatch):
    """Another rank, or a later run of the same model, loads the package after
    ``COMPILE_AFTER`` steps, without waiting for ``COMPILE_AFTER_SECONDS``."""
    _, _, first, *_ = compiled
    builds = len(first.builds)
    _later_optimizer(first, monkeypatch)
    assert len(first.builds) == builds, "the package was built again"


def _later_optimizer(first, monkeypatch):
    """A new optimizer of the golden tensors, at one thread, that has loaded the packages
    ``first`` built (never building: no eager seconds are enough); its params and itself."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(first.builds[0].parent))
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, params, opt = _golden_optimizer()
        for _ in range(COMPILE_AFTER):
            opt.step()
        assert opt.wait_compiled(timeout=COMPILE_TIMEOUT)
    finally:
        torch.set_num_threads(threads)
    return params, opt


class _CallOnly:
    """A loaded package seen through its documented call alone (a torch whose package
    has no loader to run a flat list): counts its calls."""

    def __init__(self, runner):
        self.runner, self.calls = runner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.runner(*args)


def test_the_flat_call_steps_as_the_package_s_own_call(compiled, monkeypatch):
    """The kernel runs the package's loader on its flat inputs (no call spec parsed per
    step); where a package has no such loader, the step goes through the package's own
    call. Both give the same step, bitwise."""
    from torch._inductor import aoti_load_package

    inputs, params, opt, *_ = compiled
    loaded = []
    monkeypatch.setattr("torch._inductor.aoti_load_package",
                        lambda path: loaded.append(_CallOnly(aoti_load_package(path))) or loaded[-1])  # fmt: skip
    other_params, other = _later_optimizer(opt, monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _set_golden_state(opt, params, inputs)
        _set_golden_state(other, other_params, inputs)
        opt.step()
        other.step()
    finally:
        torch.set_num_threads(threads)
    stepped = sum(
        entry is not None for _, entry, _ in next(iter(other._kernels._plans.values())).tensors
    )
    assert loaded and sum(r.calls for r in loaded) == stepped, "the package's call was not used"
    for p, q in zip(params, other_params):
        assert torch.equal(p.detach(), q.detach())
        for key in kernel.STATE_KEYS:
            assert torch.equal(opt.state[p][key], other.state[q][key]), key


def _job_args(shape=(3,), dtype=torch.float32, cfg=None):
    """A step build's arguments for a tensor of ``shape`` and ``dtype`` (a flat kind, or a
    matrix under a config that orthogonalises)."""
    from learned_opt.config import NetConfig
    from learned_opt.step import Parts

    cfg = NetConfig() if cfg is None else cfg
    p = torch.zeros(shape, dtype=dtype)
    state = {"m": torch.zeros(3, *shape), "v": torch.zeros(shape), "log_lr": torch.zeros(()),
             "step": torch.zeros(())}  # fmt: skip
    kind = kernel.tensor_kind(cfg, p, p, state)
    return export.step_args({}, cfg, Parts(), kind, p, p.clone(), state)


@pytest.mark.parametrize(
    ("child", "why"),
    [("import sys; sys.exit('no compiler here')", "no compiler here"),
     (None, "cannot start a compile process")],
)  # fmt: skip
def test_a_child_that_fails_says_why_in_one_line(monkeypatch, tmp_path, child, why):
    """A child that exits with an error, or cannot start, raises a ``RuntimeError`` with
    its last line of error output (the worker turns it into one warning)."""
    if child is None:
        monkeypatch.setattr(kernel_worker.sys, "executable", "/nonexistent/python")
    else:
        monkeypatch.setattr(kernel, "_CHILD", child)
    worker = kernel_worker._Worker()
    with pytest.raises(RuntimeError, match=why):
        worker._build_in_child([(_job_args(), tmp_path / "k.pt2")])
    assert worker.child is None and not (tmp_path / "k.pt2").exists()


def test_a_child_hands_over_each_package_as_it_is_built(monkeypatch, tmp_path):
    """One child builds every queued kind in turn; each package is handed over (loaded)
    as it appears, and a later failure still says why."""
    monkeypatch.setenv(kernel.ISA_ENV, "0")  # one child: no second one that probes
    monkeypatch.setattr(kernel, "_CHILD", (
        "import sys, time, torch; job = torch.load(sys.argv[1], weights_only=True); "
        "open(job['builds'][0]['out'], 'wb').write(b'k'); time.sleep(1); "
        "sys.exit('the second kind failed')"
    ))  # fmt: skip
    worker, seen = kernel_worker._Worker(), []
    paths = [tmp_path / "first.pt2", tmp_path / "second.pt2"]
    with pytest.raises(RuntimeError, match="the second kind failed"):
        worker._build_in_child([(_job_args(), path) for path in paths], seen.append)
    assert seen == [0] and paths[0].is_file() and not paths[1].exists()


def test_a_child_that_fails_trusting_the_cpu_flags_is_followed_by_one_that_probes(
    monkeypatch, tmp_path
):
    """The child trusts the CPU's flags for inductor's vector instruction set; where it
    fails, a second child, which probes them, builds the packages the first left (each
    handed over once, by its index among all the builds). A value the user set stands:
    one child, its failure raised."""
    monkeypatch.delenv(kernel.ISA_ENV, raising=False)
    monkeypatch.setattr(kernel, "_CHILD", (
        "import os, sys, torch; job = torch.load(sys.argv[1], weights_only=True); "
        "open(os.path.join(os.path.dirname(job['builds'][0]['out']), 'log'), 'a')"
        f".write(repr(os.environ.get({kernel.ISA_ENV!r})) + ' '); "
        "outs = [b['out'] for b in job['builds']]; "
        f"trusted = os.environ.get({kernel.ISA_ENV!r}) == '1'; "
        "[open(o, 'wb').write(b'k') for o in (outs[:1] if trusted else outs)]; "
        "sys.exit('unknown flag -mamx-tile') if trusted else None"
    ))  # fmt: skip
    worker, seen = kernel_worker._Worker(), []
    paths = [tmp_path / "first.pt2", tmp_path / "second.pt2", tmp_path / "third.pt2"]
    worker._build_in_child([(_job_args(), path) for path in paths], seen.append)
    assert seen == [0, 1, 2] and all(path.is_file() for path in paths)
    assert (tmp_path / "log").read_text().split() == ["'1'", "None"]
    for path in paths:
        path.unlink()
    (tmp_path / "log").unlink()
    monkeypatch.setenv(kernel.ISA_ENV, "1")
    with pytest.raises(RuntimeError, match="unknown flag -mamx-tile"):
        worker._build_in_child([(_job_args(), path) for path in paths])
    assert (tmp_path / "log").read_text().split() == ["'1'"]


def test_loading_a_package_trusts_the_cpu_flags_unless_the_user_chose(monkeypatch):
    """A package's load asks inductor for the vector instruction set only to compare it
    with the package's: it trusts the CPU's flags there instead of compiling probes,
    unless the user set inductor's variable, and the setting is restored after. A torch
    without the option loads as inductor decides."""
    from torch._inductor import config

    before = config.cpp.vec_isa_ok
    monkeypatch.delenv(kernel.ISA_ENV, raising=False)
    with kernel_worker.cpu_flags_trusted():
        assert config.cpp.vec_isa_ok is True
    assert config.cpp.vec_isa_ok == before
    monkeypatch.setenv(kernel.ISA_ENV, "0")
    with kernel_worker.cpu_flags_trusted():
        assert config.cpp.vec_isa_ok == before
    monkeypatch.delenv(kernel.ISA_ENV)
    monkeypatch.setattr(kernel, "ISA_OPTION", ("cpp", "an_option_a_later_torch_dropped"))
    with kernel_worker.cpu_flags_trusted():  # no such option: the load goes on as inductor decides
        assert config.cpp.vec_isa_ok == before


def test_the_queued_kinds_are_built_by_one_child_and_loaded_each(monkeypatch, tmp_path):
    """The compile thread takes every queued job at once: the packages missing from the
    kernel folder are built by one child, the costliest kind first, and every entry is
    loaded and released."""
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    calls, loaded = [], []

    def build(self, jobs, built, recipe=None):
        calls.append([path.name for _, path in jobs])
        for i, (_, path) in enumerate(jobs):
            path.write_bytes(b"stand-in")
            built(i)

    monkeypatch.setattr(kernel_worker._Worker, "_build_in_child", build)
    monkeypatch.setattr(export, "load_package", lambda path: loaded.append(path.name) or len)
    args = [_job_args(), _job_args(dtype=torch.float64), _job_args(dtype=torch.bfloat16),
            _job_args((5,), torch.float64)]  # fmt: skip
    # 1 and 2: other dtypes, other packages; 3: another optimizer's tensor of another
    # size, the same package as 1
    kernel.package_path(args[0]).write_bytes(b"built before")  # found, not built
    worker, entries = kernel_worker._Worker(), [kernel_worker.Entry() for _ in args]
    entries[2].eager_seconds = 1.0  # the costliest in eager steps: built first
    for entry, a in zip(entries, args):
        worker.jobs.put((weakref.ref(entry), kernel.STEP, a))
    worker._run()  # on this thread: every job is queued before it looks
    names = [kernel.package_path(a).name for a in args]
    assert calls == [[names[2], names[1]]]  # each package built once
    assert loaded == [names[0], names[2], names[1], names[1]]
    assert all(e.done.is_set() and e.fn is len for e in entries) and worker.thread is None


def test_a_failed_build_warns_once_and_the_reference_keeps_stepping(monkeypatch, tmp_path):
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(kernel, "_CHILD", "import sys; sys.exit('no compiler here')")
    _, params, opt = _golden_optimizer()
    with pytest.warns(RuntimeWarning, match="no compiler here.*eager reference") as caught:
        for _ in range(COMPILE_AFTER):
            opt.step()
        assert not opt.wait_compiled(timeout=COMPILE_TIMEOUT)
        before = [p.detach().clone() for p in params]
        opt.step()
    assert len(caught) == len(opt._kernels._entries)
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, params))


def test_a_package_that_does_not_load_is_removed_for_the_next_run(monkeypatch, tmp_path):
    """A corrupt package (a full disk, a crash of another tool) warns once, the reference
    keeps stepping, and the file is removed, so that the next run builds it again."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a package")
    bad.chmod(0o600)
    monkeypatch.setattr(export, "package_path", lambda args: bad)
    param = torch.nn.Parameter(torch.randn(10))  # one kind: one package to load
    opt = LearnedOptimizer([param])
    with pytest.warns(RuntimeWarning, match="compiling the step kernel failed"):
        for _ in range(COMPILE_AFTER):
            param.grad = torch.randn(10)
            opt.step()
        assert not opt.wait_compiled(timeout=COMPILE_TIMEOUT)
    assert not bad.exists()


def _aged_packages(folder, count: int) -> list:
    """``count`` stand-in packages in ``folder``, the first the longest unused."""
    paths = []
    for i in range(count):
        path = folder / f"{i:03d}.pt2"
        path.write_bytes(b"stand-in")
        os.utime(path, (1e9 + i, 1e9 + i))
        paths.append(path)
    return paths


def test_pruning_keeps_the_most_recently_used_packages(tmp_path):
    old, *rest = _aged_packages(tmp_path, 5)
    (tmp_path / ".lock").write_bytes(b"")
    removed = kernel.prune_packages(tmp_path, keep=[old], limit=2)
    assert sorted(removed) == rest[:3]  # the longest unused; the one to keep counts
    assert sorted(tmp_path.glob("*.pt2")) == [old, rest[3]]
    assert (tmp_path / ".lock").exists()  # only packages are pruned


def test_a_new_build_prunes_the_longest_unused_packages(monkeypatch, tmp_path):
    """A build leaves at most KEEP_PACKAGES packages in the kernel folder; the new one
    stays, whatever its age."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)
    aged = _aged_packages(tmp_path, kernel.KEEP_PACKAGES)
    built = tmp_path / "new.pt2"

    def build(self, jobs, built, recipe=None):
        for i, (_, path) in enumerate(jobs):
            path.write_bytes(b"stand-in")
            os.utime(path, (1.0, 1.0))  # older than all: kept all the same
            built(i)

    monkeypatch.setattr(kernel_worker._Worker, "_build_in_child", build)
    monkeypatch.setattr(export, "package_path", lambda args: built)
    monkeypatch.setattr(export, "load_package", lambda path: kernel.step_tensors)
    _, _, opt = _golden_optimizer()
    for _ in range(COMPILE_AFTER):
        opt.step()
    assert opt.wait_compiled(timeout=COMPILE_TIMEOUT)
    left = set(tmp_path.glob("*.pt2"))
    assert len(left) == kernel.KEEP_PACKAGES and built in left and aged[0] not in left


def test_a_kernel_folder_others_may_write_is_refused(monkeypatch, tmp_path):
    """A package is a shared library this process would load: a folder or package that
    another user could have written is refused, with what to do."""
    if not hasattr(os, "getuid"):  # the check is a no-op there (see _check_private)
        pytest.skip("owner and mode checks are POSIX only")
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv(KERNEL_DIR_ENV, str(folder))
    with pytest.raises(PermissionError, match=f"not private.*{KERNEL_DIR_ENV}"):
        kernel.kernel_dir()
    package = tmp_path / "k.pt2"
    package.write_bytes(b"not a package")
    package.chmod(0o666)
    with pytest.raises(PermissionError, match="not private"):
        kernel.load_package(package)


def test_the_package_name_changes_with_what_the_kernel_depends_on(monkeypatch, tmp_path):
    """A package serves every tensor of its kind, whatever its size: its name changes with
    the dtypes, the kind, the config and the thread count, never with the sizes."""
    from learned_opt.config import NetConfig

    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    base = kernel.package_path(_job_args())
    assert base.parent == tmp_path
    assert kernel.package_path(_job_args((1000,))) == base
    assert kernel.package_path(_job_args((7, 3, 5))) == base  # any tensor that is not a matrix
    ortho = NetConfig(output="ortho", ortho_min_dim=4)
    wide = kernel.package_path(_job_args((8, 12), cfg=ortho))
    assert kernel.package_path(_job_args((20, 30), cfg=ortho)) == wide  # wide, no Gram path
    tall = kernel.package_path(_job_args((12, 8), cfg=ortho))
    gram = kernel.package_path(_job_args((8, 40), cfg=ortho))  # at least GRAM_RATIO wider
    doubled = kernel.package_path(_job_args(dtype=torch.float64))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other_threads = kernel.package_path(_job_args())
    finally:
        torch.set_num_threads(threads)
    names = {base, wide, tall, gram, doubled, other_threads}
    assert len(names) == 6


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
    assert "q" in opt.state[params[-1]], "the shipped rule keeps no polynomial for this matrix"
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(params, ref_params):
            g = 1e-2 * torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
    for p, q in zip(params, ref_params):  # a kept polynomial carries rounding to the next step
        atol = 1e-6 if "q" in opt.state[p] else 1e-7
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=atol)
        torch.testing.assert_close(opt.state[p]["v"], reference.state[q]["v"])
    kept, ref_kept = opt.state[params[-1]]["q"], reference.state[ref_params[-1]]["q"]
    torch.testing.assert_close(kept, ref_kept, rtol=1e-4, atol=1e-4 * float(ref_kept.abs().max()))


def _set_golden_state_fresh(opt, params, inputs) -> None:
    """:func:`_set_golden_state` on an optimizer that has not stepped: one step creates its
    state, which is then overwritten."""
    for p, t in zip(params, inputs.values()):
        p.grad = t["g"].clone()
    opt.step()
    _set_golden_state(opt, params, inputs)


def test_kernel_runs_inside_autocast_as_outside(compiled, monkeypatch):
    """A step inside an autocast region (a training loop's ``with autocast():`` that also
    holds ``opt.step()``) runs the kernel, and steps as it does outside the region."""
    inputs, params, opt, *_ = compiled
    monkeypatch.setenv(COMPILE_ENV, "1")
    entries = list(opt._kernels._entries.values())
    eager_steps = [e.eager_steps for e in entries]
    _set_golden_state(opt, params, inputs)
    opt.step()
    outside = [p.detach().clone() for p in params]
    _set_golden_state(opt, params, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt.step()
    assert [e.eager_steps for e in entries] == eager_steps, "a bucket ran the reference"
    for p, q in zip(params, outside):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


def test_another_thread_count_steps_eagerly_until_its_own_kernel(compiled, monkeypatch):
    """A kernel is built for one thread count (its loops are parallelised for it): a
    changed count is a new kind of bucket, stepped by the reference until its own
    kernel (none here), and the old kernel returns when the count does."""
    inputs, params, opt, *_ = compiled
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", float("inf"))
    kernels = opt._kernels
    compiled_kinds = dict(kernels._entries)
    threads = torch.get_num_threads()
    _set_golden_state(opt, params, inputs)
    try:
        torch.set_num_threads(threads + 1)
        opt.step()
        new = [e for k, e in kernels._entries.items() if k not in compiled_kinds]
        assert new and all(e.fn is None and e.eager_steps == 1 for e in new)
        torch.set_num_threads(threads)
        eager_steps = [e.eager_steps for e in compiled_kinds.values()]
        opt.step()
        assert [e.eager_steps for e in compiled_kinds.values()] == eager_steps
    finally:
        torch.set_num_threads(threads)
        kernels._entries = compiled_kinds


def test_compile_thread_exits_when_its_queue_is_empty(compiled):
    """Once the kernels are loaded, no compile thread is left (see
    :class:`learned_opt.worker._Worker`)."""
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


def test_a_script_that_ends_while_the_kernel_compiles_exits_cleanly(tmp_path):
    """A script that ends while its kernel is being built exits at once and quietly: the
    worker stops the child at exit, and leaves no half-written package."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop(COMPILE_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", EXIT_MID_COMPILE], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]
    assert "Warning" not in out.stderr and "terminate" not in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.glob("learned_opt_kernels/*")), "a package was left behind"


class _Submissions:
    """A stand-in for the compile worker that records which step queued a compile."""

    def __init__(self):
        self.at_step: list[int] = []
        self.step = 0

    def submit(self, entry, args, recipe=None):
        self.at_step.append(self.step)

    def busy(self) -> bool:
        return False


@pytest.fixture
def submissions(monkeypatch, tmp_path) -> _Submissions:
    """Compiling on, an empty kernel folder (no package built before), a stand-in worker,
    and a clock on which each eager step of a bucket takes 0.5 s."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    worker = _Submissions()
    monkeypatch.setattr(kernel_worker, "_worker", lambda: worker)
    ticks = iter(range(10**6))
    monkeypatch.setattr(kernels, "time", SimpleNamespace(perf_counter=lambda: 0.5 * next(ticks)))
    return worker


def test_a_compile_is_queued_once_the_eager_steps_took_compile_after_seconds(submissions):
    """A small model's short run never pays for a compile (the build slows the training
    thread while it runs): the compile is queued once the optimizer's eager steps have
    taken ``COMPILE_AFTER_SECONDS`` in all, and never twice."""
    worker = submissions
    _, _, opt = _golden_optimizer()
    default = kernel.COMPILE_AFTER_SECONDS
    with kernel.compile_after_seconds(2.0):
        for step in range(1, 9):
            worker.step = step
            opt.step()
    assert kernel.COMPILE_AFTER_SECONDS == default
    kinds = len(opt._kernels._entries)
    assert worker.at_step == [5] * kinds  # steps 1-4 took 2 s; the fifth queued each kind


def test_the_kinds_of_bucket_compile_together_on_the_optimizer_s_eager_seconds(submissions):
    """The threshold counts all the optimizer's eager steps: counted per kind, a model's
    small tensors would step eagerly for good, because their own share never reached it."""
    worker = submissions
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3).double())]
    opt = LearnedOptimizer(params)
    with kernel.compile_after_seconds(2.0):
        for step in range(1, 6):
            worker.step = step
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    assert len(opt._kernels._entries) == 2
    assert worker.at_step == [3, 3]  # two kinds: 1 s a step, so 2 s after step 2


def test_a_closed_worker_queues_nothing_and_releases_its_waiters():
    worker = kernel_worker._Worker()
    worker.close()
    entry = kernel_worker.Entry()
    worker.submit(entry, _job_args())
    assert entry.done.is_set() and worker.jobs.empty() and worker.thread is None


def test_a_compile_process_ends_when_its_parent_is_killed(tmp_path):
    """A training process killed without its exit handlers (``SIGKILL``) leaves no compile
    running for nobody: the child ends once its parent is gone."""
    if sys.platform == "win32":  # a Windows process keeps its dead parent's id
        pytest.skip("the watchdog reads the parent id, which changes on POSIX only")
    script = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import sys, time; "
        "from learned_opt.kernel import worker; worker._exit_with_parent(int(sys.argv[1]), 0.05); "
        "time.sleep(60)', str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)  # still there (or a zombie not yet reaped by init)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/stat") as stat:  # Linux: a zombie has ended
                if stat.read().split(")")[-1].split()[0] == "Z":
                    return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail("the compile process outlived its parent by 30 s")


def test_a_plan_is_kept_until_a_tensor_changes_layout():
    """Each tensor's kind and entry are worked out once per layout of the tensors; a
    gradient of other strides (a kernel takes contiguous tensors) is left to the reference,
    and going back finds the first plan again. Tensors of one kind share an entry."""
    _, params, opt = _golden_optimizer()
    opt.step()  # creates the state
    cache = kernel.Kernels()
    states = [opt.state[p] for p in params]
    grads = [p.grad for p in params]
    first = cache._plan(opt.config, opt.parts, params, grads, states)
    assert cache._plan(opt.config, opt.parts, params, grads, states) is first
    kinds = [kind for kind, _, _ in first.tensors]
    # 13 x 17, 13 x 17, 5 and a scalar: flat, one entry
    assert kinds[0] == kinds[1] == kinds[2] == kinds[3] and kinds[0][0] == "flat"
    assert first.tensors[0][1] is first.tensors[3][1]
    matrix = next(i for i, p in enumerate(params) if p.dim() == 2 and kinds[i][0] == "matrix")
    strided = list(grads)
    strided[matrix] = grads[matrix].t().contiguous().t()  # same values, other strides
    other = cache._plan(opt.config, opt.parts, params, strided, states)
    assert other.tensors[matrix][:2] == (None, None)
    assert cache._plan(opt.config, opt.parts, params, grads, states) is first


def test_a_cpu_training_yields_a_thread_to_a_build_and_takes_it_back(monkeypatch, tmp_path):
    """While a kernel builds, the training process steps with one thread fewer, so that the
    build has a core; its kernels stay keyed and built for the training's own count (no
    new kind of bucket meanwhile), and once they are loaded the count is restored."""
    import threading

    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)
    release, built_for = threading.Event(), []

    def build(self, jobs, built, recipe=None):
        built_for.extend([kernel.kernel_threads()] * len(jobs))
        release.wait(COMPILE_TIMEOUT)
        for i, (_, path) in enumerate(jobs):
            path.write_bytes(b"stand-in")
            built(i)

    monkeypatch.setattr(kernel_worker._Worker, "_build_in_child", build)
    monkeypatch.setattr(export, "load_package", lambda path: kernel.step_tensors)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, _, opt = _golden_optimizer()
        for _ in range(COMPILE_AFTER):  # the last one queues the builds
            opt.step()
        assert torch.get_num_threads() == 2
        opt.step()
        assert torch.get_num_threads() == 1 and kernel.kernel_threads() == 2
        kinds = set(opt._kernels._entries)
        opt.step()
        assert set(opt._kernels._entries) == kinds
        release.set()
        assert opt.wait_compiled(timeout=COMPILE_TIMEOUT)
        assert torch.get_num_threads() == 2 and kernel.kernel_threads() == 2
        assert len(built_for) == len(kinds) and set(built_for) == {2}
    finally:
        release.set()
        torch.set_num_threads(threads)


def test_a_thread_count_the_program_sets_while_a_build_runs_stands():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        kernel_worker._yield_threads(True)
        assert torch.get_num_threads() == 2 and kernel.kernel_threads() == 3
        kernel_worker._yield_threads(True)  # still building: yielded once, not twice
        assert torch.get_num_threads() == 2
        torch.set_num_threads(4)  # the program's own choice
        kernel_worker._yield_threads(False)
        assert torch.get_num_threads() == 4 and kernel.kernel_threads() == 4
        torch.set_num_threads(1)
        kernel_worker._yield_threads(True)  # one thread: nothing to yield
        assert torch.get_num_threads() == 1 and kernel.kernel_threads() == 1
    finally:
        kernel_worker._yield_threads(False)
        torch.set_num_threads(threads)


def test_the_tensors_without_a_kernel_step_in_one_reference_call(monkeypatch):
    """Before their kernels exist, a model's tensors (here 40 of one kind) step in one
    call of the reference, which packs across them, and each kind's share of that call's
    seconds (by its elements) adds up to the optimizer's."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", float("inf"))
    monkeypatch.setattr(kernels, "_is_built", lambda recipe, args: False)
    calls = []
    step = kernels.step_tensors
    monkeypatch.setattr(kernels, "step_tensors", lambda *a: calls.append(len(a[3])) or step(*a))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    opt = LearnedOptimizer(model.parameters())
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape)
        opt.step()
    entries = list(opt._kernels._entries.values())
    assert len(entries) == 1 and calls == [40, 40, 40]  # 8 x 8 is not orthogonalised
    assert all(e.eager_steps == 3 and e.fn is None and not e.queued for e in entries)
    shares = sum(e.eager_seconds for e in entries)
    assert shares == pytest.approx(opt._kernels.eager_seconds) and shares > 0


def test_a_kernel_takes_each_tensor_s_lr_and_decay_from_its_group(monkeypatch):
    """Param groups on one device and dtype share kernels: a kind whose kernel is ready
    runs it with each tensor's ``lr`` and decay from its group (one kernel for the usual
    decay and no-decay split); the tensors without one step in one reference call."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", float("inf"))
    monkeypatch.setattr(kernels, "_is_built", lambda recipe, args: False)
    calls = []
    step = kernels.step_tensors
    monkeypatch.setattr(
        kernels, "step_tensors", lambda *a: calls.append((len(a[3]), a[8] is not None)) or step(*a)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)], torch.nn.Linear(8, 1))
    matrices = [layer.weight for layer in model]
    vectors = [layer.bias for layer in model]
    opt = LearnedOptimizer(
        [{"params": matrices, "weight_decay": 0.1, "lr": 0.5}, {"params": vectors}]
    )

    def grads():
        for p in model.parameters():
            p.grad = torch.randn(p.shape)

    grads()
    opt.step()
    assert calls == [(10, True)]  # both groups, each tensor's decay handed over
    (flat,) = opt._kernels._entries.values()  # 8 x 8 is not orthogonalised: every tensor
    seen = []

    def fake(inputs, refresh=None):
        seen.append((inputs[-9].dim(), float(inputs[-3]), round(float(inputs[-2]), 6)))
        return torch.ones(1, dtype=torch.bool)

    flat.fn = fake
    grads()
    opt.step()
    assert seen == [(1, 0.5, 0.1)] * 5 + [(1, 1.0, 0.0)] * 5
    assert calls[1:] == []  # no reference call: the kernel stepped every tensor


#: A model whose tensors have none of the golden tensors' shapes, and their kinds: vectors
#: and a small tall matrix (flat and Newton-Schulz on the transpose) and a tall matrix that
#: keeps its Gram polynomial (two packages: iterating and not).
OTHER_SHAPES = ((40, 24), (40,), (100, 72), (100,), (3, 7, 2), ())


def test_a_new_model_of_other_shapes_loads_the_kernels_off_the_step(compiled, monkeypatch):
    """On a machine that has built the kernels once (the golden tensors' kinds), a model of
    other sizes queues them at its ``COMPILE_AFTER``-th step, without a build and without
    waiting for ``COMPILE_AFTER_SECONDS``; the worker thread loads them (a process's first
    load probes the CPU for 0.3-0.4 s, which no step waits for), and from then on every
    step runs kernels only, as the reference does."""
    import threading

    _, _, first, *_ = compiled
    builds = len(first.builds)
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(first.builds[0].parent))
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", float("inf"))
    loaded_on = []
    load = export.load_package  # what the step's recipe loads with, looked up per load
    monkeypatch.setattr(export, "load_package", lambda path: loaded_on.append(
        threading.current_thread().name) or load(path))  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(0.05 * torch.randn(s, generator=gen)) for s in OTHER_SHAPES]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = LearnedOptimizer(params, lr=LR)
    reference = LearnedOptimizer(ref_params, lr=LR, compile=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the count the kernels were built for
    try:
        for step in range(1, 8):
            if step == COMPILE_AFTER + 1:
                assert opt.wait_compiled(timeout=COMPILE_TIMEOUT)
                entries = list(opt._kernels._entries.values())
                assert len(entries) == 3 and all(e.fn is not None for e in entries)
                eager_steps = [e.eager_steps for e in entries]
            for p, q in zip(params, ref_params):
                p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
                q.grad = p.grad.clone()
            opt.step()
            reference.step()
    finally:
        torch.set_num_threads(threads)
    assert eager_steps == [COMPILE_AFTER] * 3
    assert [e.eager_steps for e in entries] == eager_steps, "a tensor ran the reference"
    assert len(first.builds) == builds, "a package was built for the new shapes"
    assert loaded_on == ["learned-opt-compile"] * 3  # the worker thread, not the step's
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        for key in ("m", "v"):
            torch.testing.assert_close(opt.state[p][key], reference.state[q][key])


def test_a_kernel_that_refuses_a_tensor_warns_once_and_its_kind_steps_the_reference(
    monkeypatch,
):
    """A size the kind's graph refuses (one of its runtime asserts: a path the kind missed)
    warns once; that kind's tensors then step the reference, and no step is lost."""
    import warnings

    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", float("inf"))
    monkeypatch.setattr(kernels, "_is_built", lambda recipe, args: False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = LearnedOptimizer(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn(p.shape)
    opt.step()
    (flat,) = opt._kernels._entries.values()

    def refuses(inputs, refresh=None):
        raise RuntimeError("Expected s17 < 3*s23 to be True but received 17")

    flat.fn = refuses
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="refused.*eager reference"):
        opt.step()
    assert flat.failed and not opt._kernels.ready()
    after = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        opt.step()
    for a, b, p in zip(before, after, model.parameters()):
        assert not torch.equal(a, b) and not torch.equal(b, p.detach())
