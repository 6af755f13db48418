"""What the device checks share: the package laid out as installed, each check under its own
time limit with its outcome recorded whatever happens, subprocesses in their own process
group, and a watchdog that ends a run outliving its budget (``cuda_check.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
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
    the path, and the modules already imported from the checkout are dropped."""
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
