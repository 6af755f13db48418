# learned-opt: set-up, tests, demo and benchmarks. Every target creates .venv itself.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export OMP_NUM_THREADS ?= 2

.PHONY: venv test demo bench lint docs clean wheel-check test-newest-torch test-oldest-torch

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# import-linter reads packages from disk, and package-dir maps tasks/, distributed/ and
# meta_train/ into learned_opt; so the contracts are checked on a copy laid out as installed.
LINT_TREE := build/import-lint
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)
	cp -r learned_opt $(LINT_TREE)/learned_opt
	for d in tasks distributed meta_train checkpoints; do cp -r $$d $(LINT_TREE)/learned_opt/$$d; done
	mkdir -p $(LINT_TREE)/benchmarks && cp benchmarks/*.py $(LINT_TREE)/benchmarks/
	cd $(LINT_TREE) && PYTHONPATH=. ../../$(VENV)/bin/lint-imports ../../pyproject.toml
	cd $(LINT_TREE) && PYTHONPATH=. ../../$(VENV)/bin/lint-imports ../../.importlinter

test: $(STAMP) lint docs
	$(VPY) -m pytest $(if $(SLOW),,-m "not slow")

# the site: result pages regenerated from benchmarks/results, then built with warnings as
# errors; the API pages read the packages from a copy laid out as installed (as lint does)
API_TREE := build/api
docs: $(STAMP)
	$(VPY) benchmarks/report.py
	rm -rf $(API_TREE) && mkdir -p $(API_TREE)
	cp -r learned_opt $(API_TREE)/learned_opt
	for d in tasks distributed meta_train checkpoints; do cp -r $$d $(API_TREE)/learned_opt/$$d; done
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# the built wheel, installed with core dependencies only, runs the README quick start (CI)
wheel-check: $(STAMP)
	.ci/check_wheel.sh

# The compiled kernels on other torch versions, each in a venv of its own: their tests, the
# golden updates, the packed step and the robust distances. ($(call other_torch,VENV,VERSION))
KERNEL_TESTS := tests/core/test_kernel.py tests/core/test_golden.py tests/core/test_packed_step.py \
	tests/distributed/test_distance_kernel.py
define other_torch
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q torch==$(2) numpy pytest pytest-timeout
	$(1)/bin/python -m pip install -q --no-deps -e .
	$(1)/bin/python -m pytest -q $(KERNEL_TESTS)
endef

# The newest torch the registry serves here (pip's cap), and the step benchmark's small
# workloads on it (the JSON records torch).
NEWEST_TORCH ?= 2.14.1
NEWEST  := .venv-newest-torch
test-newest-torch:
	$(call other_torch,$(NEWEST),$(NEWEST_TORCH))
	$(NEWEST)/bin/python benchmarks/step_overhead.py --workloads transformer-0.5M shapes-10M \
		--no-contention --out benchmarks/results/step_overhead_newest_torch.json

# The oldest torch the package supports.
OLDEST_TORCH ?= 2.11.0
test-oldest-torch:
	$(call other_torch,.venv-oldest-torch,$(OLDEST_TORCH))

demo: $(STAMP)
	$(VPY) -m learned_opt.demo

bench: $(STAMP)
	$(VPY) -m benchmarks --all

clean:
	rm -rf $(VENV) build dist *.egg-info runs lightning_logs
