"""The passes of the fused step (:mod:`learned_opt._passes`), compiled once per network
config (:func:`compiled_for`) and called with little overhead (:class:`CompiledPass`)."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ._passes import (
    direction_tensor_,
    tensor_sums,
    tensor_tables,
    update_packed_,
    update_tensor_,
)
from .config import NetConfig

_lock = threading.Lock()
_compiled: dict[NetConfig, Passes] = {}


#: Inductor options: kernels run on the calling thread (no OpenMP team whose barriers
#: would wait for a core that another process holds), and multiply-adds contract to FMAs.
COMPILE_OPTIONS = {"cpp.threads": 1, "cpp.enable_floating_point_contract_flag": "fast"}


def compiled_for(cfg: NetConfig):
    """The passes compiled for ``cfg`` (built once per config, dynamic sizes): the reduction
    and update passes of one tensor, the update pass on an OpenMP team, the reduction
    and update passes of packed small tensors, and the direction pass of an "ortho" matrix
    (on the calling thread and on a team). A pass is compiled on its first call."""
    with _lock:
        if cfg not in _compiled:

            def sums(p, g, m0, m1, m2, v, _cfg=cfg):
                return tensor_sums(p, g, m0, m1, m2, v, _cfg)

            def tables(theta, sums, stats, log_lr, numel, step, lr, _cfg=cfg):
                return tensor_tables(theta, sums, stats, log_lr, numel, step, lr, _cfg)

            def update(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg=cfg):
                update_tensor_(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg)

            def update_threaded(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg=cfg):
                update_tensor_(layers, p, g, m0, m1, m2, v, g_rms, scale, step, _cfg)

            def sums_packed(p, g, m0, m1, m2, v, seg, sizes, _cfg=cfg):
                return tensor_sums(p, g, m0, m1, m2, v, _cfg, seg, sizes)

            def update_packed(layers, p, g, m0, m1, m2, v, seg, g_rms, scale, scales, ok, step,
                              _cfg=cfg):  # fmt: skip
                update_packed_(layers, p, g, m0, m1, m2, v, seg, g_rms, scale, scales, ok, step,
                               _cfg)  # fmt: skip

            def direction(layers, p, g, m0, m1, m2, v, g_rms, scale, m1_ms, z, mag, _cfg=cfg):
                direction_tensor_(layers, p, g, m0, m1, m2, v, g_rms, scale, m1_ms, z, mag,
                                  _cfg)  # fmt: skip

            def direction_threaded(layers, p, g, m0, m1, m2, v, g_rms, scale, m1_ms, z, mag,
                                   _cfg=cfg):  # fmt: skip
                direction_tensor_(layers, p, g, m0, m1, m2, v, g_rms, scale, m1_ms, z, mag,
                                  _cfg)  # fmt: skip

            single = {**COMPILE_OPTIONS}
            # the team's loop is parallel whatever the size hint of the symbolic size (the
            # small stand-ins would make inductor judge it too short to split) and takes the
            # caller's thread count at each call
            threaded = {**COMPILE_OPTIONS, "cpp.threads": -1, "cpp.dynamic_threads": True}
            n, t, scalar, static = ("n",), ("T",), (), (None, None)
            rows = (n,) * 6  # p, g, m0, m1, m2, v
            layers = (static,) * 6  # w1, b1, the hidden and the output layer
            one = (*layers, *rows, scalar, scalar, scalar)  # g_rms, scale, step
            ortho = (*layers, *rows, scalar, scalar, scalar, n, n)  # g_rms, scale, m1_ms, z, mag
            _compiled[cfg] = Passes(
                CompiledPass(sums, single, rows),
                CompiledPass(
                    tables, single, head="theta",
                    dims=(("T", None), ("T", None), t, t, scalar, scalar),
                ),  # sums, stats, log_lr, numel, step, lr
                CompiledPass(update, single, one, head="layers"),
                CompiledPass(update_threaded, threaded, one, head="layers"),
                CompiledPass(sums_packed, single, (*rows, n, t)),  # seg, sizes
                CompiledPass(
                    update_packed, single, head="layers",
                    dims=(static, (None, "T"), *layers[2:], *rows, n, t, t, (None, "T"), t,
                          scalar),  # seg, g_rms, scale, scales, ok, step
                ),
                CompiledPass(direction, single, ortho, head="layers"),
                CompiledPass(direction_threaded, threaded, ortho, head="layers"),
            )  # fmt: skip
        return _compiled[cfg]


class CompiledPass:
    """One pass of :func:`~learned_opt._fused.fused_step_`, compiled on its first call for
    each device type and argument dtypes, with symbolic sizes: a new size, step or lr
    never compiles it again.

    On CPU the pass is traced to a graph (``make_fx``) and compiled by inductor's
    ``standalone_compile``; the result is called directly, without the frame evaluation
    and guard checks of ``torch.compile``, which cost about 30 us a call (the compiled
    call itself about 25 us). So nothing checks at a call what the graph assumed, and the
    graph is traced on stand-in arguments that let it assume nothing it should not:
    ``dims`` names, per argument and dim, the sizes that vary (``"n"``: elements, ``"T"``:
    tensors; None: a size fixed by the config), and the stand-ins give them primes above
    every fixed size, so no varying size is taken for another or for a constant.
    Inductor's generated code still checks every fixed size and stride; dtypes and the
    device type are part of the key. Elsewhere (GPU) the pass goes through
    ``torch.compile(dynamic=True)``, whose guards check it all.

    ``head``: the first argument is the MLP's layers (``"layers"``: pairs of tensors,
    passed on as flat tensors, which ``dims`` then starts with) or theta (``"theta"``: a
    dict of tensors of fixed sizes, passed on as its values; ``dims`` covers the rest).
    """

    def __init__(self, fn: Callable, options: dict, dims: tuple, head: str | None = None):
        self.fn, self.options, self.dims, self.head = fn, options, dims, head
        self.names: tuple = ()  # the layers' count, or theta's names (set at each call)
        self.built: dict[tuple, Callable] = {}

    def __call__(self, *args):
        if self.head == "layers":
            layers, *rest = args
            self.names = (len(layers),)
            args = (*(t for pair in layers for t in pair), *rest)
        elif self.head == "theta":
            theta, *rest = args
            self.names = tuple(theta)
            args = (*theta.values(), *rest)
        key = (args[0].device.type, self.names, *(a.dtype for a in args))
        run = self.built.get(key)
        if run is None:
            with _lock:
                run = self.built.get(key) or self._build(key, args)
        out = run(*args)
        return out[0] if len(out) == 1 else out

    def flat(self, *args) -> list[Tensor]:
        """The pass on flat tensors (the head's first); returns its outputs as a list, or
        ``[0-d tensor]`` for a pass that only writes (a compiled graph returns tensors)."""
        if self.head == "layers":
            k = 2 * self.names[0]
            out = self.fn(tuple(zip(args[0:k:2], args[1:k:2])), *args[k:])
        elif self.head == "theta":
            k = len(self.names)
            out = self.fn(dict(zip(self.names, args[:k])), *args[k:])
        else:
            out = self.fn(*args)
        if out is None:
            return [args[-1].new_zeros(())]
        return list(out) if isinstance(out, tuple) else [out]

    def _build(self, key: tuple, args: tuple) -> Callable:
        if key[0] != "cpu":
            run = torch.compile(self.flat, dynamic=True, options=self.options)
        else:
            from torch.fx.experimental.proxy_tensor import make_fx

            dims = self.dims
            if self.head == "theta":  # theta's sizes are fixed
                dims = tuple((None,) * a.dim() for a in args[: len(self.names)]) + dims
            if len(args) != len(dims):
                raise ValueError(f"{len(args)} arguments for a pass of {len(dims)}")
            fixed = [s for a, ds in zip(args, dims) for d, s in zip(ds, a.shape) if not d]
            sizes = {"T": _prime_above(max(fixed, default=16))}
            sizes["n"] = _prime_above(4 * sizes["T"])
            stand_ins = [
                torch.zeros([sizes.get(d, s) for d, s in zip(ds, a.shape)], dtype=a.dtype)
                for a, ds in zip(args, dims)
            ]
            graph = make_fx(self.flat, tracing_mode="symbolic", _allow_non_fake_inputs=True)(
                *stand_ins
            )  # constants (features.constant) are real tensors
            run = torch._inductor.standalone_compile(
                graph, stand_ins, dynamic_shapes="from_graph",
                options={"config_patches": self.options},
            )  # fmt: skip
        self.built[key] = run
        return run


def _prime_above(k: int) -> int:
    """The smallest prime above ``k``."""
    k += 1
    while any(k % d == 0 for d in range(2, math.isqrt(k) + 1)):
        k += 1
    return k


class Passes(NamedTuple):
    """The passes of :func:`~learned_opt._fused.fused_step_`, compiled (:func:`compiled_for`) or not."""

    sums: Callable
    tables: Callable
    update: Callable
    update_threaded: Callable
    sums_packed: Callable
    update_packed: Callable
    direction: Callable
    direction_threaded: Callable


def eager_passes(cfg: NetConfig) -> Passes:
    """The same passes uncompiled (``compiled=False``)."""

    def sums_packed(p, g, m0, m1, m2, v, seg, sizes):
        return tensor_sums(p, g, m0, m1, m2, v, cfg, seg, sizes)

    sums = functools.partial(tensor_sums, cfg=cfg)
    tables = functools.partial(tensor_tables, cfg=cfg)
    update = functools.partial(update_tensor_, cfg=cfg)
    packed = functools.partial(update_packed_, cfg=cfg)
    direction = functools.partial(direction_tensor_, cfg=cfg)
    return Passes(sums, tables, update, update, sums_packed, packed, direction, direction)
