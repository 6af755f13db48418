"""``benchmarks/nccl_check.py`` without GPUs: its CPU dry run (two gloo ranks, the tiny
model) writes the JSON a GPU run writes, and without CUDA or with one GPU it stops with one
line and exit code 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import nccl_check  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "nccl_check.py"
GOSSIP = [
    f"{rule} {topo}{suffix}"
    for topo in nccl_check.TOPOLOGIES
    for rule, suffix in (("D-Adam", ""), ("learned + learned mixing", ""),
                         ("learned + learned mixing", " overlap"))
]  # fmt: skip


def _run(args: list[str], out: Path, **env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", LEARNED_OPT_COMPILE="0", **env)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def test_cpu_dry_run_writes_every_configuration(tmp_path):
    proc = _run(["--backend", "gloo", "--device", "cpu", "--quick"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "nccl_check.json").read_text())
    assert {"date", "machine", "command", "setup", "wall_seconds"} <= set(result)
    assert {"torch", "cuda", "nccl", "decent_dp"} <= set(result["versions"])
    assert (result["backend"], result["device"], result["world_size"]) == ("gloo", "cpu", 2)
    assert (result["gpu"], result["gpu_count"]) == (None, 0)
    [row] = result["sizes"]
    assert row["size"] == "tiny" and row["params"] > 0 and "error" not in row
    assert row["kernel"]["compile"] is False
    names = [nccl_check.BASELINE, *GOSSIP]
    assert set(names) <= set(row["step_ms"])
    base = row["step_ms"][nccl_check.BASELINE]
    for name, ms in row["step_ms"].items():
        ranks = row["rank_step_ms"][name]
        assert len(ranks) == 2 and all(math.isfinite(t) and t > 0 for t in ranks), name
        assert ms == max(ranks)
        assert row["vs_ddp"][name] == pytest.approx(ms / base)
        assert name in proc.stdout
    # Decent-DP is timed when importable; otherwise the reason is recorded
    assert (nccl_check.PEER in row["step_ms"]) != (nccl_check.PEER in row["skipped"])
    assert f"wrote {tmp_path / 'nccl_check.json'}" in proc.stdout


def test_without_cuda_one_line_and_exit_code_2(tmp_path):
    proc = _run([], tmp_path / "out", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no CUDA device" in proc.stderr and "--backend gloo --device cpu" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_one_gpu_or_nccl_on_cpu_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert nccl_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "found 1 GPU; this check needs 2 or more" in err[0]
    assert nccl_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "NCCL needs GPUs" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
