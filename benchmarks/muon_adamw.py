"""Muon with AdamW, as its documentation pairs them: ``torch.optim.Muon`` on the hidden
matrices and ``torch.optim.AdamW`` on every other tensor. An anchor of the validation and
held-out suites (``validation_anchors``) and a row of the step-cost benchmark
(``step_overhead``); this module imports torch only, so both can use it."""

from __future__ import annotations

import torch


class MuonWithAdamW:
    """``torch.optim.Muon`` on the hidden matrices and ``AdamW`` on the rest, stepped
    together (the interface :func:`benchmarks.heldout_single.run` uses: ``step`` and
    ``zero_grad``)."""

    def __init__(self, params, hidden: list[bool]):
        params = list(params)
        if len(params) != len(hidden):
            raise ValueError(f"{len(params)} parameters but a mask of {len(hidden)}")
        muon = [p for p, h in zip(params, hidden) if h]
        rest = [p for p, h in zip(params, hidden) if not h]
        self.optimizers = [torch.optim.AdamW(rest, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)]
        if muon:
            self.optimizers.append(
                torch.optim.Muon(muon, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
            )

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
