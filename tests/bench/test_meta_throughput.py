"""The meta-training throughput benchmark, on a tiny single-worker stage."""

from __future__ import annotations

import json

import pytest

from benchmarks import meta_throughput
from learned_opt.meta_train import inner

TINY = """model:
  family: mlp_family
  tasks_per_step: 1
  unroll_length: 2
  min_length: 8
  max_length: 16
  worker_counts: [1]
  estimator: pes
  pes_pairs: 1
  val_tasks: [iris_mlp]
"""


def test_both_sides_run_the_same_meta_steps_and_the_single_worker_path_is_restored(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    one_worker = inner._one_worker_grad
    out = tmp_path / "throughput"
    assert meta_throughput.main(["--config", str(config), "--steps", "2", "--out", str(out)]) == 0
    assert inner._one_worker_grad is one_worker
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["seconds_per_meta_step"]) == {"autograd", "vmap"}
    assert all(v > 0 for v in result["inner_steps_per_second"].values())
    assert result["speedup"] > 0 and result["meta_steps_per_side"] == 2


def test_a_stage_with_several_workers_is_refused(tmp_path, capsys):
    config = tmp_path / "gossip.yaml"
    config.write_text(TINY.replace("worker_counts: [1]", "worker_counts: [1, 4]"))
    with pytest.raises(SystemExit) as exc:
        meta_throughput.main(["--config", str(config), "--steps", "1"])
    assert exc.value.code == 2
    assert "single-worker" in capsys.readouterr().err
