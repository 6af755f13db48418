"""Worker functions for the Lightning strategy tests (importable by spawned processes).

Each rank of a ``launch_local`` group builds ``Trainer(strategy=GossipStrategy(...),
devices=N)``; Lightning sees an externally launched, already initialised group (as under
torchrun) and runs on it. The LightningModule trains ``digits_mlp`` on exactly the
per-rank batches the torchrun entry point draws, so the two can be compared.
"""

from __future__ import annotations

import csv
import os

import lightning
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from learned_opt import LearnedOptimizer
from learned_opt.distributed.lightning import CHECKPOINT_KEY, GossipStrategy
from learned_opt.distributed.train import launched
from learned_opt.tasks import get_task

TASK = "digits_mlp"
STEPS_PER_EPOCH = 25


class TaskSteps(Dataset):
    """Item ``t`` is this rank's batch at step ``t`` of the entry point's data stream."""

    def __init__(self, rank, world, seed=0, partition="dirichlet", alpha=0.1):
        self.batches = get_task(TASK).worker_batches(seed, world, partition, alpha)
        self.rank = rank

    def __len__(self):
        return 10**9

    def __getitem__(self, step):
        return self.batches.worker(step, self.rank)


class EpochSteps(Sampler):
    """Epoch ``e`` yields steps ``e*L .. (e+1)*L - 1``, so a resumed epoch continues the stream."""

    def __init__(self, steps_per_epoch):
        self.length, self.epoch = steps_per_epoch, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):  # a generator: the epoch is read at the first batch, after set_epoch
        yield from range(self.epoch * self.length, (self.epoch + 1) * self.length)

    def __len__(self):
        return self.length


class Digits(lightning.LightningModule):
    """digits_mlp as a user would wrap it; ``optimizer`` picks the local optimizer."""

    def __init__(self, optimizer="learned", schedule=False):
        super().__init__()
        self.task = get_task(TASK)
        self.net = self.task.module(torch.Generator().manual_seed(0))
        self.optimizer, self.schedule = optimizer, schedule
        self.val_params = []  # the parameter sum each validation sees
        self.hook_optimizers = set()  # what on_before_optimizer_step is given
        self.grad_norms = []  # the gradient norm after clipping, before the local step

    def training_step(self, batch, batch_idx):
        loss = self.task.module_loss(self.net, batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_params.append(param_sum(self))
        self.log("val/loss", self.task.module_loss(self.net, batch), sync_dist=True)

    def on_before_optimizer_step(self, optimizer):
        self.hook_optimizers.add(type(optimizer).__name__)

    def configure_optimizers(self):
        if self.optimizer == "learned":
            opt = LearnedOptimizer(self.parameters())
        else:
            opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        if not self.schedule:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def configure_gradient_clipping(self, optimizer, **kwargs):
        super().configure_gradient_clipping(optimizer, **kwargs)
        grads = [p.grad.double().norm() for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.stack(grads).norm()))


class RankDigits(Digits):
    """Digits whose module builds each rank's loader itself (for ``start_method="spawn"``)."""

    def train_dataloader(self):
        return loader(self.global_rank, self.trainer.world_size)


class ManualDigits(Digits):
    """Digits with manual optimization: the user calls the optimizer's step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.task.module_loss(self.net, batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def param_sum(model):
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def loader(rank, world, steps_per_epoch=STEPS_PER_EPOCH):
    steps = EpochSteps(steps_per_epoch)
    return DataLoader(TaskSteps(rank, world), batch_size=None, sampler=steps)


def val_loader():
    data = get_task(TASK).data
    return DataLoader(TensorDataset(data.x_test, data.y_test), batch_size=1024)


def trainer(root, world, epochs, strategy=None, **kw):
    return lightning.Trainer(
        strategy=strategy or GossipStrategy("ring", "learned", timeout=120),
        accelerator="cpu",
        devices=world,
        max_epochs=epochs,
        default_root_dir=root,
        logger=lightning.pytorch.loggers.CSVLogger(root, name="logs"),
        log_every_n_steps=5,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def _averaged_train_loss(model):
    return model.task.evaluate(model.task.params_of(model.net), split="train")["loss"]


def _rank_states(path):
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt[CHECKPOINT_KEY], ckpt["state_dict"]


def suite(rank, world, root, epochs):
    """Every Lightning check on one set of ranks (starting the ranks is the slow part)."""
    out = parity_and_resume(rank, world, root, epochs)
    out["features"] = features(rank, world, root)
    out["allreduce"] = allreduce(rank, world, root)
    out["manual"] = manual(rank, world, root)
    return out


def parity_and_resume(rank, world, root, epochs):
    """Entry point, an uninterrupted Lightning run, and one stopped half-way and resumed."""
    steps = epochs * STEPS_PER_EPOCH
    argv = ["--task", TASK, "--steps", str(steps), "--optimizer", "learned"]
    entry = launched(rank, world, [*argv, "--mixing", "learned", "--topology", "ring"])
    out = {"entry": entry["averaged_model_train_loss"]}

    full = Digits()
    trainer(f"{root}/full", world, epochs).fit(full, loader(rank, world), val_loader())
    out["full"] = _averaged_train_loss(full)
    opt = full.trainer.optimizers[0]  # built without a checkpoint: the shipped rule
    rule = os.path.splitext(os.path.basename(opt.checkpoint_path))[0]
    bounded = opt.config_transform is not None and (
        opt.config_transform(opt.config) == opt.net.mixing.under_gossip(opt.config)
    )
    out["full_rule"] = (rule, bounded)
    out["full_params"] = [p.detach().clone() for p in full.parameters()]
    out["val_params"] = full.val_params

    half = Digits()
    trainer(f"{root}/half", world, epochs // 2).fit(half, loader(rank, world), val_loader())
    ckpt = _only_checkpoint(f"{root}/half")
    resumed = Digits()
    trainer(f"{root}/resumed", world, epochs).fit(
        resumed, loader(rank, world), val_loader(), ckpt_path=ckpt
    )
    out["resumed"] = _averaged_train_loss(resumed)
    out["resumed_params"] = [p.detach().clone() for p in resumed.parameters()]
    if rank == 0:
        out["full_ckpt"] = _rank_states(_only_checkpoint(f"{root}/full"))
        out["resumed_ckpt"] = _rank_states(_only_checkpoint(f"{root}/resumed"))
        out["metrics"] = _logged(f"{root}/full")
    return out


def features(rank, world, root, batches=8, epochs=2):
    """Adam with learned mixing, a scheduler, clipping, accumulation and bf16-mixed; the model
    is not averaged at the end, so each rank keeps its own."""
    strategy = GossipStrategy(
        "exponential", "learned", timeout=120, metrics_every=1, average_at_end=False
    )
    model = Digits(optimizer="adam", schedule=True)
    run = trainer(
        f"{root}/features",
        world,
        epochs,
        strategy=strategy,
        gradient_clip_val=0.05,
        accumulate_grad_batches=2,
        precision="bf16-mixed",
    )
    run.fit(model, loader(rank, world, batches), val_loader())
    return {
        "gossip_steps": [g.step_count for g in strategy.gossips.values()],
        "global_step": run.global_step,
        "lr": run.optimizers[0].param_groups[0]["lr"],
        "hook_optimizers": sorted(model.hook_optimizers),
        "grad_norms": model.grad_norms,
        "val_params": model.val_params,
        "own_params": param_sum(model),
        "metrics": _logged(f"{root}/features") if rank == 0 else None,
    }


def allreduce(rank, world, root, batches=6):
    """Plain data parallel: gradients averaged, so the ranks stay identical."""
    strategy = GossipStrategy(
        mixing="allreduce", timeout=120, metrics_every=1, average_at_end=False
    )
    model = Digits(optimizer="adam")
    run = trainer(f"{root}/allreduce", world, 1, strategy=strategy, accumulate_grad_batches=2)
    run.fit(model, loader(rank, world, batches))
    return {"params": [p.detach().clone() for p in model.parameters()]}


def manual(rank, world, root, batches=4):
    """Manual optimization: each ``opt.step()`` in ``training_step`` is a gossip step."""
    strategy = GossipStrategy("ring", timeout=120, average_at_end=False)
    model = ManualDigits()
    before = param_sum(model)
    trainer(f"{root}/manual", world, 1, strategy=strategy).fit(model, loader(rank, world, batches))
    steps = [g.step_count for g in strategy.gossips.values()]
    return {"gossip_steps": steps, "changed": param_sum(model) != before}


def _only_checkpoint(root):
    found = [
        os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".ckpt")
    ]
    assert len(found) == 1, found
    return found[0]


def _logged(root):
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f == "metrics.csv"]
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows if r.get(k)] for k in rows[0]}
