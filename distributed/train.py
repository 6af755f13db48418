"""Decentralized training of a task from ``learned_opt.tasks``: the torchrun entry point.

    torchrun --standalone --nproc_per_node=4 -m learned_opt.distributed.train \\
        --task digits_mlp --optimizer learned --topology ring --steps 300

Each rank trains its own copy of the model on its shard of the data (``--partition``),
then gossips with its neighbours (``--mixing``), or averages gradients with all_reduce
(``--mixing allreduce``: plain data parallel, for comparison). At the end the ranks'
models are averaged and evaluated; the lowest surviving rank prints a one-line summary.
A rank that dies or freezes is dropped and the others train on (``--on-failure raise``
stops them instead; ``--kill-rank R --kill-step S`` injects such a failure). Note that
torchrun itself stops every worker when one exits with an error; the survivors train on
under launchers that leave them running (``launch_local``) and through frozen ranks.
``--local-steps H`` takes H local steps between exchanges instead (DiLoCo class,
:class:`~.local_steps.LocalSteps`: the anchors' and the tracked pseudo-gradients'
differences, compressed by ``--compression``, then an outer step, ``--outer``).
``--outer-step RULE`` (``nesterov``, ``learned``, ``demo``) takes local steps, then one
compressed outer step shared by all ranks (:class:`~.outer.OuterStep`, an all-gather).
``--overlap`` moves the exchange behind the next forward and backward pass;
``--step-deadline S`` waits at most S seconds for a neighbour, and mixes a late exchange
when it arrives. With CUDA, a rank uses ``cuda:(LOCAL_RANK mod GPUs)``, and NCCL when every
local rank has a GPU of its own, else gloo (which passes device tensors through host
memory); without CUDA, gloo on CPU. ``--backend`` overrides the choice. Per-rank
TensorBoard logs go to ``--logdir``. Without torchrun it runs as a single worker.

This module sits on top of the package: it is the only one in ``distributed/`` that
imports ``learned_opt.tasks``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from learned_opt import LearnedOptimizer, load_checkpoint
from learned_opt.checkpoint import DEFAULT_CHECKPOINT, CheckpointError
from learned_opt.helptext import PlainHelpFormatter

from .averaging import all_reduce_mean_
from .compression import default_consensus_step, get_compressor
from .gossip import GossipOptimizer, fused_where_supported
from .local_steps import LocalSteps, nesterov
from .mixing import parse_robust
from .outer import DEFAULT_COMPRESSION, DEFAULT_LOCAL_STEPS, OUTER_RULES, OuterStep, outer_rule
from .process_group import ProcessGroupCommunicator
from .topology import get_topology, list_topologies

#: What a core-only install (no ``[tasks]`` extra) prints instead of a traceback per rank.
TASKS_EXTRA = (
    "learned-opt train needs the tasks extra ({} is missing): "
    "pip install -e '.[tasks]' in the learned-opt checkout"
)


def _missing_extra(module: str) -> SystemExit:
    """Exit with one line on rank 0 (and silently on the others) naming the extra to install."""
    if os.environ.get("RANK", "0") == "0":
        print(TASKS_EXTRA.format(module), file=sys.stderr, flush=True)
    return SystemExit(1)


try:
    from learned_opt.tasks import PARTITION_SCHEMES, get_task, list_tasks
except ImportError as exc:  # numpy, which the tasks import at once
    raise _missing_extra(exc.name or "numpy") from None


def require_tasks_extra() -> None:
    """Exit with one line unless scikit-learn, which the tasks' datasets need, imports."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise _missing_extra("scikit-learn") from None


DEFAULT_LR = {"learned": 1.0, "adam": 1e-3, "sgd": 0.1}
#: ``--outer`` rules of ``--local-steps`` and their default ``--outer-lr``.
OUTER_LR = {"sgd": 1.0, "nesterov": 0.7}


class _ArgumentParser(argparse.ArgumentParser):
    """Under torchrun every rank parses the same arguments: only rank 0 prints the error
    (one line after the usage); every rank exits with code 2."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            self.print_usage()
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every mistake an argument can hold, found before any training or communication."""
    if args.task not in list_tasks():
        p.error(f"--task: unknown task {args.task!r}; valid: {list_tasks()}")
    if args.partition not in PARTITION_SCHEMES:
        p.error(f"--partition: must be one of {list(PARTITION_SCHEMES)}, got {args.partition!r}")
    for name, value in (
        ("steps", args.steps),
        ("metrics-every", args.metrics_every),
        ("share-state-every", args.share_state_every),
    ):
        if value < 1:
            p.error(f"--{name} must be >= 1, got {value}")
    for name, value in (("alpha", args.alpha), ("timeout", args.timeout)):
        if not value > 0:
            p.error(f"--{name} must be > 0, got {value}")
    if args.lr is not None and not (0 <= args.lr < float("inf")):
        p.error(f"--lr must be finite and >= 0, got {args.lr}")
    topology = None  # known where the launcher says how many ranks there are
    if "WORLD_SIZE" in os.environ:
        try:
            topology = get_topology(args.topology, int(os.environ["WORLD_SIZE"]))
        except ValueError as exc:
            p.error(f"--topology: {exc}")
    if "learned" in (args.optimizer, args.mixing):
        try:
            load_checkpoint(args.checkpoint)
        except CheckpointError as exc:
            p.error(f"--checkpoint: {exc}")
    if args.compression is not None:
        try:
            get_compressor(args.compression)
        except ValueError as exc:
            p.error(f"--compression: {exc}")
    if args.consensus_step is not None and not 0 < args.consensus_step <= 1:
        p.error(f"--consensus-step must be in (0, 1], got {args.consensus_step}")
    if args.drift_correction is not None:
        gamma = args.consensus_step
        if gamma is None and args.compression is not None:
            gamma = default_consensus_step(args.compression)
        bound = 1.0 if gamma is None else gamma
        if not 0 <= args.drift_correction <= bound:
            p.error(
                f"--drift-correction must be in [0, {bound}] (at most the consensus step), "
                f"got {args.drift_correction}"
            )
    if args.step_deadline is not None:
        if not 0 < args.step_deadline < args.timeout:
            p.error(f"--step-deadline must be in (0, --timeout), got {args.step_deadline}")
        if args.compression is not None or args.overlap:
            p.error("--step-deadline goes with neither --compression nor --overlap")
    try:
        parse_robust(args.robust)
    except ValueError as exc:
        p.error(f"--robust: {exc}")
    if (args.kill_rank is None) != (args.kill_step is None):
        p.error("--kill-rank and --kill-step go together")
    if args.local_steps is not None:
        if args.local_steps < 1:
            p.error(f"--local-steps must be >= 1, got {args.local_steps}")
        clash = [flag for flag, on in (("--mixing allreduce", args.mixing == "allreduce"),
                 ("--mixing learned", args.mixing == "learned"), ("--overlap", args.overlap),
                 ("--step-deadline", args.step_deadline is not None),
                 ("--robust", args.robust is not None)) if on]  # fmt: skip
        if clash:
            p.error(f"--local-steps mixes with Metropolis or uniform weights; not with {clash[0]}")
        unset = (args.consensus_step, args.drift_correction)
        if args.compression is None and any(v is not None for v in unset):
            p.error("--local-steps: --consensus-step and --drift-correction need --compression")
        static = args.outer_step is not None  # the shared outer step gathers from every rank
        if topology is not None and args.compression and topology.period != 1 and not static:
            p.error(
                f"--local-steps with --compression needs a static topology; {args.topology} "
                f"changes every step (period {topology.period})"
            )
        if args.outer_step is not None and args.outer is not None:
            p.error("--outer goes with the anchors' gossip; --outer-step is the shared outer step")
    elif args.outer is not None or args.outer_lr is not None:
        p.error("--outer and --outer-lr go with --local-steps")
    if args.outer_lr is not None and not 0 < args.outer_lr < float("inf"):
        p.error(f"--outer-lr must be finite and > 0, got {args.outer_lr}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``), all checked: a mistake prints one line and
    exits with code 2."""
    p = _ArgumentParser(
        prog="python -m learned_opt.distributed.train",
        description=__doc__.split("\n")[0],
        formatter_class=PlainHelpFormatter,
    )
    p.add_argument(
        "--task", default="digits_mlp", help="a name from learned_opt.tasks.list_tasks()"
    )
    p.add_argument("--optimizer", choices=["learned", "adam", "sgd"], default="learned")
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="learned optimizer checkpoint")
    p.add_argument("--topology", choices=list_topologies(), default="ring")
    p.add_argument(
        "--mixing",
        choices=["learned", "metropolis", "uniform", "allreduce"],
        default=None,
        help="default: learned for --optimizer learned, else metropolis",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="default: 1.0 (learned multiplier), 1e-3 (adam), 0.1 (sgd)",
    )
    p.add_argument("--partition", default="dirichlet", help="iid or dirichlet (label skew)")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may wait")
    p.add_argument(
        "--on-failure",
        choices=["exclude", "raise"],
        default="exclude",
        help="a dead or frozen rank: drop it and train on (exclude), or stop every rank (raise)",
    )
    p.add_argument(
        "--kill-rank",
        type=int,
        default=None,
        help="fault injection: this rank exits at --kill-step",
    )
    p.add_argument("--kill-step", type=int, default=None, help="step at which --kill-rank exits")
    p.add_argument(
        "--backend", choices=["auto", "nccl", "gloo"], default="auto", help="see default_backend()"
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="exchange while the next forward/backward runs (combine-then-adapt variant)",
    )
    p.add_argument(
        "--compression", default=None, help="topk:R, sign or int8 (error feedback; exact average)"
    )
    p.add_argument(
        "--consensus-step",
        type=float,
        default=None,
        help="gamma of the compressed mix (default: min(0.5, 4R) for topk:R, else 0.5)",
    )
    p.add_argument(
        "--drift-correction",
        type=float,
        default=None,
        help="integral step of the compressed mix's drift correction, 0 = off "
        "(default: R/20 for topk:R, else 0)",
    )
    p.add_argument(
        "--step-deadline",
        type=float,
        default=None,
        help="seconds a step waits for a slow neighbour; a late exchange is mixed when it arrives",
    )
    p.add_argument(
        "--robust", default=None, help="clip or clip:C: clip each neighbour's difference"
    )
    p.add_argument(
        "--no-share-state",
        dest="share_state",
        action="store_false",
        default=None,
        help="do not mix the learned optimizer's moments (v and m) with the parameters "
        "(shared by default, without --compression)",
    )
    p.add_argument(
        "--share-state-every",
        type=int,
        default=2,
        help="with the moments shared: one exchange of every k carries them (default 2)",
    )
    p.add_argument(
        "--local-steps",
        type=int,
        default=None,
        help="H: local steps between compressed exchanges with an outer step (DiLoCo class)",
    )
    p.add_argument(
        "--outer",
        choices=sorted(OUTER_LR),
        default=None,
        help="with --local-steps: the outer rule, sgd (the default: at lr 1 it moves the "
        "anchor by the tracked mean pseudo-gradient) or nesterov (DiLoCo's)",
    )
    p.add_argument(
        "--outer-lr", type=float, default=None, help="default: 1.0 (sgd), 0.7 (nesterov)"
    )
    p.add_argument(
        "--outer-step",
        choices=OUTER_RULES,
        default=None,
        help="local steps, then one compressed outer step shared by all ranks (DiLoCo/DeMo "
        f"class) by this rule; --local-steps defaults to {DEFAULT_LOCAL_STEPS}, --compression "
        f"to {DEFAULT_COMPRESSION}",
    )
    p.add_argument("--metrics-every", type=int, default=10, help="consensus distance every k steps")
    p.add_argument("--logdir", default=None, help="TensorBoard folder (one subfolder per rank)")
    args = p.parse_args(argv)
    if args.outer_step is not None:
        args.local_steps = DEFAULT_LOCAL_STEPS if args.local_steps is None else args.local_steps
        args.compression = args.compression or DEFAULT_COMPRESSION
    if args.mixing is None:
        learned = args.optimizer == "learned" and args.local_steps is None
        args.mixing = "learned" if learned else "metropolis"
    _check_args(p, args)
    return args


def _local_optimizer(args, params):
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    if args.optimizer == "learned":
        return LearnedOptimizer(params, checkpoint=args.checkpoint, lr=lr)
    params, fused = fused_where_supported(params)
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, **fused)
    return torch.optim.SGD(params, lr=lr, **fused)


def _outer(args):
    """The ``--outer`` rule of ``--local-steps``, as :class:`~.local_steps.LocalSteps` takes it."""
    outer = args.outer or "sgd"
    lr = args.outer_lr if args.outer_lr is not None else OUTER_LR[outer]
    if outer == "nesterov":
        return nesterov(lr)
    return lambda anchors: torch.optim.SGD(anchors, lr=lr)


def local_device() -> torch.device:
    """This rank's device: ``cuda:(LOCAL_RANK mod GPUs)`` where CUDA is available, else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def default_backend() -> str:
    """NCCL when every local rank has a GPU of its own (NCCL refuses two ranks on one GPU),
    else gloo."""
    if not torch.cuda.is_available():
        return "gloo"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return "nccl" if local_ranks <= torch.cuda.device_count() else "gloo"


def train(args: argparse.Namespace) -> dict:
    """Train on this rank (the process group must be initialised); returns the summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device()
    task = get_task(args.task)
    module = task.module(torch.Generator().manual_seed(args.seed)).to(device)
    params = list(module.parameters())
    data = task.batches(
        worker=rank,
        num_workers=world,
        partition=args.partition,
        alpha=args.alpha,
        seed=args.seed,
        device=device,
    )
    topology = get_topology(args.topology, world)
    comm = ProcessGroupCommunicator(
        topology,
        timeout=args.timeout,
        on_failure=args.on_failure,
        # local steps compress their own rounds, through an exact exchange
        compression=None if args.mixing == "allreduce" or args.local_steps else args.compression,
        consensus_step=None if args.local_steps else args.consensus_step,
        drift_correction=None if args.local_steps else args.drift_correction,
        step_deadline=None if args.mixing == "allreduce" else args.step_deadline,
        robust=args.robust,
    )
    local = _local_optimizer(args, params)
    writer = None
    if args.logdir:
        from torch.utils.tensorboard import SummaryWriter  # only when logging is asked for

        writer = SummaryWriter(os.path.join(args.logdir, f"rank{rank}"))
    rounds = None
    if args.outer_step:
        opt = local
        factory, decay = outer_rule(args.outer_step, args.outer_lr)
        rounds = OuterStep(params, factory, local_steps=args.local_steps, rank=rank,
                           world_size=world, compression=args.compression, decay=decay)  # fmt: skip
    elif args.local_steps:
        opt = local
        rounds = LocalSteps(
            params,
            _outer(args),
            local_steps=args.local_steps,
            topology=topology,
            rank=rank,
            compression=args.compression,
            consensus_step=args.consensus_step,
            drift_correction=args.drift_correction,
            rule=args.mixing,
            communicator=comm,
        )
    elif args.mixing == "allreduce":
        opt = local
        comm.check_layout([p.detach() for p in params])
    else:
        net = None
        if args.mixing == "learned" and args.optimizer != "learned":
            net = load_checkpoint(args.checkpoint)[0]  # the checkpoint's edge head mixes
        opt = GossipOptimizer(
            local,
            communicator=comm,
            mixing=args.mixing,
            net=net,
            metrics_every=args.metrics_every,
            writer=writer,
            overlap=args.overlap,
            share_state=args.share_state,
            share_state_every=args.share_state_every,
        )
    start, losses, sent = time.perf_counter(), [], 0
    for step in range(args.steps):
        if rank == args.kill_rank and step == args.kill_step:
            os._exit(1)  # fault injection: die without a word, as a crashed worker does
        opt.zero_grad()
        loss = task.module_loss(module, next(data))
        loss.backward()
        if args.mixing == "allreduce":
            grads = [p.grad for p in params if p.grad is not None]
            sent += all_reduce_mean_(grads, comm, step, "gradient all_reduce")
        if isinstance(opt, GossipOptimizer):
            opt.step(loss=loss.detach())  # the batch loss feeds the learned mixing
            sent += comm.bytes_sent
        else:
            opt.step()
        if rounds is not None:
            rounds.step()  # a round after every --local-steps steps
        losses.append(float(loss.detach()))
        if writer is not None:
            writer.add_scalar("train/loss", losses[-1], step)
    if isinstance(opt, GossipOptimizer):
        opt.flush()  # mix in what --overlap or --step-deadline left in flight
    if rounds is not None:
        rounds.flush()  # a last, shorter round where --steps is not a multiple of H
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        ys = [p.detach() for p in params]
        consensus = float(comm.consensus_distance(ys, args.steps))
        tail = torch.tensor(
            [sum(losses[-10:]) / len(losses[-10:])], dtype=torch.float64, device=device
        )
        comm.all_reduce(tail, args.steps, "final loss all_reduce")
        averaged = {name: p.detach().clone() for name, p in module.named_parameters()}
        all_reduce_mean_(averaged.values(), comm, args.steps, "model averaging all_reduce")
    metrics = task.evaluate(averaged)
    averaged_train_loss = task.evaluate(averaged, split="train")["loss"]
    summary = {
        "task": args.task,
        "optimizer": args.optimizer,
        "mixing": args.mixing,
        "topology": args.topology,
        "compression": args.compression,
        "drift_correction": getattr(rounds, "beta", 0.0) if rounds else comm.drift_correction,
        "local_steps": args.local_steps,
        "outer_step": args.outer_step,
        "workers": world,
        "steps": args.steps,
        "survivors": comm.members,
        "failures": [f.as_dict() for f in comm.failures],
        "train_loss": float(tail) / comm.world_size,
        "averaged_model_train_loss": averaged_train_loss,
        **{f"test_{k}": v for k, v in metrics.items()},
        "consensus_distance": consensus,
        "bytes_per_step": (sent if rounds is None else rounds.bytes_sent) / args.steps,
        "seconds": elapsed,
    }
    if writer is not None:
        for k, v in metrics.items():
            writer.add_scalar(f"eval/{k}", v, args.steps)
        writer.close()
    return summary


def format_summary(s: dict) -> str:
    """The one-line summary rank 0 prints."""
    acc = f" test_acc={s['test_accuracy']:.4f}" if "test_accuracy" in s else ""
    return (
        f"task={s['task']} optimizer={s['optimizer']} mixing={s['mixing']} "
        f"topology={s['topology']} workers={s['workers']} steps={s['steps']} "
        + (f"local_steps={s['local_steps']} " if s.get("local_steps") else "")
        + f"train_loss={s['train_loss']:.4f} test_loss={s['test_loss']:.4f}{acc} "
        f"consensus={s['consensus_distance']:.3g} bytes/step={s['bytes_per_step']:,.0f} "
        f"time={s['seconds']:.1f}s"
        + (f" lost={[f['rank'] for f in s['failures']]}" if s["failures"] else "")
    )


def main(argv: list[str] | None = None) -> dict:
    """Entry point: joins (or creates) the process group, trains, prints, cleans up."""
    require_tasks_extra()
    args = parse_args(argv)
    created = False
    if not dist.is_initialized():
        timeout = timedelta(seconds=args.timeout)
        if "WORLD_SIZE" in os.environ:  # torchrun
            if torch.cuda.is_available():
                torch.cuda.set_device(local_device())
            backend = default_backend() if args.backend == "auto" else args.backend
            dist.init_process_group(backend, timeout=timeout)
        else:  # a single worker, no launcher
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        created = True
    summary = None
    try:
        summary = train(args)
        if dist.get_rank() == summary["survivors"][0]:
            print(format_summary(summary), flush=True)
        return summary
    finally:
        if created:
            gc.collect()  # the run's objects (pending gloo work among them) before the group
            if summary is not None and not summary["failures"]:
                # every rank done with the group before any closes its connections: a
                # gloo rank whose peer tore down first could abort at exit
                dist.barrier()
            dist.destroy_process_group()


def launched(rank: int, world_size: int, argv: list[str]) -> dict:
    """For :func:`~learned_opt.distributed.launch.launch_local`: train with ``argv``."""
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
