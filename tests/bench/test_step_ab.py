"""The side-by-side step benchmark: another revision imported apart, and its docs table."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmarks import rules, step_ab  # noqa: E402


def test_a_revision_is_imported_apart_and_timed_beside_this_one():
    import learned_opt.optimizer

    base, commit = step_ab.import_revision("HEAD")
    assert base.__name__ == f"learned_opt_{commit}.optimizer"
    assert base.LearnedOptimizer is not learned_opt.optimizer.LearnedOptimizer
    assert Path(base.__file__).is_relative_to(rules.CACHE / commit)
    ckpt = step_ab.base_checkpoint(base)  # the revision's own, with its own config
    assert ckpt.is_file() and ckpt.is_relative_to(rules.CACHE / commit)
    row = step_ab.measure("val_friedman_mlp", base, steps=1, rounds=2)  # steps with ckpt
    assert set(row["ms"]) == {"adamw", "base", "this"} and min(row["ms"].values()) > 0
    assert row["parameters"] == 4929
    assert row["max_rel_diff"] < 1e-6  # HEAD's step and the checkout's agree


def test_split_gives_the_usual_decay_and_no_decay_groups():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((3, 4), (4,), (2, 3, 3), (5,))]
    assert step_ab.param_groups(params, split=False) is params
    decayed, plain = step_ab.param_groups(params, split=True)
    assert decayed == {"params": [params[0], params[2]], "weight_decay": step_ab.SPLIT_DECAY}
    assert plain == {"params": [params[1], params[3]], "weight_decay": 0.0}


@pytest.mark.parametrize("ref", ["HEAD", "a597db0"])  # a597db0: the literal module check
def test_the_imported_revision_builds_its_kernels_with_its_own_code(tmp_path, ref):
    """``--kernel``: the other revision's build process imports that revision (its own
    job format), not this checkout's, and takes that revision's recipes: a build job
    naming its kernel module runs there, one naming another module is refused."""
    if ref != "HEAD" and subprocess.run(["git", "cat-file", "-e", ref], cwd=ROOT).returncode:
        pytest.skip(f"{ref} is not in this clone's history")
    _, commit = step_ab.import_revision(ref)
    name = f"learned_opt_{commit}"
    kernel = importlib.import_module(f"{name}.kernel")
    code = kernel._CHILD
    assert f"{name}.kernel import" in code and "learned_opt.kernel" not in code
    folder = code.split("sys.path.insert(0, ")[1].split(")")[0].strip("'")
    one_module = Path(folder) / name / "kernel.py"  # before the kernel package
    assert not one_module.exists() or step_ab._OLD_GUARD not in one_module.read_text()
    assert Path(kernel.__file__).is_relative_to(rules.CACHE / commit)
    for module, ok in ((f"{name}.kernel", True), ("learned_opt.kernel", False)):
        job = {"builds": [], "recipe": "step", "module": module, "threads": 1, "nice": 0,
               "parent": os.getpid()}  # fmt: skip
        torch.save(job, tmp_path / "job.pt")
        run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.pt")],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert (run.returncode == 0) == ok, run.stderr[-2000:]
        if not ok:
            assert "ValueError: not a learned_opt" in run.stderr  # the revision's own words
