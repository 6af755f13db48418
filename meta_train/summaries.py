"""Figures for TensorBoard: loss curves, mixing matrices and response curves.

Each function returns an ``HxWx3`` uint8 array (``dataformats="HWC"``). Matplotlib is
imported lazily with the Agg backend, so nothing here needs a display.
"""

from __future__ import annotations

import numpy as np
import torch

from learned_opt.config import NetConfig
from learned_opt.features import edge_features, init_state, time_features
from learned_opt.network import edge_weight
from learned_opt.step import tensor_step


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _to_array(fig) -> np.ndarray:
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    _figure().close(fig)
    return img


def curves_image(curves: dict[str, list[float]], title: str) -> np.ndarray:
    """Loss curves (log scale), one line per label."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
    for label, c in curves.items():
        ax.plot(np.arange(1, len(c) + 1), c, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("inner step")
    ax.set_ylabel("train loss")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _to_array(fig)


def matrix_image(matrix: torch.Tensor, title: str) -> np.ndarray:
    """A mixing matrix as a heat map."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(3.6, 3.2), dpi=80)
    im = ax.imshow(matrix.detach().cpu().numpy(), cmap="viridis", vmin=0)
    fig.colorbar(im, ax=ax)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _to_array(fig)


@torch.no_grad()
def update_response(theta, cfg: NetConfig, momentum_states=(-1.0, 0.0, 1.0), step: int = 100):
    """Update against normalised gradient for a few momentum states.

    A synthetic tensor with unit second moment: gradients span [-3, 3], every momentum is
    set to the given multiple of the gradient rms. Returns ``{label: (g, update)}``.
    """
    g = torch.linspace(-3.0, 3.0, 121)
    p = torch.zeros_like(g)
    out = {}
    for mval in momentum_states:
        state = init_state(p)
        state["m"] += mval
        state["v"] += 1.0
        log_lr = state["log_lr"] if cfg.adapts_lr else None  # at its start value, 0
        new_p = tensor_step(theta, cfg, p, g, state["m"], state["v"], step, log_lr=log_lr)[0]
        out[f"m={mval:+.1f}"] = (g.numpy(), (new_p - p).numpy())
    return out


@torch.no_grad()
def mixing_response(theta, cfg: NetConfig, degrees=(1, 2, 4), step: int = 100):
    """Mixing weight against normalised edge distance ||y_a - y_b|| / (||y_a|| + ||y_b||),
    per max degree, without loss features. Returns ``{label: (distance, weight)}``."""
    dists = torch.linspace(0.0, 0.95, 39)
    y_b = torch.ones(4)
    out = {}
    for deg in degrees:
        xs, ws = [], []
        for d in dists:
            y_a = y_b * (1 + d) / (1 - d)  # gives exactly distance d
            feats = edge_features(y_a, y_b, None, None, deg)
            time = time_features(step, cfg, feats)
            xs.append(float(feats[0]))
            ws.append(float(edge_weight(theta, cfg, feats, deg, time)))
        out[f"max degree {deg}"] = (np.array(xs), np.array(ws))
    return out


def response_image(curves: dict, xlabel: str, ylabel: str, title: str) -> np.ndarray:
    """Line plot of ``{label: (x, y)}``."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
    for label, (x, y) in curves.items():
        ax.plot(x, y, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _to_array(fig)
