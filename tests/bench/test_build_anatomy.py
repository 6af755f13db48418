"""The build anatomy benchmark: which compile a subprocess is, and its table."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import report_sections  # noqa: E402
from benchmarks.build_anatomy import kind_of, queued_builds  # noqa: E402


def test_each_compiler_subprocess_is_named_by_what_it_compiles():
    cache = "/tmp/cache/ab"
    assert kind_of(["g++", f"{cache}/x.wrapper.cpp", "-O1", "-c", "-o", "x.wrapper.o"]) == "wrapper"
    assert kind_of(["g++", f"{cache}/y.kernel.cpp", "-c", "-o", "y.kernel.o"]) == "kernels"
    assert kind_of(["g++", f"{cache}/z.cpp", "-shared", "-o", f"{cache}/z.so"]) == "isa_probes"
    assert kind_of(["python", "-c", 'from ctypes import cdll; cdll.LoadLibrary("z.so")']) == (
        "isa_probes"
    )
    # linking the package's objects, its weights and the header's preprocessing
    assert kind_of("g++ x.wrapper.o y.kernel.o w.weights.o -shared -o p.so") == "link_and_other"
    assert kind_of(["g++", "w.weights.S", "-c", "-o", "w.weights.o"]) == "link_and_other"
    assert kind_of(["g++", "h.h", "-E", "-P", "-o", "header.i"]) == "link_and_other"


def test_the_table_sums_each_variant_and_names_its_packages():
    builds = [
        {"tensors": 16, "seconds": 20.0, "export": 1.0, "wrapper": 9.0},
        {"tensors": 14, "seconds": 30.0, "export": 2.0, "wrapper": 8.0, "isa_probes": 7.0},
    ]
    total = {"seconds": 50.0, "export": 3.0, "isa_probes": 7.0, "wrapper": 17.0}
    text = report_sections.render_build_anatomy(
        {
            "workload": "w", "threads": 2, "load_average_before": 0.5, "command": "c",
            "date": "2026-12-06", "machine": "x86_64, 2 threads", "torch": "2.13.0+cpu",
            "variants": {"shipped": {"builds": builds, "total": total}},
        }
    )  # fmt: skip
    assert "| shipped | 16 + 14 | 50.0 | 3.0 | 0.0 | 7.0 | 17.0 | 0.0 | 0.0 |" in text
    assert "Command: `c`" in text


def test_the_builds_a_model_queues_are_recorded_not_built(monkeypatch, tmp_path):
    """Training a model with compiling due at once queues its kinds of bucket: recorded
    (the step's arguments), nothing built, and the worker's own submit put back."""
    import torch

    from learned_opt import kernel

    monkeypatch.setenv(kernel.COMPILE_ENV, "1")
    monkeypatch.setenv(kernel.KERNEL_DIR_ENV, str(tmp_path))
    submit = kernel._Worker.submit

    class Model(torch.nn.Sequential):
        def loss(self, batch):
            return self(batch).square().mean()

    torch.manual_seed(0)
    model = Model(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    queued = queued_builds(model, torch.randn(4, 8))
    assert queued and all(len(args) == 8 for args in queued)  # theta, cfg, parts, ... decay
    assert sum(len(args[3]) for args in queued) == 4  # every parameter, once
    assert kernel._Worker.submit is submit and not list(tmp_path.glob("*.pt2"))
