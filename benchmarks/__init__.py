"""Benchmarks: scripts that measure and write JSON (and PNG) under ``benchmarks/results``.

Every benchmark process sets the allocator as :class:`~learned_opt.LearnedOptimizer` does
on CPU (:func:`learned_opt.allocator.tune_malloc`) before it times anything, so that every
side is timed with the same allocator (``LEARNED_OPT_TUNE_MALLOC=0``: glibc's defaults).
"""

from learned_opt.allocator import tune_malloc

tune_malloc()
