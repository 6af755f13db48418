"""Benchmarks: scripts that measure and write JSON (and PNG) under ``benchmarks/results``.

Run from the repository root: ``python -m benchmarks --list`` names the entry points.

Every benchmark process sets the allocator as :class:`~learned_opt.LearnedOptimizer`
does on CPU (:func:`learned_opt.allocator.tune_malloc`) before it times anything, so that
AdamW and the other sides are timed with the same allocator as the rule, also in the
processes where no rule is built (``LEARNED_OPT_TUNE_MALLOC=0`` times every side with
glibc's defaults). ``machine()`` records which.
"""

from learned_opt.allocator import tune_malloc

tune_malloc()
