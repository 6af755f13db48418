"""Decentralized training from a Lightning Trainer: an MLP on the digits data, 4 local ranks.

    python examples/lightning_gossip.py                          # learned optimizer + learned mixing
    python examples/lightning_gossip.py --optimizer adam --mixing metropolis    # D-Adam
    python examples/lightning_gossip.py --mixing allreduce       # plain data parallel, to compare
    python examples/lightning_gossip.py --accelerator gpu --devices 1            # NCCL, one GPU

The model, data and loop are what a Lightning user writes anyway; the only change is
``strategy=GossipStrategy(...)``. Lightning relaunches this script once per rank (as
torchrun would) and gives each rank its own shard through a distributed sampler; each rank
trains its own replica and mixes it with its neighbours after every optimizer step.
Validation runs on the average of the ranks' models, and so does the test at the end.
"""

from __future__ import annotations

import argparse
import os

import lightning
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from learned_opt import LearnedOptimizer
from learned_opt.distributed import list_topologies
from learned_opt.distributed.lightning import MIXINGS, GossipStrategy


class DigitsClassifier(lightning.LightningModule):
    """A small MLP classifier for 8x8 digit images."""

    def __init__(self, optimizer: str = "learned", lr: float | None = None, epochs: int = 10):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
            nn.Linear(128, 10),
        )  # fmt: skip

    def forward(self, x):
        return self.net(x)

    def _step(self, batch, stage: str):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        on_epoch = stage != "train"
        self.log(f"{stage}/loss", loss, on_epoch=on_epoch, sync_dist=on_epoch, prog_bar=True)
        self.log(f"{stage}/acc", acc, on_epoch=on_epoch, sync_dist=on_epoch)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "learned":
            opt = LearnedOptimizer(self.parameters(), lr=hp.lr or 1.0)  # lr is a multiplier
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=hp.lr or 3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=hp.epochs)
        return [opt], [sched]


def digits_loaders(batch_size: int = 32, seed: int = 0):
    """Train/test loaders of the scikit-learn digits (1,797 images), pixels scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = perm[:1400], perm[1400:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
        DataLoader(TensorDataset(x[test], y[test]), batch_size=256),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", choices=["learned", "adam"], default="learned")
    p.add_argument("--mixing", choices=MIXINGS, default=None, help="default: learned / metropolis")
    p.add_argument("--topology", choices=list_topologies(), default="ring")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL)")
    p.add_argument("--start-method", choices=["popen", "spawn"], default="popen")
    p.add_argument("--logdir", default="runs/lightning_gossip")
    args = p.parse_args(argv)

    if args.accelerator == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    lightning.seed_everything(0)
    train, test = digits_loaders()
    model = DigitsClassifier(args.optimizer, epochs=args.epochs)
    mixing = args.mixing or ("learned" if args.optimizer == "learned" else "metropolis")
    strategy = GossipStrategy(args.topology, mixing, start_method=args.start_method)
    trainer = lightning.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=args.epochs,
        default_root_dir=args.logdir,
        log_every_n_steps=10,
        enable_progress_bar=False,
    )
    trainer.fit(model, train, test)
    result = trainer.test(model, test, verbose=False)  # the averaged model, on every rank
    log_dir = trainer.log_dir  # a collective: every rank asks
    if trainer.is_global_zero:
        print(
            f"optimizer={args.optimizer} mixing={mixing} "
            f"topology={args.topology} ranks={trainer.world_size} epochs={args.epochs} "
            f"test_loss={result[0]['test/loss']:.4f} test_acc={result[0]['test/acc']:.4f} "
            f"logs={log_dir}",
            flush=True,
        )


if __name__ == "__main__":
    main()
