"""Whether torch's AOTInductor packages load on this machine's GPU, in about 2 minutes.

Run from the repository root on the GPU machine::

    PYTHONUNBUFFERED=1 python3 benchmarks/cuda_aoti_probe.py --out DIR

A one-line CUDA function (``x * 2 + 1``) is exported (``torch.export``), compiled with
``aoti_compile_and_package`` and loaded with ``aoti_load_package``, each scenario in a
fresh process with ``PYTHONFAULTHANDLER=1`` (a crash ends only that process): loaded on
the main thread, and on another thread (as the optimizer's compile thread would). Writes
``DIR/cuda_aoti_probe.json``: per scenario the exit status (``-11``: a segmentation
fault), the seconds and the tail of its stderr. ``learned_opt.kernel.KERNEL_DEVICES``
cites it: where CUDA packages do not load, CUDA tensors step the reference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SCENARIO = r"""
import os, sys, threading, torch
where, path = sys.argv[1], sys.argv[2]
if not os.path.exists(path):
    class Line(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1
    program = torch.export.export(Line(), (torch.randn(8, device="cuda"),))
    from torch._inductor import aoti_compile_and_package
    aoti_compile_and_package(program, package_path=path)
loaded = {}
def load():
    from torch._inductor import aoti_load_package
    loaded["fn"] = aoti_load_package(path)
if where == "thread":
    t = threading.Thread(target=load)
    t.start()
    t.join()
else:
    load()
x = torch.randn(8, device="cuda")
print("agrees", bool(torch.allclose(loaded["fn"](x), x * 2 + 1)), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("cuda_aoti_probe_out"), help="results folder")
    ap.add_argument("--timeout", type=float, default=200.0, help="seconds per scenario")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_aoti_probe: CUDA is not available", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "script": "benchmarks/cuda_aoti_probe.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "cuda": torch.version.cuda, "scenarios": {},
    }  # fmt: skip
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    package = args.out / "line.pt2"
    for where in ("main", "thread"):
        t0 = time.monotonic()
        cmd = [sys.executable, "-c", SCENARIO, where, str(package)]
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=args.timeout)  # fmt: skip
            row = {"returncode": run.returncode, "stdout": run.stdout[-300:]}
            row["stderr_tail"] = run.stderr[-1200:]
        except subprocess.TimeoutExpired:
            row = {"returncode": None, "error": f"timeout after {args.timeout:.0f} s"}
        row["seconds"] = round(time.monotonic() - t0, 1)
        result["scenarios"][f"load_on_{where}"] = row
        print(f"load on the {where} thread: exit {row['returncode']} in {row['seconds']} s",
              flush=True)  # fmt: skip
        (args.out / "cuda_aoti_probe.json").write_text(json.dumps(result, indent=1) + "\n")
    package.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
