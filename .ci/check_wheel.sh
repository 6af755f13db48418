#!/usr/bin/env bash
# Builds the wheel, installs it with its core dependencies only into a fresh venv, and runs
# the README's quick start there: no Lightning, TensorBoard, numpy or scikit-learn needed.
# Needs .venv (make venv). torch is installed first, at the pin of the development
# environment: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# setuptools reuses build/lib, which keeps files the tree has since removed
rm -rf build/lib build/bdist.*
.venv/bin/python -m pip wheel --no-deps -q -w "$work/dist" .
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$TORCH_PIN"
"$work/venv/bin/python" -m pip install -q "$work"/dist/learned_opt-*.whl
.venv/bin/python .ci/readme_quickstart.py README.md >"$work/quickstart.py"

cd "$work"
venv/bin/python - <<'PY'
import importlib.util

extras = ["lightning", "tensorboard", "sklearn", "matplotlib", "jsonargparse"]
present = [name for name in extras if importlib.util.find_spec(name)]
assert not present, f"core install pulled optional packages: {present}"

from importlib import resources

shipped = resources.files("learned_opt")
for name in ("meta_train/configs/smoke.yaml", "meta_train/configs/finetune.yaml",
             "checkpoints/default.pt"):
    assert (shipped / name).is_file(), f"the wheel lacks {name}"
assert not (shipped / "meta_train/stages").exists(), "stage checkpoints are not shipped"
assert not (shipped / "checkpoints/default_stage1.pt").exists(), "a stage is not shipped"
PY
OMP_NUM_THREADS=1 venv/bin/python quickstart.py
venv/bin/learned-opt --version
venv/bin/learned-opt list
echo "wheel check passed: core-only install runs the README quick start"
