"""Core tests run on one intra-op thread: their tensors are tiny, and on a busy 2-core
machine two threads mostly wait for each other (5x slower)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
