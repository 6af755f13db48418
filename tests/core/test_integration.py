"""The package from outside: import cost and isolation, and use from Lightning."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from learned_opt import LearnedOptimizer

IMPORT_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import learned_opt
t2 = time.perf_counter()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning",
               "tensorboard", "tensorboardX", "lightning_fabric"))
ours = sorted(m for m in sys.modules if m.startswith("learned_opt."))
print(json.dumps({"torch_s": t1 - t0, "ours_s": t2 - t1, "heavy": heavy, "ours": ours}))
"""


def test_import_is_light_and_fast():
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, check=True
    )
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["heavy"] == [], f"import learned_opt pulled in {probe['heavy']}"
    for sub in ("meta_train", "distributed", "tasks"):
        assert f"learned_opt.{sub}" not in probe["ours"]
    assert probe["ours_s"] < 2.0, f"import learned_opt took {probe['ours_s']:.2f}s beyond torch"


def test_works_from_lightning_configure_optimizers():
    lightning = pytest.importorskip("lightning")

    class Tiny(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return LearnedOptimizer(self.parameters())

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    model = Tiny()
    model.losses = []
    before = [p.detach().clone() for p in model.parameters()]
    trainer = lightning.Trainer(
        max_steps=5,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    assert len(model.losses) == 5
    assert model.losses[-1] < model.losses[0]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert isinstance(trainer.optimizers[0], LearnedOptimizer)
