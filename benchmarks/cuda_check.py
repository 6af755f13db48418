"""Check the CUDA path of learned-opt on one GPU and record timings, in about 5 minutes.

Run from the repository root on the GPU machine::

    PYTHONUNBUFFERED=1 python3 benchmarks/cuda_check.py --out $OUT

Nothing is installed: the package is laid out as installed in a temporary folder, first on
the path of this process and every subprocess. Each check of :data:`CHECKS` runs under its
own time limit (:mod:`benchmarks.device_harness`); writes ``cuda_check.json`` (rewritten
after every check) and ``cuda_check.log``. ``--allow-cpu`` runs every check on the CPU with
tiny sizes, to test the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import os
import platform
import re
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: ``benchmarks`` importable, after the layout
    sys.path.append(str(ROOT))
from benchmarks.device_harness import (  # noqa: E402
    Check,
    CheckSkipped,
    Context,
    build_installed_layout,
    record_run,
    require,
    run_check,
    run_subprocess,
    start_watchdog,
    summarise,
    sync,
    use_layout,
)


def synced_step(step: Callable, device: torch.device) -> Callable[[], dict]:
    """``step()`` timed until the device is done (``speed_common.time_turns``' callable)."""

    def run() -> dict:
        t0 = time.perf_counter()
        step()
        sync(device)
        return {"step": time.perf_counter() - t0}

    return run


#: size label -> (vocab, d_model, layers) of ``speed_common.transformer_shapes``
GPU_SIZES = {"10M": (8000, 256, 10), "100M": (32000, 768, 12)}
CPU_SIZES = {"tiny": (500, 32, 2)}
CUDA_TESTS = [
    "tests/core/test_cuda.py",
    "tests/distributed/test_nccl_cuda.py",
    "tests/tasks/test_tasks.py::test_batches_on_device",
]
# ----------------------------------------------------------------------------- checks


def _package_versions() -> dict:
    from importlib import metadata

    names = ["numpy", "scikit-learn", "lightning", "tensorboard", "jsonargparse", "matplotlib",
             "pytest", "pytest-timeout", "hypothesis"]  # fmt: skip
    versions = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def check_environment(ctx: Context, r: dict) -> None:
    """Versions, the GPU, and which ``learned_opt`` this process and a subprocess import."""
    import torch.distributed as dist

    r.update(python=platform.python_version(), platform=platform.platform())
    r.update(torch=torch.__version__, cuda=torch.version.cuda, cpu_count=os.cpu_count())
    r.update(cuda_available=torch.cuda.is_available(), packages=_package_versions())
    r["backends"] = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    r["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        r.update(device_count=torch.cuda.device_count(), gpu=props.name)
        r.update(capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
        r["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
        r["nccl"] = str(torch.cuda.nccl.version())
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total",
               "--format=csv,noheader"]  # fmt: skip
        with contextlib.suppress(OSError):
            r["nvidia_smi"] = run_subprocess(ctx, "nvidia-smi", smi)["output_tail"]
    code = "import learned_opt.distributed, learned_opt.tasks, learned_opt; print(learned_opt.__file__)"
    probe = run_subprocess(ctx, "import", [sys.executable, "-c", code], cwd=ROOT)
    r["learned_opt_in_subprocess"] = probe["output_tail"].strip()
    import learned_opt

    r["learned_opt"] = learned_opt.__file__
    require(str(ctx.layout) in r["learned_opt"], "this process does not import the layout copy")
    require(
        probe["returncode"] == 0 and r["learned_opt_in_subprocess"].startswith(str(ctx.layout)),
        "a subprocess run from the repository root does not import the layout copy",
    )
    require(ctx.cuda or ctx.results["allow_cpu"], "CUDA is not available")


def _pytest(ctx: Context, r: dict, name: str, targets: list[str], *extra: str) -> None:
    xml = ctx.scratch / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append("--timeout=120")
    run = run_subprocess(ctx, name, [*cmd, *extra, *targets], cwd=ROOT)
    record_run(r, run)
    require(xml.exists(), f"pytest wrote no report (exit code {run['returncode']})")
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    r.update(counts)
    r["problems"] = [
        f"{case.get('classname')}::{case.get('name')}: {(child.get('message') or '')[:500]}"
        for case in suite.iter("testcase")
        for child in case
        if child.tag in ("failure", "error")
    ]
    require(run["returncode"] == 0 and counts["tests"] > 0, f"pytest: {counts}")


def check_pytest_cuda(ctx: Context, r: dict) -> None:
    """The CUDA-only tests (all of them, no ``-x``); on a GPU none may be skipped."""
    _pytest(ctx, r, "pytest-cuda", CUDA_TESTS, "-rs")
    require(not ctx.cuda or r["skipped"] == 0, f"{r['skipped']} CUDA tests skipped on a GPU")


def check_step_timing(ctx: Context, r: dict) -> None:
    """``LearnedOptimizer.step()`` against the faster AdamW (foreach or fused): the shipped
    rule compiled (timed once compiled) and eager, and Muon with AdamW; all optimizers
    step one shared parameter set per size."""
    from benchmarks import speed_common as so
    from learned_opt import LearnedOptimizer

    sizes = GPU_SIZES if ctx.cuda else CPU_SIZES
    warmup, repeats = (2, 5) if ctx.cuda else (1, 2)
    r.update(warmup=warmup, repeats=repeats, rows=[])
    for label, dims in sizes.items():
        shapes = so.transformer_shapes(*dims)
        params = []
        for p in so.make_params(shapes):
            q = torch.nn.Parameter(p.detach().to(ctx.device))
            q.grad = p.grad.to(ctx.device)
            params.append(q)
        n = sum(p.numel() for p in params)
        opts = {
            f"adamw_{kind}": torch.optim.AdamW(params, lr=1e-3, **{kind: True})
            for kind in ("foreach", "fused")
        }
        opts["learned_default"] = LearnedOptimizer(params)
        opts["learned_reference"] = LearnedOptimizer(params, compile=False)
        opts["muon_adamw"] = so.muon_adamw(params, opts["learned_default"].config)
        t0 = time.perf_counter()
        so.compile_kernels({k: o.step for k, o in opts.items()}, opts)
        r.setdefault("compile_seconds", {})[label] = round(time.perf_counter() - t0, 1)
        ms = so.time_turns({k: synced_step(o.step, ctx.device) for k, o in opts.items()},
                           warmup, repeats)  # fmt: skip
        adam = min(ms["adamw_foreach"]["step"], ms["adamw_fused"]["step"])
        for name, t in ms.items():
            median, best = t["step"], t["step_best"]
            row = {"size": label, "params": n, "optimizer": name, "median_ms": round(median, 3)}
            row.update(best_ms=round(best, 3), ratio_to_best_adamw=round(median / adam, 2))
            r["rows"].append(row)
            ctx.log(f"   {label:>5} {name:<28} {median:9.2f} ms  x{median / adam:.1f}")
        del opts, params
        if ctx.cuda:
            torch.cuda.empty_cache()
        ctx.write_json()


def check_train_entry(ctx: Context, r: dict, ranks: int) -> None:
    """The real torchrun entry point, unchanged, at ``ranks`` ranks with its automatic
    backend: NCCL at one rank per GPU, gloo (device tensors staged on the host) beyond."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", "-m", "learned_opt.distributed.train",
           "--steps", "100", "--timeout", "30"]  # fmt: skip
    lines = record_run(r, run_subprocess(ctx, f"train-{ranks}rank", cmd))
    summary = [ln for ln in lines if ln.startswith("task=")]
    r["backend"] = "nccl" if ctx.cuda and ranks <= torch.cuda.device_count() else "gloo"
    if summary:
        r["summary"] = dict(re.findall(r"(\w+)=(\S+)", summary[-1]))
    require(r["returncode"] == 0 and summary, f"the {ranks}-rank run did not finish")


def check_meta_smoke(ctx: Context, r: dict) -> None:
    """``learned-opt-meta fit --config meta_train/configs/smoke.yaml`` on the device."""
    if importlib.util.find_spec("jsonargparse") is None:
        raise CheckSkipped("jsonargparse is not installed (LightningCLI needs it)")
    accelerator = "gpu" if ctx.cuda else "cpu"
    cmd = [sys.executable, "-m", "learned_opt.meta_train.cli_entry", "fit", "--config",
           str(ROOT / "meta_train" / "configs" / "smoke.yaml"), f"--trainer.accelerator={accelerator}",
           f"--trainer.default_root_dir={ctx.scratch / 'meta_smoke'}"]  # fmt: skip
    record_run(r, run_subprocess(ctx, "meta-smoke", cmd))
    r["accelerator"] = accelerator
    require(r["returncode"] == 0, "meta-training smoke run failed")


CHECKS = [
    Check("environment", check_environment, 40),
    Check("pytest_cuda", check_pytest_cuda, 100),
    Check("step_timing", check_step_timing, 240),
    Check("train_one_rank", functools.partial(check_train_entry, ranks=1), 60),
    Check("train_four_ranks", functools.partial(check_train_entry, ranks=4), 60),
    Check("meta_train_smoke", check_meta_smoke, 75),
]


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("cuda_check_out"), help="results folder")
    ap.add_argument("--allow-cpu", action="store_true", help="no GPU: dry run on the CPU")
    ap.add_argument("--budget", type=float, default=255.0, help="seconds for all checks")
    ap.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="these checks")
    return ap.parse_args(argv)


def make_context(args: argparse.Namespace, scratch: Path, log_file) -> Context:
    """Lay the package out, put it on the path, and build the subprocess environment."""
    layout = build_installed_layout(scratch / "site")
    use_layout(layout)
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(layout), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "4")
    env.setdefault("NCCL_DEBUG", "WARN")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    results = {
        "script": "benchmarks/cuda_check.py",
        "argv": sys.argv,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "allow_cpu": args.allow_cpu,
        "budget_s": args.budget,
        "checks": {},
    }
    return Context(device, args.out, scratch, layout, env, time.monotonic() + args.budget,
                   log_file, results)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="cuda_check_") as tmp,
        open(args.out / "cuda_check.log", "w") as log_file,
    ):
        ctx = make_context(args, Path(tmp), log_file)
        ctx.log(f"cuda_check: device {ctx.device}, layout {ctx.layout}, budget {args.budget} s")
        start_watchdog(ctx)
        for check in CHECKS:
            if args.only is None or check.name in args.only:
                run_check(ctx, check)
        return summarise(ctx)


if __name__ == "__main__":
    sys.exit(main())
