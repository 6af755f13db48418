"""benchmarks/ns_precision.py: its two Newton-Schulz paths are the rule's own."""

import torch

from benchmarks import ns_precision
from learned_opt import orthogonal


def test_paths_are_the_rules_iterations_and_leave_the_bound_alone():
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0))
    before = orthogonal.GRAM_RATIO
    gram, plain = ns_precision._ns(x, "gram"), ns_precision._ns(x, "plain")
    assert orthogonal.GRAM_RATIO == before
    # 64 >= 3 * 16: the rule itself takes the Gram path here
    assert torch.equal(gram, orthogonal.newton_schulz(x, ns_precision.STEPS))
    assert not torch.equal(gram, plain)
    assert torch.allclose(gram, plain, atol=1e-4)  # the same map up to rounding
