"""The kernel: the step of one tensor, exported with dynamic sizes and compiled ahead of time.

A tensor's kernel is :func:`~.eager._step_stacked` of that one tensor, exported by the public
``torch.export`` with its sizes as ``torch.export.Dim`` s and compiled by AOTInductor
(``torch._inductor.aoti_compile_and_package``, the documented entry) into a package that
steps a tensor of any size of its kind in place. The kind (:func:`tensor_kind`) holds what
the step's host code branches on, and nothing of the sizes:

- a *flat* tensor (every tensor that is not orthogonalised: vectors, convolution kernels,
  matrices outside ``[ortho_min_dim, ortho_max_dim]``, row-sparse tables) steps as a
  vector of ``n`` elements: one kind per dtypes, row-sparse mark and momenta kept;
- an orthogonalised *matrix* ``[r, c]`` takes Newton-Schulz, whose code picks a path by
  comparing ``r`` with ``c`` (a tall matrix iterates on its transpose, a wide one at least
  :data:`~learned_opt.orthogonal.GRAM_RATIO` times wider on its Gram matrix) and by its
  smaller side (the matrices that keep a Gram polynomial and take the Nesterov input).
  Those comparisons cannot be sizes of a ``Dim``: a kind holds their outcome (orientation,
  Gram path, wide-matrix mark), and the exported graph asserts them (``torch.export``'s
  deferred runtime asserts), so a matrix of another path is refused, never mis-stepped.
  A matrix that keeps its Gram polynomial has two packages, with and without a
  Newton-Schulz iteration at this step (:func:`~learned_opt.orthogonal.ns_due`, read on the
  host from its step count): the branch inside one graph (``torch.cond``) would capture the
  orientation as a symbolic bool, which ``torch.export`` cannot guard in torch 2.13.

The step's host code reads a layout's sizes as numbers in three places, which would fix a
``Dim`` to the example's size (or fail: a symbolic size cannot be hashed), so while it is
traced for a kernel (:class:`StepModule`, in the compile child only) they are replaced by
what holds for one tensor of symbolic size (:func:`_one_tensor_of_any_size`):
:func:`~learned_opt.segments.segment_sum` (``set(layout.numels)``) by its one-segment path,
a reshape; :func:`~learned_opt.features.shape_stats` (``math.log`` of the size) by an input
computed on the host by that same function (:func:`tensor_stats`); and
:func:`~learned_opt.orthogonal.shape_direction` (``int(numel)``, matrices grouped by shape)
by its path for one matrix. The golden tests check the kernel against the reference.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.export import Dim

from .. import orthogonal, segments
from .. import step as step_module
from ..config import NetConfig
from ..features import compute_dtype, shape_stats
from ..orthogonal import GRAM_RATIO, is_matrix, is_wide_matrix, ns_due
from ..step import Parts
from .cache import check_private, package_file, source_digest
from .eager import _step_stacked
from .worker import Recipe, kernel_threads, register

#: The state tensors of a tensor that a kernel reads and writes, in the order it takes them,
#: then ``q`` (a matrix's kept Gram polynomial) where the tensor has one.
STATE_KEYS = ("m", "v", "log_lr", "step")


def state_keys(state: dict) -> tuple[str, ...]:
    """The state tensors of ``state`` that a kernel takes, in order."""
    return STATE_KEYS + (("q",) if "q" in state else ())


def kernel_state(state: dict) -> dict:
    """What a kernel steps of a tensor's optimizer state: its :func:`state_keys` and its
    ``sparse_rows`` mark."""
    return {k: state[k] for k in state_keys(state)} | {
        "sparse_rows": bool(state.get("sparse_rows"))
    }


def theta_inputs(theta) -> list[Tensor]:
    """Theta's tensors in the order a kernel takes them: by sorted name."""
    return [theta[name].detach() for name in sorted(theta)]


def tensor_kind(cfg: NetConfig, p: Tensor, g: Tensor, state: dict) -> tuple | None:
    """The kind of kernel that steps ``p`` under ``cfg`` (see the module): ``("flat",
    dtypes, sparse_rows, momenta, device)`` or ``("matrix", dtypes, momenta, r <= c,
    keeps_q, wide_matrix, gram_path, device)``, plain values that name a package; None
    where the reference steps it (an empty tensor, one that is not contiguous)."""
    tensors = [p, g] + [state[k] for k in state_keys(state)]
    if not p.numel() or not all(t.is_contiguous() for t in tensors):
        return None
    dtypes = (p.dtype, g.dtype, state["v"].dtype)
    sparse = bool(state.get("sparse_rows"))
    rows = state["m"].shape[0]
    shape = tuple(p.shape)
    if sparse or not is_matrix(shape, cfg):
        return ("flat", *dtypes, sparse, rows, p.device.type)
    r, c = shape
    keeps = "q" in state
    gram = not keeps and max(r, c) >= GRAM_RATIO * min(r, c)
    wide = is_wide_matrix(shape, cfg)
    return ("matrix", *dtypes, rows, r <= c, keeps, wide, gram, p.device.type)


def refresh_of(cfg: NetConfig, kind: tuple, state: dict) -> bool | None:
    """Whether a matrix that keeps its Gram polynomial iterates at this step (its step
    count read on the host; see :func:`~learned_opt.orthogonal.ns_due`); None for the
    other kinds, whose package is one."""
    if kind[0] != "matrix" or not kind[6]:
        return None
    return ns_due(cfg, float(state["step"]) + 1)


def tensor_stats(cfg: NetConfig, p: Tensor, state: dict) -> Tensor:
    """The shape statistics of ``p`` (``[1, 4]``, :func:`~learned_opt.features.shape_stats`),
    which a kernel takes as an input."""
    matrix = is_matrix(tuple(p.shape), cfg) and not state.get("sparse_rows")
    like = p.new_empty((), dtype=compute_dtype(p))
    return shape_stats((tuple(p.shape),), cfg, like, (matrix,), (bool(state.get("sparse_rows")),))


def _plain(t: Tensor, shape) -> Tensor:
    """``t`` (contiguous) as ``shape`` with the strides of a fresh tensor: a leading dim of
    size 1 may carry any stride, which a kernel built for a fresh tensor's would misread."""
    return t.view(-1).view(shape)


def kernel_inputs(
    theta: list[Tensor], kind: tuple, p: Tensor, g: Tensor, state: dict, lr, decay, stats
) -> list[Tensor]:
    """The inputs of a kernel as one flat list: theta's tensors (:func:`theta_inputs`), the
    parameter, its gradient and its :func:`state_keys` (as a vector for a flat kind, as
    they are for a matrix), then ``lr``, ``decay`` (0-d) and ``stats``
    (:func:`tensor_stats`). A flat list is what the package's loader runs on, so that a call
    builds no nested structure and parses no call spec."""
    m = state["m"]
    if kind[0] == "flat":
        n = p.numel()
        tensors = [p.detach().view(n), g.view(n), _plain(m, (m.shape[0], n)), state["v"].view(n)]
    else:
        tensors = [p.detach(), g, _plain(m, m.shape), state["v"]]
    tensors += [state["log_lr"], state["step"]]
    if "q" in state:
        tensors.append(state["q"])
    return [*theta, *tensors, lr, decay, stats]


def _dynamic_shapes(count: int, kind: tuple, keys) -> list:
    """The ``dynamic_shapes`` of :func:`kernel_inputs` (``count`` theta tensors first):
    every size of the tensor a ``Dim``, the rest static."""
    if kind[0] == "flat":
        n = Dim("n", min=1)  # a scalar too: the traced step never branches on the size
        spec = [{0: n}, {0: n}, {1: n}, {0: n}]
    else:
        r, c = Dim("r", min=2), Dim("c", min=2)
        k = r if kind[5] else c  # a kept polynomial is square in the smaller side
        spec = [{0: r, 1: c}, {0: r, 1: c}, {1: r, 2: c}, {0: r, 1: c}]
    spec += [None, None] + ([{0: k, 1: k}] if "q" in keys else [])
    return [None] * count + spec + [None, None, None]


class StepModule(torch.nn.Module):
    """The step of one tensor of ``kind`` under one config and parts, as the module that is
    exported: a function of :func:`kernel_inputs`'s list (``names``: theta's sorted names;
    ``keys``: the tensor's :func:`state_keys`; ``refresh``: see :func:`refresh_of`).
    Its forward replaces a few functions of the step's modules while it runs
    (:func:`_one_tensor_of_any_size`): it is traced in the compile child, never called
    beside a training thread."""

    def __init__(self, cfg: NetConfig, parts: Parts, names, kind: tuple, keys, refresh=None):
        super().__init__()
        self.cfg, self.parts, self.names, self.kind = cfg, parts, list(names), kind
        self.keys, self.refresh = tuple(keys), refresh

    def forward(self, tensors: list[Tensor]) -> Tensor:
        k = len(self.names)
        theta = dict(zip(self.names, tensors[:k]))
        p, g = tensors[k], tensors[k + 1]
        state = dict(zip(self.keys, tensors[k + 2 : k + 2 + len(self.keys)]))
        state["sparse_rows"] = self.kind[0] == "flat" and self.kind[4]
        lr, decay, stats = tensors[-3:]
        with _one_tensor_of_any_size(stats, self.refresh):
            return _step_stacked(theta, self.cfg, self.parts, [p], [g], [state], lr, decay=decay)


@contextlib.contextmanager
def _one_tensor_of_any_size(stats: Tensor, refresh: bool | None):
    """Within: the step's code that reads a layout's sizes as numbers takes the path of one
    tensor instead (see the module): ``stats`` for its shape statistics, ``refresh`` for
    :func:`~learned_opt.orthogonal.ns_due`."""
    segment_sum = segments.segment_sum
    shape_direction = step_module.shape_direction

    def one_sum(x, layout, method=None):
        if method is None and len(layout.shapes) == 1:  # segment_sum's "padded", one segment
            return x.reshape(*x.shape[:-1], 1, -1).sum(-1)
        return segment_sum(x, layout, method)

    def one_direction(cfg, shapes, direction, m1, d, matrices, q=None, refresh=True, g=None,
                      direction_at=0):  # fmt: skip
        if len(shapes) != 1:
            return shape_direction(cfg, shapes, direction, m1, d, matrices, q, refresh, g,
                                   direction_at)  # fmt: skip
        if not matrices[0]:
            return (orthogonal.unit_rms(direction) if cfg.normalize else direction), q
        shape, m = shapes[0], m1  # shape_direction's path for a group of one matrix
        if g is not None and orthogonal.takes_nesterov(shape, cfg):
            m = torch.lerp(m, g, cfg.ortho_nesterov)
        z = orthogonal.ortho_input(m, m.square().mean(dim=-1, keepdim=True), d)
        kept = q.unsqueeze(0) if q is not None and orthogonal.reuses_gram(shape, cfg) else None
        outs, new = orthogonal.ortho_directions(cfg, [shape], z.unsqueeze(0), kept, refresh)
        return outs[0], (q if new is None else new[0])

    def due(cfg, step):
        return ns_due(cfg, step) if refresh is None else refresh

    saved = [(segments, "segment_sum", segment_sum)] + [
        (step_module, name, getattr(step_module, name))
        for name in ("segment_sum", "shape_stats", "shape_direction", "ns_due")
    ]
    segments.segment_sum = step_module.segment_sum = one_sum
    step_module.shape_stats = lambda shapes, cfg, like, matrices=None, tables=None: stats
    step_module.shape_direction, step_module.ns_due = one_direction, due
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def build_package(args: tuple, path: Path) -> None:
    """Export the step of the tensor of ``args`` (:func:`step_args`) with dynamic sizes and
    compile it into an AOTInductor package at ``path``; a matrix that keeps its Gram
    polynomial gets a second package, without the iteration (:func:`reuse_path`), written
    first."""
    theta, cfg, parts, kind, _, p, g, state = args
    if kind[0] == "flat":  # traced on 8 elements: an example of 1 would fix the size at 1
        p, g = p.new_zeros(8), g.new_zeros(8)
        state = {k: t.new_zeros(t.shape[:1] + (8,)) if k == "m" else t.new_zeros(8)
                 if k == "v" else t for k, t in state.items()}  # fmt: skip
    keys = state_keys(state)
    dtype = state["v"].dtype
    lr, decay = torch.ones((), dtype=dtype), torch.zeros((), dtype=dtype)
    stats = torch.zeros(1, 4, dtype=compute_dtype(p))
    inputs = kernel_inputs(theta_inputs(theta), kind, p, g, state, lr, decay, stats)
    dynamic = _dynamic_shapes(len(theta), kind, keys)
    phases = [(reuse_path(path), False), (path, True)] if "q" in keys else [(path, None)]
    with torch.no_grad(), torch.autocast(p.device.type, enabled=False):
        for out, refresh in phases:
            module = StepModule(cfg, parts, sorted(theta), kind, keys, refresh)
            export_package(module, inputs, out, dynamic)


def reuse_path(path: Path) -> Path:
    """The package beside ``path`` of a matrix's step without a Newton-Schulz iteration."""
    return path.with_name(f"{path.stem}-reuse{path.suffix}")


def export_package(
    module: torch.nn.Module, inputs: list[Tensor], path: Path, dynamic_shapes=None
) -> None:
    """Export ``module``, a function of one flat list of tensors, for ``inputs``
    (``torch.export``; ``dynamic_shapes``: the list's, None for all static, where the shape
    guards the code takes become runtime asserts) and compile it ahead of time into an
    AOTInductor package at ``path`` (written under another name, then renamed, so that no
    reader sees half of it)."""
    dynamic = None if dynamic_shapes is None else (dynamic_shapes,)
    program = torch.export.export(
        module, (inputs,), dynamic_shapes=dynamic,
        prefer_deferred_runtime_asserts_over_guards=dynamic is not None,
    )  # fmt: skip
    partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
    try:
        from torch._inductor import aoti_compile_and_package  # the documented AOT entry

        aoti_compile_and_package(program, package_path=str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_runner(path: Path) -> Callable[[list[Tensor]], list[Tensor]]:
    """The function of a package built by :func:`export_package`: its flat list of
    input tensors to its list of outputs. Loading maps its shared library into this
    process: the package must be this user's and not writable by others
    (:func:`~.cache.kernel_dir`). A package of this user's that does not load (written by a
    full disk, say) is removed before the error is raised, so that the next run builds it
    again."""
    from torch._inductor import aoti_load_package

    from .worker import cpu_flags_trusted

    check_private(path)
    try:
        with cpu_flags_trusted():  # the load only compares the ISA with the package's
            runner = aoti_load_package(str(path))
    except Exception:
        path.unlink(missing_ok=True)
        raise
    os.utime(path)  # marks it used: prune_packages removes the longest unused first
    # The package's own __call__ parses its call spec (JSON) and flattens its arguments on
    # every call: 0.04-0.06 ms, 15-20% of a small model's kernel call. The loader it then
    # runs takes the flat list itself; where a torch has no such loader, the call goes
    # through __call__ (the same list, the same result).
    run = getattr(getattr(runner, "loader", None), "boxed_run", None)
    if run is None:
        return lambda flat: [runner(flat)]
    return run


def load_package(path: Path) -> Callable:
    """The kernel of a package built by :func:`build_package`: a function of
    :func:`kernel_inputs`'s list and :func:`refresh_of` to the tensor's stepped flag
    (``[1]``). A matrix's second package (:func:`reuse_path`) is loaded with it."""
    runs = {None: load_runner(path)}
    runs[True] = runs[None]
    if reuse_path(path).is_file():
        try:
            runs[False] = load_runner(reuse_path(path))
        except Exception:
            path.unlink(missing_ok=True)  # built again, with its second package
            raise

    def kernel(inputs: list[Tensor], refresh: bool | None = None) -> Tensor:
        return runs[refresh](inputs)[0]

    return kernel


def step_args(theta, cfg: NetConfig, parts: Parts, kind: tuple, p, g, state) -> tuple:
    """The arguments of a kind's build (the step :class:`~.worker.Recipe`'s): theta, the
    config without weight decay, parts, the kind, the thread count, and a tensor of the
    kind with its :func:`kernel_state`, to trace on."""
    return theta, cfg, parts, kind, kernel_threads(), p.detach(), g, kernel_state(state)


def package_path(args: tuple) -> Path:
    """The file of the package of the kind of ``args`` (:func:`step_args`): its name hashes
    all the kernel depends on (torch's version, this package's source, the config, parts,
    theta's names, dtypes and shapes, the kind, the state tensors it takes and the thread
    count its loops are parallelised for), and none of the tensor's sizes."""
    theta, cfg, parts, kind, threads, _, _, state = args
    key = (
        sorted(cfg.to_dict().items()), tuple(parts),
        [(k, t.dtype, tuple(t.shape)) for k, t in sorted(theta.items())], kind,
        state_keys(state), threads,
    )  # fmt: skip
    return package_file(key, source_digest(Path(__file__).parent.parent))


def _copy_step(args: tuple) -> tuple:
    theta, cfg, parts, kind, threads, p, g, state = args
    state = {k: t.clone() if isinstance(t, Tensor) else t for k, t in state.items()}
    return theta, cfg, parts, kind, threads, p.detach().clone(), g.detach().clone(), state


def _step_payload(args: tuple) -> dict:
    theta, cfg, parts, kind, threads, p, g, state = args
    return {"theta": dict(theta), "cfg": cfg.to_dict(), "parts": list(parts), "kind": kind,
            "threads": threads, "p": p, "g": g, "state": state}  # fmt: skip


def _build_step(build: dict, path: Path) -> None:
    args = (
        build["theta"], NetConfig.from_dict(build["cfg"]), Parts(*build["parts"]),
        tuple(build["kind"]), build["threads"], build["p"], build["g"], build["state"],
    )  # fmt: skip
    build_package(args, path)


#: The step's kernels (the module's functions, looked up when called).
STEP = register(Recipe(
    "step", __package__, ("the step kernel", "this kind of tensor keeps the eager reference step"),
    lambda args: _copy_step(args), lambda args: _step_payload(args),
    lambda build, path: _build_step(build, path), lambda args: package_path(args),
    lambda path: load_package(path),
))  # fmt: skip
