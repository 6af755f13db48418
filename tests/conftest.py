"""Settings for the whole test suite.

No fast test may wait for ``torch.compile`` (its first compile takes tens of seconds on
two cores), so by default the learned step does not use the compiled fused layout here
(``LEARNED_OPT_FUSED=0``, inherited by subprocesses). Tests of the fused layout ask for it
explicitly: ``fused="eager"`` runs its math without compiling; the compiled ones are
marked ``slow``.
"""

from __future__ import annotations

import os

os.environ.setdefault("LEARNED_OPT_FUSED", "0")
