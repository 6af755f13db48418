"""Benchmarks: scripts that measure and write JSON (and PNG) under ``benchmarks/results``.

Run from the repository root, e.g. ``python -m benchmarks.quality_single``.
"""
