"""learned_opt.allocator: glibc's thresholds raised once per process, or left alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from learned_opt import allocator

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _child(code: str, **env) -> str:
    """``code`` run in a fresh interpreter (the setting is per process), its stdout; only
    the path settings are passed on (a checkout laid out on ``PYTHONPATH`` stays the one
    imported)."""
    keep = {k: os.environ[k] for k in ("PYTHONPATH", "PYTHONSAFEPATH") if k in os.environ}
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin", **keep, **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-800:]
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_the_optimizer_sets_the_thresholds_on_cpu_and_the_blocks_stay_mapped():
    """After a LearnedOptimizer on CPU parameters, ten 8 MB temporaries alive at once and
    then freed, as a step's are, are not returned to the system: the next rounds fault
    no new pages (with glibc's defaults they usually fault all 20,480 pages of each round
    again; not asserted, as glibc's dynamic thresholds sometimes keep them). With
    ``LEARNED_OPT_TUNE_MALLOC=0`` the thresholds are left alone."""
    code = (
        "import resource, torch\n"
        "from learned_opt import LearnedOptimizer, allocator\n"
        "LearnedOptimizer([torch.nn.Parameter(torch.zeros(3))])\n"
        "def step():\n"
        "    temporaries = [torch.ones(2 << 20) for _ in range(10)]\n"
        "for _ in range(3): step()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(10): step()\n"
        "print(allocator._tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    tuned, faults = _child(code).split()
    assert tuned == "True"
    assert int(faults) < 2048  # 4 KiB pages: one round's blocks are 20,480 pages
    assert _child(code, LEARNED_OPT_TUNE_MALLOC="0").split()[0] == "False"


def test_a_bad_setting_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", None)
    monkeypatch.setenv(allocator.TUNE_ENV, "maybe")
    with pytest.raises(ValueError, match="LEARNED_OPT_TUNE_MALLOC"):
        allocator.tune_malloc()


def test_a_users_own_malloc_setting_is_kept(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert allocator.tune_malloc() is False
