"""One held-out long-run setting of ``local_steps`` on real gloo ranks, beside its simulation.

``python -m benchmarks.local_steps_real K`` (K: the index in
:data:`benchmarks.local_steps.HELDOUT`), after ``benchmarks.local_steps``: adds
``real_ranks`` to ``local_steps.json``. Exact gossip and the outer step (the best simulated
rule) run through the torchrun entry (:func:`~learned_opt.distributed.train.launched`),
and the outer step through the Lightning ``GossipStrategy(outer_step=...)``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from benchmarks.common import command_line, write_json
from benchmarks.local_steps import HELDOUT, INNER_LR, RESULTS
from learned_opt.distributed import launch_local
from learned_opt.distributed.train import launched


def lightning_rank(rank: int, world: int, s: dict, row: dict) -> dict:
    """One rank of the Lightning run (``GossipStrategy(outer_step)``): the averaged model's
    test loss and the bytes this rank sent."""
    import lightning
    from torch.utils.data import DataLoader, Dataset

    from learned_opt.distributed.lightning import GossipStrategy
    from learned_opt.tasks import get_task

    task = get_task(s["task"])
    batches = task.worker_batches(s["seed"], world, s["partition"], s["alpha"])

    class Steps(Dataset):  # item t: this rank's batch at step t of the entry's stream
        def __len__(self):
            return s["horizon"]

        def __getitem__(self, step):
            return batches.worker(step, rank)

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = task.module(torch.Generator().manual_seed(s["seed"]))

        def training_step(self, batch, batch_idx):
            return task.module_loss(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=INNER_LR)

    kw = {"local_steps": row["H"], "compression": row["compression"], "lr": row["lr"]}
    strategy = GossipStrategy(timeout=300, outer_step=row["rule"], outer_kwargs=kw)
    model = Model()
    trainer = lightning.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    loader = DataLoader(Steps(), batch_size=None, shuffle=False)
    trainer.fit(model, loader)
    loss = task.evaluate(task.params_of(model.net))["loss"]  # the average, at the end of fit
    return {"test_loss": loss, "bytes_per_rank": next(iter(strategy.rounds.values())).bytes_sent}


def main(argv: list[str] | None = None) -> int:
    k = int((argv if argv is not None else sys.argv[1:])[0])
    path = RESULTS / "local_steps.json"
    payload = json.loads(path.read_text())
    s, chosen = HELDOUT[k], payload["validation"]["chosen"]
    sim = [r for r in payload["heldout"]["rows"] if r["task"] == s["task"] and
           r["H"] == chosen["H"]]  # fmt: skip
    best = min(sim, key=lambda r: (not r["passes"], r["loss_ratio"]))
    argv_ = ["--task", s["task"], "--steps", str(s["horizon"]), "--topology", s["topology"],
             "--partition", s["partition"], "--alpha", str(s["alpha"]), "--seed", str(s["seed"]),
             "--optimizer", "adam", "--lr", str(INNER_LR), "--timeout", "300",
             "--metrics-every", str(s["horizon"])]  # fmt: skip
    mode = ["--outer-step", best["rule"], "--outer-lr", str(best["lr"]), "--local-steps",
            str(best["H"]), "--compression", best["compression"]]  # fmt: skip
    got = {}
    for name, run in (("exact", (launched, [*argv_, "--mixing", "metropolis"])),
                      ("torchrun", (launched, [*argv_, *mode])),
                      ("lightning", (lightning_rank, s, best))):  # fmt: skip
        start = time.perf_counter()
        res = launch_local(run[0], s["workers"], *run[1:], timeout=3600, pg_timeout=300)
        out = res[0]
        if "bytes_per_step" in out:
            out = {"test_loss": out["test_loss"],
                   "bytes_per_rank": out["bytes_per_step"] * s["horizon"]}  # fmt: skip
        got[name] = {**out, "seconds": round(time.perf_counter() - start, 1)}
        print(f"real ranks, {name}: {got[name]}", flush=True)
    exact = got["exact"]
    payload["real_ranks"] = {
        "setting": s, "rule": best["rule"], "lr": best["lr"], "H": best["H"],
        "compression": best["compression"], **got,
        "loss_ratio": {n: got[n]["test_loss"] / exact["test_loss"] for n in ("torchrun", "lightning")},
        "bytes_reduction_x": exact["bytes_per_rank"] / got["torchrun"]["bytes_per_rank"],
        "simulated": {"loss_ratio": best["loss_ratio"], "final": best["final"],
                      "exact_final": best["exact_final"],
                      "bytes_per_rank": best["bytes_per_rank"],
                      "exact_bytes_per_rank": best["exact_bytes_per_rank"]},
        "command": command_line("OMP_NUM_THREADS=1 nice -n 10 python -m "
                                "benchmarks.local_steps_real", [str(k)]),
    }  # fmt: skip
    write_json("local_steps", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
