"""Check the CUDA path of learned-opt on one GPU and record timings, in about 5 minutes.

Run from the repository root on the GPU machine::

    PYTHONUNBUFFERED=1 python3 benchmarks/cuda_check.py --out $OUT

Nothing is installed. The package is copied, laid out as pip would install it (pyproject's
``[tool.setuptools.package-dir]``), into a temporary folder that goes first on the path of
this process and, through ``PYTHONPATH`` with ``PYTHONSAFEPATH=1``, of every subprocess.
Every check, a function ``fn(ctx, result_dict)`` that raises :class:`CheckFailed` or
:class:`CheckSkipped` or returns, runs under its own time limit (subprocesses in their own
process group, killed on timeout); a failure is recorded with its error and the next check
runs; a watchdog ends the whole run shortly after ``--budget`` seconds. Writes ``cuda_check.json`` (rewritten
after every check: versions, pass/fail, errors, timings) and ``cuda_check.log``.

``--allow-cpu`` runs every check on the CPU with tiny sizes, to test the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: ``benchmarks`` importable, after the layout
    sys.path.append(str(ROOT))
MIN_CHECK_S = 15.0  # a check is skipped when less time than this is left
#: a line naming an exception, e.g. ``RuntimeError: ...`` or ``DistBackendError: ...``
ERROR_LINE = re.compile(r"\w+(Error|Exception)\b.*: \S|NCCL WARN")
#: known causes of a failed multi-rank run, searched for in its output
DIAGNOSES = {
    "Duplicate GPU detected": "NCCL refuses two ranks on one GPU",
    "invalid device ordinal": "a rank asked for a GPU that does not exist",
    "not supported": "the backend does not support this operation or device",
    "Segmentation fault": "a process crashed (SIGSEGV)",
    "SIGSEGV": "a process crashed (SIGSEGV)",
    "timed out": "a collective timed out",
}


# ----------------------------------------------------------------------------- layout


def build_installed_layout(dest: Path) -> Path:
    """Copy the package into ``dest`` as installed (``tasks/`` becomes
    ``learned_opt/tasks`` and so on, per pyproject's package-dir); returns ``dest``."""
    import tomllib  # Python >= 3.11, as on both machines this script is meant for

    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name, src in sorted(package_dir.items(), key=lambda kv: kv[0].count(".")):
        shutil.copytree(ROOT / src, dest / name.replace(".", "/"), ignore=skip, dirs_exist_ok=True)
    return dest


def use_layout(layout: Path) -> None:
    """Import ``learned_opt`` from ``layout`` in this process from now on: it goes first on
    the path, and the modules already imported from the checkout (``benchmarks/__init__``
    imports the allocator) are dropped, so that the next import takes the laid-out copy,
    subpackages (``learned_opt.meta_train``) included."""
    sys.path.insert(0, str(layout))
    for name in [m for m in sys.modules if m == "learned_opt" or m.startswith("learned_opt.")]:
        del sys.modules[name]


# ----------------------------------------------------------------------------- plumbing


class CheckFailed(Exception):
    """A check's criterion did not hold."""


class CheckSkipped(Exception):
    """A check cannot run here (the reason is recorded)."""


class CheckTimeout(Exception):
    """A check ran past its time limit."""


def require(cond, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


@dataclass
class Context:
    """What every check gets: the device, folders, subprocess environment and clock."""

    device: torch.device
    out: Path
    scratch: Path
    layout: Path
    env: dict
    deadline: float
    log_file: object
    results: dict
    start: float = field(default_factory=time.monotonic)
    limit: float = 60.0  # the running check's time limit
    children: set = field(default_factory=set)  # process groups of running subprocesses

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.start:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def write_json(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.out / "cuda_check.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "cuda_check.json")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_subprocess(ctx: Context, name: str, cmd: list[str], cwd: Path | None = None) -> dict:
    """Run ``cmd`` in its own process group (from the scratch folder unless ``cwd``),
    streaming its output to the log, for at most the running check's time limit."""
    ctx.log(f"[{name}] $ {' '.join(cmd)}")
    t0, lines = time.monotonic(), []
    proc = subprocess.Popen(
        cmd, cwd=cwd or ctx.scratch, env=ctx.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    ctx.children.add(proc.pid)

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            ctx.log(f"[{name}] {lines[-1]}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(ctx.limit - 2.0, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        ctx.log(f"[{name}] timed out after {time.monotonic() - t0:.0f} s: killing it")
    finally:
        _kill_group(proc.pid)  # also any straggler it left behind
        proc.wait()
        ctx.children.discard(proc.pid)
        reader.join(5.0)
    tail = "\n".join(lines)[-6000:]
    return {
        "cmd": " ".join(cmd),
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - t0, 1),
        "output_tail": tail,
        "lines": lines,
    }


def record_run(r: dict, run: dict) -> list[str]:
    """Store a subprocess run (without its full output) in the check's result."""
    r.update({k: v for k, v in run.items() if k != "lines"})
    found = {why for key, why in DIAGNOSES.items() if key in run["output_tail"]}
    if run["timed_out"]:
        found.add("killed at the check's time limit")
    if found:
        r["diagnosis"] = sorted(found)
    errors = [ln.strip() for ln in run["lines"] if ERROR_LINE.search(ln)]
    if errors:
        r["error_lines"] = list(dict.fromkeys(errors))[:8]
    return run["lines"]


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CheckTimeout` in the main thread after ``seconds``."""

    def fire(signum, frame):
        raise CheckTimeout(f"ran past its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[Context, dict], None]  # fills its result dict; raises CheckFailed
    limit: float  # seconds


def run_check(ctx: Context, check: Check) -> None:
    """Run one check under its time limit and record its outcome, whatever happens."""
    entry: dict = {"status": "running", "result": {}}
    ctx.results["checks"][check.name] = entry
    ctx.limit = min(check.limit, ctx.remaining())
    if ctx.limit < min(MIN_CHECK_S, check.limit):
        entry.update(status="skip", reason=f"time budget spent ({ctx.remaining():.0f} s left)")
        ctx.log(f"== {check.name}: SKIP ({entry['reason']})")
        return ctx.write_json()
    ctx.log(f"== {check.name} (limit {ctx.limit:.0f} s)")
    ctx.write_json()
    t0 = time.monotonic()
    try:
        with time_limit(ctx.limit + 5.0):
            check.fn(ctx, entry["result"])
        entry["status"] = "pass"
    except CheckSkipped as exc:
        entry.update(status="skip", reason=str(exc))
    except Exception as exc:  # every failure is recorded; the run goes on
        entry.update(status="fail", error=f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, (CheckFailed, CheckTimeout)):
            entry["traceback"] = traceback.format_exc()[-4000:]
    entry["seconds"] = round(time.monotonic() - t0, 1)
    if ctx.cuda:
        with contextlib.suppress(Exception):  # a broken CUDA context must not end the run
            entry["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    detail = entry.get("error") or entry.get("reason") or ""
    ctx.log(f"== {check.name}: {entry['status'].upper()} in {entry['seconds']} s {detail}")
    ctx.write_json()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    """The CUDA-only tests (all of them, no ``-x``): agreement with the CPU (fp32, bf16,
    ``flat_step``), the multi-chunk path, NaN/Inf gradients, bitwise repeatability; on a
    GPU none may be skipped."""
    _pytest(ctx, r, "pytest-cuda", CUDA_TESTS, "-rs")
    require(not ctx.cuda or r["skipped"] == 0, f"{r['skipped']} CUDA tests skipped on a GPU")


def check_step_timing(ctx: Context, r: dict) -> None:
    """``LearnedOptimizer.step()`` against the faster AdamW (foreach or fused): the shipped
    single-worker rule on its default path (the compiled kernel, timed once compiled) and
    as the eager reference, and the shipped gossip rule (networks not zero); all
    optimizers step one shared parameter set per size."""
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


def summarise(ctx: Context) -> int:
    """Counts per status; returns the exit code (1 when a check failed)."""
    checks = ctx.results["checks"]
    by = {s: [n for n, c in checks.items() if c["status"] == s] for s in ("pass", "fail", "skip")}
    ctx.results["summary"] = {**{s: len(v) for s, v in by.items()}, "failed": by["fail"]}
    ctx.write_json()
    for name, c in checks.items():
        ctx.log(f"{c['status'].upper():>5} {name:<24} {c.get('seconds', 0):6.1f} s "
                f"{c.get('error') or c.get('reason') or ''}"[:300])  # fmt: skip
    ctx.log(f"summary: {ctx.results['summary']}")
    return 1 if by["fail"] else 0


def start_watchdog(ctx: Context, grace: float = 25.0) -> None:
    """End the run (after recording why) if it outlives the budget by ``grace`` seconds."""

    def abort():
        ctx.log(f"WATCHDOG: still running {grace:.0f} s past the budget; ending the run")
        for pid in list(ctx.children):
            _kill_group(pid)
        ctx.results["aborted"] = "watchdog: the run outlived its budget"
        with contextlib.suppress(Exception):
            summarise(ctx)
        os._exit(3)

    timer = threading.Timer(max(ctx.remaining(), 0.0) + grace, abort)
    timer.daemon = True
    timer.start()


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
