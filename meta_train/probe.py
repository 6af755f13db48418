"""The probe: the learned mixing matrix on the validation topology, for TensorBoard."""

from __future__ import annotations

import torch

from .inner import inner_step, make_inner_optimizer, new_trajectory


@torch.no_grad()
def probe_mixing_matrix(net, task, settings, device=None, steps: int = 10) -> torch.Tensor:
    """The ``N x N`` learned mixing matrix (first parameter tensor) after ``steps`` inner
    steps of ``task`` on the validation topology and partition."""
    s = settings
    traj = new_trajectory(
        task, s.val_workers, s.val_topology, s.val_partition, s.val_alpha, s.val_seed,
        steps + 1, device,
    )  # fmt: skip
    opt = make_inner_optimizer("learned", net=net, mixing="learned")
    info = {}
    for _ in range(steps):
        _, info = inner_step(traj, opt)
    n = s.val_workers
    matrix = torch.zeros(n, n, dtype=torch.float64)
    weights = info["weights"][0].detach().cpu().double()
    for (i, j), w in zip(info["edges"], weights):
        matrix[i, j] += w
        matrix[j, i] += w
    matrix += torch.diag(1.0 - matrix.sum(dim=1))
    return matrix
