"""The compiled path of the learned step: one kernel per kind of tensor, built once per machine.

:func:`step_tensors` steps a list of tensors in place with :func:`learned_opt.step.tensor_step`,
the differentiable reference (:mod:`.eager`). Exported by the public ``torch.export`` with
dynamic sizes (``torch.export.Dim``) and compiled ahead of time by AOTInductor, the step of
one tensor is the kernel (:mod:`.export`): one package per rule, dtypes and kind of tensor
(a flat tensor, or a matrix of one orientation and Newton-Schulz path) serves every model
on the machine, whatever its shapes. Kernels are built for CPU tensors only
(:data:`KERNEL_DEVICES`): on a GPU the reference steps.

``step()`` never waits for a compile (:mod:`.kernels`). The first steps of a kind run the
reference; once the optimizer's eager steps have taken :data:`COMPILE_AFTER_SECONDS` in all
(and the kind has stepped at least :data:`COMPILE_AFTER` times) a process-wide worker thread
has the packages built by a child process at low priority (:mod:`.worker`), loads each as it
appears, and the steps after that run its kernel. A kind whose package is on disk already
(this machine built it for another model, another rank, an earlier run) is loaded by the
worker thread from its :data:`COMPILE_AFTER`-th step on, while the reference steps. If
building fails, one warning says why and the reference keeps stepping that kind. While a
build (or a load) runs, a CPU training process steps and trains with one thread fewer
(:data:`YIELD_THREADS`), so that the child has a core.

A package is built once per host and user (:mod:`.cache`): the worker holds a file lock while
it builds, so the other ranks of a ``torchrun`` job wait (stepping eagerly meanwhile) and then
load the same file. Its name hashes all the kernel depends on (:func:`package_path`): new code
or another torch builds another; other shapes do not.

The settings below are read where they are used, at each use: a program or a test sets them
here (``learned_opt.kernel.COMPILE_AFTER_SECONDS = 0``).
"""

from __future__ import annotations

import contextlib

#: A kind of tensor is compiled once it has stepped eagerly at least this many times, and
#: the optimizer's eager steps have taken :data:`COMPILE_AFTER_SECONDS` in all: a
#: short-lived optimizer (a quick check, a two-step test) never pays for a compile it would
#: not use. A kind whose package is on disk is loaded from this step on.
COMPILE_AFTER = 3
#: The eager seconds an optimizer steps for before its kinds of tensor are compiled (all
#: its kinds together). A compile takes tens of seconds of a core and slows the training
#: thread meanwhile, so a run whose whole eager optimizer cost is a few seconds finishes
#: sooner without a kernel, and a model whose eager step is slow reaches the threshold in a
#: few steps. Chosen on the validation family by ``benchmarks/wallclock.py`` (compile-included
#: wall clock: median 0.69x tuned AdamW at 10 s, 0.64x at 2 s; docs: *Results*).
COMPILE_AFTER_SECONDS = 10.0
#: Environment variable that turns compiling off (``0``): every step runs the reference.
COMPILE_ENV = "LEARNED_OPT_COMPILE"
#: Environment variable naming the folder of the compiled kernels (see :func:`kernel_dir`).
KERNEL_DIR_ENV = "LEARNED_OPT_KERNEL_DIR"
#: The devices whose tensors step through compiled kernels; others step the reference.
#: Not CUDA: on an H200 with torch 2.11.0+cu130, loading any CUDA AOTInductor package (a
#: one-line ``x * 2 + 1`` too, on the main thread or another) ended the process with a
#: segmentation fault inside ``aoti_load_package``, where an error or the reference was
#: owed (``benchmarks/results/cuda_check.json``).
KERNEL_DEVICES = frozenset({"cpu"})

#: On CPU outside compiling, the tensors of at most this many elements are stepped
#: together, as the segments of one flat vector (:func:`~learned_opt.step.flat_step`): each
#: eager call costs about 170 torch ops whatever the tensor's size, which is most of a
#: bias's or a small matrix's step, while packing costs a copy of each parameter and
#: gradient in and of each parameter out (the state stays flat between steps: see
#: :class:`.eager._Pack`) and gathers over the packed elements. Chosen at 65536 on the
#: validation family's models (2026-12-06, against 16384, ``eager_step.py --tasks``, in
#: git at ``c2adf13``:
#: attention's step 11% shorter, the LSTM language model's 3%, the 256-wide MLP's 4%, the
#: larger LSTM's 4% longer; the 0.4M transformer's 7% shorter).
PACK_NUMEL = 65536
#: At most this many packs' flat state is kept per optimizer (:class:`.eager._Pack`).
MAX_PACKS = 16
#: At most this many plans (the kinds of a set of tensors) are kept per optimizer.
MAX_PLANS = 16

#: While a kernel builds, a CPU training process steps and trains with this many fewer
#: intra-op threads (never fewer than one), so that the build, a child process at low
#: priority, has a core of its own instead of the slices the training threads leave it.
#: Measured on 2 cores, training the 0.5M transformer at 2 threads from an empty cache
#: (``benchmarks/build_race.py``, in git at ``c2adf13``): the kernel was ready after 81 s instead of not within
#: the 300 s of the run; training did 3% fewer steps in the first minute and 26% more by
#: 300 s. A training at one thread has none to yield.
YIELD_THREADS = 1
#: Seconds a child process may compile one package before it is stopped (the reference
#: then keeps stepping that kind).
CHILD_COMPILE_TIMEOUT = 1800
#: How often the compile thread looks for the next package of its child (seconds).
BUILT_POLL_SECONDS = 0.2
#: Seconds the compile thread waits for more jobs before it takes the queue: the kinds of
#: one step (and of an optimizer's other dtypes) are queued within it, and one child builds
#: them all.
GATHER_SECONDS = 0.5
#: The child's niceness: the training process keeps the cores it needs, and the child
#: builds on the one it yields (:data:`YIELD_THREADS`). Without that, on 2 cores busy with
#: training at 2 threads the 0.5M transformer's kernel was ready after 1023 s; at niceness
#: 0 after 158 s, but training ran at 0.4-0.6 times its speed while gcc compiled.
CHILD_NICE = 10
#: The child's program (:meth:`.worker._Worker._build_in_child`).
_CHILD = "import sys; from learned_opt.kernel import compile_job; compile_job(sys.argv[1])"
#: Inductor's environment variable that, at ``1``, trusts the CPU's flags for the vector
#: instruction set of its kernels instead of compiling a probe for each (9 s of a build on
#: an empty cache, about 1 s on a warm one).
ISA_ENV = "TORCHINDUCTOR_VEC_ISA_OK"
#: The inductor option that :data:`ISA_ENV` sets, as ``(section, name)``.
ISA_OPTION = ("cpp", "vec_isa_ok")
#: The most packages :func:`prune_packages` leaves in the kernel folder: a new build
#: removes the longest unused beyond it. A rule needs a few (a kind of tensor each, see
#: :mod:`.export`), whatever the models it steps; other torch versions and source revisions
#: build their own.
KEEP_PACKAGES = 64


@contextlib.contextmanager
def compile_after_seconds(seconds: float):
    """Within the block, queue compiles once an optimizer has stepped eagerly for
    ``seconds`` (:data:`COMPILE_AFTER_SECONDS` again after it): ``0`` for a benchmark or
    test that times or checks the kernel itself after :data:`COMPILE_AFTER` steps."""
    global COMPILE_AFTER_SECONDS
    previous, COMPILE_AFTER_SECONDS = COMPILE_AFTER_SECONDS, float(seconds)
    try:
        yield
    finally:
        COMPILE_AFTER_SECONDS = previous


from .cache import kernel_dir, package_file, prune_packages, source_digest  # noqa: E402
from .eager import step_tensors  # noqa: E402
from .export import (  # noqa: E402
    STATE_KEYS,
    STEP,
    StepModule,
    build_package,
    export_package,
    kernel_inputs,
    kernel_state,
    load_package,
    load_runner,
    package_path,
    state_keys,
    tensor_kind,
    theta_inputs,
)  # fmt: skip
from .kernels import Group, KernelCache, Kernels, compiling_enabled  # noqa: E402
from .worker import Recipe, compile_job, kernel_threads, register  # noqa: E402

__all__ = [
    "COMPILE_AFTER", "COMPILE_AFTER_SECONDS", "COMPILE_ENV", "ISA_ENV", "KERNEL_DEVICES",
    "KERNEL_DIR_ENV", "STATE_KEYS", "STEP", "YIELD_THREADS", "Group", "KernelCache", "Kernels",
    "Recipe", "StepModule", "build_package", "compile_after_seconds", "compile_job",
    "compiling_enabled", "export_package", "kernel_dir", "kernel_inputs", "kernel_state",
    "kernel_threads", "load_package", "load_runner", "package_file", "package_path",
    "prune_packages", "register", "source_digest", "state_keys", "step_tensors", "tensor_kind",
    "theta_inputs",
]  # fmt: skip
