"""Settings for the whole test suite.

The learned step runs the eager reference until its compiled kernel is ready (see
:mod:`learned_opt.kernel`); the kernel is ``torch.compile`` of that same function. A compile
takes tens of seconds on two cores, so compiling is off for the suite
(``LEARNED_OPT_COMPILE=0``, inherited by subprocesses), and ``tests/core/test_kernel.py``
compiles the kernel once per session and checks it against the reference and the golden
updates.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("LEARNED_OPT_COMPILE", "0")


@pytest.fixture
def one_thread():
    """Run the test on one intra-op thread (restored after it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
