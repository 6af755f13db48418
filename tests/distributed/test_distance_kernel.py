"""Robust mixing's compiled distances (``learned_opt.distributed.distance_kernel``).

The suite turns compiling off (``tests/conftest.py``); these tests turn it on with a
kernel folder of their own. One builds a real package (about 10-20 s of a core), the
others stand in for the compile worker.
"""

from __future__ import annotations

import weakref

import dist_workers as w  # tests/distributed is on sys.path under pytest
import pytest
import torch

from learned_opt import kernel
from learned_opt.config import NetConfig
from learned_opt.distributed import distance_kernel, get_topology, launch_local
from learned_opt.distributed.distance_kernel import DISTANCES, Distances
from learned_opt.distributed.mixing import distance_lists, mix
from learned_opt.kernel import COMPILE_AFTER, COMPILE_ENV, KERNEL_DIR_ENV, export
from learned_opt.kernel import worker as kernel_worker
from learned_opt.step import Parts

COMPILE_TIMEOUT = 600  # a cold build on a loaded machine


@pytest.fixture
def compiling(monkeypatch, tmp_path):
    """Compiling on, into a kernel folder of the test's own, due at once."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(kernel, "CHILD_NICE", 0)  # a busy test machine: no waiting child
    return tmp_path


def _tensors(seed: int = 0, neighbours: int = 2, state_dtype=torch.bfloat16):
    """A rank's tensors (two parameters, a float32 moment, a float64 one) and its
    neighbours' copies, as an exchange unpacks them: views into one byte buffer per
    neighbour, the float32 moment received in ``state_dtype``."""
    gen = torch.Generator().manual_seed(seed)
    xs = [
        torch.randn(64, 48, generator=gen),
        torch.randn(48, generator=gen),
        torch.rand(64, 48, generator=gen),
        torch.randn(5, dtype=torch.float64, generator=gen),
    ]
    wire = [torch.float32, torch.float32, state_dtype, torch.float64]
    neighbour_xs = [[] for _ in xs]
    for _ in range(neighbours):
        copies = [(x + 0.01 * torch.randn(x.shape, generator=gen, dtype=x.dtype)).to(w)
                  for x, w in zip(xs, wire)]  # fmt: skip
        buffer = torch.cat([c.reshape(-1).view(torch.uint8) for c in copies])
        at = 0
        for t, c in enumerate(copies):
            size = c.numel() * c.element_size()
            neighbour_xs[t].append(buffer[at : at + size].view(c.dtype).view(c.shape))
            at += size
    return xs, neighbour_xs


@pytest.mark.timeout(COMPILE_TIMEOUT + 60)
def test_the_compiled_distances_are_the_eager_ones(compiling):
    """Built in a child process, loaded without waiting, then the same distances as
    :func:`distance_lists` (float32 rounding), a bfloat16 neighbour and a float64 tensor
    included; a neighbour's NaN or Inf makes its distance non-finite, as eagerly. A
    second communicator's kernels load the package at once (built on this host)."""
    xs, nbs = _tensors()
    distances = Distances()
    for _ in range(COMPILE_AFTER):  # eager meanwhile: the reference values
        assert torch.equal(distances(xs, nbs), distance_lists(xs, nbs))
    assert distances.wait(timeout=COMPILE_TIMEOUT), "the distance kernel was not built"
    for seed in (0, 1):  # new values through the same kernel
        xs, nbs = _tensors(seed)
        got, want = distances(xs, nbs), distance_lists(xs, nbs)
        assert got.shape == want.shape == (2, len(xs))
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-6)
    nbs[0][1][3, 3] = float("nan")
    nbs[2][0][0, 0] = float("inf")
    got = distances(xs, nbs)
    assert torch.isfinite(got).tolist() == [[True, True, False, True], [False] + [True] * 3]
    assert len(list(compiling.glob("*.pt2"))) == 1
    again = Distances()
    for _ in range(COMPILE_AFTER):
        again(xs, nbs)
    assert again._entries and all(e.built for e in again._entries.values())
    assert again.wait(timeout=COMPILE_TIMEOUT)


class _Recorder:
    """A stand-in compile worker: records what was queued, with which recipe."""

    def __init__(self):
        self.queued: list = []

    def submit(self, entry, args, recipe=None):
        self.queued.append((recipe, args))

    def busy(self) -> bool:
        return False


def test_the_distances_compile_once_their_eager_calls_took_long_enough(compiling, monkeypatch):
    """Queued with the distances' recipe once a kind has run :data:`COMPILE_AFTER` times
    and the communicator's eager distances have taken ``COMPILE_AFTER_SECONDS``; each
    kind (here: another number of neighbours) on its own; never where compiling is off."""
    recorder = _Recorder()
    monkeypatch.setattr(kernel_worker, "_worker", lambda: recorder)
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 3600.0)
    xs, nbs = _tensors()
    distances = Distances()
    for _ in range(COMPILE_AFTER + 2):
        distances(xs, nbs)
    assert recorder.queued == [] and distances.eager_seconds > 0
    monkeypatch.setattr(kernel, "COMPILE_AFTER_SECONDS", 0.0)
    distances(xs, nbs)
    assert [recipe for recipe, _ in recorder.queued] == [DISTANCES]
    assert recorder.queued[0][1][0] is xs
    _, three = _tensors(neighbours=3)
    for _ in range(COMPILE_AFTER):
        distances(xs, three)
    assert len(recorder.queued) == 2 and len(distances._entries) == 2
    monkeypatch.setenv(COMPILE_ENV, "0")
    off = Distances()
    for _ in range(COMPILE_AFTER + 1):
        off(xs, nbs)
    assert len(recorder.queued) == 2 and not off._entries


def test_a_failed_distance_build_warns_and_the_eager_distances_go_on(compiling, monkeypatch):
    monkeypatch.setattr(kernel, "_CHILD", "import sys; sys.exit('no compiler here')")
    xs, nbs = _tensors()
    distances = Distances()
    with pytest.warns(RuntimeWarning, match="robust mixing's distances failed.*no compiler"):
        for _ in range(COMPILE_AFTER):
            distances(xs, nbs)
        assert not distances.wait(timeout=COMPILE_TIMEOUT)
    assert torch.equal(distances(xs, nbs), distance_lists(xs, nbs))


def _queue_of_both(folder, monkeypatch):
    """A worker with a step job and a distances job queued, and their two entries (the
    step's package named in ``folder``)."""
    p = torch.zeros(3)
    state = {"m": torch.zeros(1, 3), "v": torch.zeros(3), "log_lr": torch.zeros(()),
             "step": torch.zeros(())}  # fmt: skip
    cfg, parts = NetConfig(), Parts()
    step_args = export.step_args({}, cfg, parts, kernel.tensor_kind(cfg, p, p, state), p, p, state)
    monkeypatch.setattr(export, "package_path", lambda args: folder / "step.pt2")
    worker, entries = kernel_worker._Worker(), [kernel_worker.Entry(), kernel_worker.Entry()]
    worker.jobs.put((weakref.ref(entries[0]), kernel.STEP, step_args))
    worker.jobs.put((weakref.ref(entries[1]), DISTANCES, _tensors()))
    return worker, entries


def test_one_queue_of_steps_and_distances_builds_each_recipe_in_a_child_of_its_own(
    compiling, monkeypatch
):
    """The step's kernels and the distances' share the worker: queued together, each
    recipe's packages are built by one child that imports its module, and loaded by
    that recipe."""
    children = []

    def build(self, jobs, built, recipe=None):
        children.append(recipe.name)
        for i, (_, path) in enumerate(jobs):
            path.write_bytes(b"stand-in")
            built(i)

    monkeypatch.setattr(kernel_worker._Worker, "_build_in_child", build)
    monkeypatch.setattr(export, "load_package", lambda path: "step kernel")
    monkeypatch.setattr(distance_kernel, "load_runner", lambda path: lambda flat: ["ran"])
    worker, entries = _queue_of_both(compiling, monkeypatch)
    worker._run()  # on this thread: both are queued before it looks
    assert sorted(children) == ["distances", "step"]
    assert entries[0].fn == "step kernel" and entries[1].fn(*_tensors()) == "ran"


def test_a_recipe_whose_child_fails_leaves_the_other_recipes_builds(compiling, monkeypatch):
    """One recipe's failed child warns for its own entries only: the other recipe's
    package, queued together, is still built and loaded."""

    def build(self, jobs, built, recipe=None):
        if recipe.name == "step":
            raise RuntimeError("the compile process failed: no compiler here")
        for i, (_, path) in enumerate(jobs):
            path.write_bytes(b"stand-in")
            built(i)

    monkeypatch.setattr(kernel_worker._Worker, "_build_in_child", build)
    monkeypatch.setattr(distance_kernel, "load_runner", lambda path: lambda flat: ["ran"])
    worker, entries = _queue_of_both(compiling, monkeypatch)
    with pytest.warns(RuntimeWarning, match="compiling the step kernel failed") as caught:
        worker._run()
    assert len(caught) == 1
    assert entries[0].fn is None and entries[1].fn(*_tensors()) == "ran"


def test_the_child_builds_only_learned_opt_modules(tmp_path):
    """A job naming a module outside the package is refused before anything is
    imported."""
    job = {"builds": [], "recipe": "step", "module": "os", "threads": 1, "nice": 0,
           "parent": -1}  # fmt: skip
    path = tmp_path / "job.pt"
    torch.save(job, path)
    with pytest.raises(ValueError, match="not a learned_opt module"):
        kernel.compile_job(str(path))


@pytest.mark.timeout(COMPILE_TIMEOUT + 180)
def test_real_ranks_mix_robustly_through_the_compiled_distances(tmp_path):
    """Three gloo ranks on a ring with compiling on: once the kernel is built (by one of
    them, the others load it), rank 1's 1e6 is clipped as the eager mix clips it, and its
    NaN under a forged finite flag is left out."""
    n = 3
    results = launch_local(
        w.compiled_robust_mix, n, str(tmp_path), timeout=COMPILE_TIMEOUT + 120,
        pg_timeout=w.STARTUP,
    )  # fmt: skip
    topo = get_topology("ring", n)
    for rank, res in enumerate(results):
        assert res["built"], f"rank {rank}: the distances' kernel was not built"
        peers = topo.neighbors(rank, 0)
        weights = [topo.weight(rank, j, 0, "metropolis") for j in peers]
        payloads = [w.robust_payload(j) for j in peers]
        expect = mix(w.robust_payload(rank), payloads, weights, robust="clip")
        assert res["mixed"] == pytest.approx(expect.tolist(), rel=1e-5)
        if rank != 1:
            assert max(res["mixed"]) < 4 and res["forged_excluded"] == [1]
            honest = [k for k, j in enumerate(peers) if j != 1]
            expect = mix(
                w.robust_payload(rank), [payloads[k] for k in honest],
                [weights[k] for k in honest], robust="clip",
            )  # fmt: skip
            assert res["forged"] == pytest.approx(expect.tolist(), rel=1e-5)
    assert len(list(tmp_path.glob("*.pt2"))) == 1  # one build for the host
