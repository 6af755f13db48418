"""Local steps and one compressed outer step shared by all ranks (DiLoCo, DeMo, SparseLoCo).

Each rank trains on its own for ``H`` local steps, then takes one *round*. Per rank ``i``
and parameter tensor (``x_i`` the trained parameters, ``xa`` the anchor, the same on every
rank)::

    D_i  = xa - x_i                          the pseudo-gradient of the H local steps
    b_i  = decay * b_i + D_i                 error feedback (decay 1) or DeMo's decoupled
                                             momentum (decay < 1)
    q_i  = C(b_i);   b_i -= q_i              send the compressed part, keep the rest
    g    = (1/N) sum_j q_j                   every rank decodes every rank's q_j, in rank order
    xa   = outer(xa, grad=g);   x_i = xa     the same outer step on every rank

Every rank sends its ``q_i`` to every other (an all-gather; counted as a ring all-gather
sends it: ``N - 1`` payloads per rank and round, on any topology that holds a ring).
Since every rank applies the same ``g`` in the same order of float operations, the anchors
stay bitwise equal and the averaged model *is* the anchor: there is no consensus error for
the compression to slow, unlike gossip of the anchors (:mod:`.local_steps`). What ``C``
drops stays in ``b_i`` and is sent later.

Outer rules (:func:`outer_rule`):

- ``"nesterov"``: DiLoCo's, SGD with Nesterov momentum, on error feedback;
- ``"learned"``: DeMo's move, each tensor's sized by the shipped rule's per-tensor
  step-size adaptation (:class:`AdaptedOuter`), on DeMo's decoupled momentum buffer;
- ``"demo"``: decoupled momentum as in DeMo: ``b_i`` is the momentum itself (decay 0.9),
  its compressed part is what moves the anchor (plain SGD on the mean; DeMo itself steps by
  the sign of the aggregate), the rest keeps building.

Compressors: any of :mod:`.compression`; the mode's default is :data:`DEFAULT_COMPRESSION`
(top-k at 5 % with 4-bit values). Bytes are counted in the encoding sent: indices (sorted,
in :mod:`.indices`' code; for random-k its seed), packed values and scales
(:class:`OuterStep.bytes_sent`), the length of the buffer :meth:`OuterStep.step` gathers.

Two drivers run the same per-rank object, :class:`OuterStep`: the single-process
simulator (:class:`~.local_steps.SimulatedLocalSteps` with ``kind=OuterStep``) and a real
rank, :meth:`OuterStep.step` after every inner step (``torch.distributed.all_gather`` of
the packed payload).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from learned_opt import load_checkpoint
from learned_opt.checkpoint import DEFAULT_CHECKPOINT
from learned_opt.config import MOMENTUM_DECAYS, SECOND_MOMENT_DECAY, NetConfig
from learned_opt.features import adapt_log_lr

from .compression import get_compressor
from .indices import PayloadError

#: The outer rules of the mode, in the order they are reported.
OUTER_RULES = ("nesterov", "learned", "demo")
#: The mode's defaults, one for every setting, chosen on the validation settings of
#: ``benchmarks/local_steps.py`` (H in 10, 25; top-k 2 or 5 % with 4-bit values; the lowest
#: worst loss ratio among those sending >= 100x fewer bytes than exact per-step gossip):
#: the local steps between rounds and the compressor.
DEFAULT_LOCAL_STEPS = 25
DEFAULT_COMPRESSION = "topk:0.05:4"
#: Outer learning rates (chosen there too, at the defaults above) and buffer decays.
#: The learned rule's 1 is not tuned: DeMo's rate, with the adaptation's multiplier on it.
OUTER_LR = {"nesterov": 0.1, "learned": 1.0, "demo": 1.0}
DECAY = {"nesterov": 1.0, "learned": 0.9, "demo": 0.9}
#: The ceiling of :class:`AdaptedOuter`'s log multiplier: 0, the adaptation only shrinks a
#: tensor's move. Chosen on the validation settings of ``benchmarks/local_steps.py`` (H 25,
#: top-k 5 % at 4 bits) among 0, 0.5 and 1 by the worst loss ratio against exact gossip:
#: 1.03x, 1.25x and 1.16x (larger moves fit the label-skewed conv net's training set
#: further and its test loss rose).
LEARNED_CEILING = 0.0


def outer_rule(name: str, lr: float | None = None):
    """``(factory, decay)`` of the outer rule ``name`` (see the module doc); ``lr`` defaults
    to :data:`OUTER_LR`. The factory builds a rank's optimizer over its anchors."""
    if name not in OUTER_RULES:
        raise ValueError(f"unknown outer rule {name!r}; choose one of {OUTER_RULES}")
    lr = OUTER_LR[name] if lr is None else lr
    if not 0 < lr < float("inf"):
        raise ValueError(f"outer lr must be finite and > 0, got {lr}")
    if name == "nesterov":
        return (lambda a: torch.optim.SGD(a, lr=lr, momentum=0.9, nesterov=True)), DECAY[name]
    if name == "demo":
        return (lambda a: torch.optim.SGD(a, lr=lr)), DECAY[name]
    config = load_checkpoint(DEFAULT_CHECKPOINT)[0].config
    return (lambda a: AdaptedOuter(a, config=config, lr=lr, ceiling=LEARNED_CEILING)), DECAY[name]


class AdaptedOuter(torch.optim.Optimizer):
    """The learned rule's per-tensor step-size adaptation as an outer optimizer.

    Each round moves a tensor by the averaged compressed pseudo-gradient ``g`` itself
    (DeMo's move, on DeMo's decoupled momentum buffer) times a multiplier that the rule's
    adaptation (:func:`~learned_opt.features.adapt_log_lr`, with the shipped rule's rate,
    floor and brake) keeps per tensor::

        log_lr <- adapt_log_lr(cos(g_t, m_{t-1}), ...)  within [lr_adapt_min, ceiling]
        x <- x - lr * exp(log_lr) * g_t

    where ``m`` is the 0.9 momentum of the rounds' ``g``: a tensor whose successive
    pseudo-gradients disagree takes smaller moves. The rule's own step (its
    direction normalised or orthogonalised, sized for one gradient) was the outer step
    before; on the validation LM it ended at 2.04 against 1.89 for Nesterov at its best
    rate and 1.69 for DeMo: the compressed pseudo-gradient's exact values carry what a
    normalised direction loses. ``ceiling`` (:data:`LEARNED_CEILING`) bounds the log
    multiplier from above. A tensor whose ``g`` is not finite stays where it is, its state
    unchanged; ``lr`` is a param-group value, so schedulers work."""

    def __init__(self, params, *, config: NetConfig, lr: float = 1.0, ceiling: float = 0.0):
        super().__init__(list(params), dict(lr=lr))
        self.config, self.ceiling = config, float(ceiling)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or not bool(torch.isfinite(g).all()):
                    continue
                g = g.detach().float()
                state = self.state[p]
                if not state:
                    state.update(m=torch.zeros_like(g), v=g.new_zeros(()),
                                 log_lr=g.new_zeros(()), step=0)  # fmt: skip
                state["step"] += 1
                m, step = state["m"], state["step"]
                state["v"] = (
                    SECOND_MOMENT_DECAY * state["v"] + (1 - SECOND_MOMENT_DECAY) * g.pow(2).mean()
                )
                state["log_lr"] = adapt_log_lr(
                    state["log_lr"], (g * m).sum(), g.pow(2).sum(), m.pow(2).sum(), state["v"],
                    g.new_tensor(float(g.numel())), step, self.config, 1.0, self.ceiling,
                )  # fmt: skip
                m.mul_(MOMENTUM_DECAYS[0]).add_(g, alpha=1 - MOMENTUM_DECAYS[0])
                size = group["lr"] * float(torch.exp(state["log_lr"]))
                p.sub_(g.to(p.dtype), alpha=size)
        return loss


def wire(payload: list[Tensor]) -> Tensor:
    """The one uint8 buffer a rank sends: its payload's tensors, byte for byte, in order."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in payload])


def unwire(buf: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The tensors of a received :func:`wire` buffer, laid out as ``like`` (every rank's
    payload has the same dtypes and lengths)."""
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        raw = buf[offset : offset + n].clone()  # aligned for the view
        out.append(raw.view(t.dtype).view(t.shape))
        offset += n
    return out


class OuterStep:
    """One rank's anchor, buffer ``b_i``, compressor and outer optimizer (see the module doc).

    Args:
        params: this rank's parameter tensors (trained in place by the inner optimizer;
            a round writes the new anchor into them). Every rank starts from the same.
        outer: builds the outer optimizer over the anchors (:func:`outer_rule`'s factory).
        local_steps: ``H``, >= 1.
        rank: this rank.
        world_size: the ranks taking part (or ``topology``'s, which is not used otherwise).
        compression: a spec of :func:`~.compression.get_compressor`.
        decay: the buffer's decay, in (0, 1]: 1 is error feedback, below 1 DeMo's momentum.
        group: the ``torch.distributed`` group of :meth:`step` (None: the default group).

    ``bytes_sent`` counts the bytes this rank has sent; ``rounds`` the rounds taken.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        outer,
        *,
        local_steps: int,
        rank: int,
        world_size: int | None = None,
        topology=None,
        compression: str = DEFAULT_COMPRESSION,
        decay: float = 1.0,
        group=None,
    ):
        if world_size is None and topology is not None:
            world_size = topology.world_size  # the all-gather needs no more of it
        if world_size is None:
            raise ValueError("OuterStep needs world_size (or a topology)")
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the {world_size} ranks")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.params = list(params)
        if not self.params:
            raise ValueError("OuterStep got no parameters")
        self.compressor = get_compressor(compression)
        self.local_steps, self.world_size, self.rank = local_steps, world_size, rank
        self.compression, self.decay, self.group = compression, decay, group
        self.count = self.rounds = self.bytes_sent = 0
        self.anchors = [p.detach().clone().requires_grad_(True) for p in self.params]
        self.outer = outer(self.anchors)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ValueError(f"outer must build a torch.optim.Optimizer, got {type(self.outer)}")
        self.buffers = [torch.zeros_like(p.detach()) for p in self.params]
        self._sent: list[Tensor] = []

    @property
    def neighbors(self) -> list[int]:
        """Every other rank: each receives this rank's payload."""
        return [j for j in range(self.world_size) if j != self.rank]

    def correct(self) -> None:
        """Nothing to add between rounds (the simulator's driver calls it every step)."""

    @torch.no_grad()
    def encode(self, steps: int | None = None) -> list[Tensor]:
        """The round's first half: what this rank sends to every other (counted in
        ``bytes_sent``). ``steps`` is accepted for the simulator's driver."""
        payload = []
        for a, p, b in zip(self.anchors, self.params, self.buffers):
            b.mul_(self.decay).add_(a.detach() - p.detach())
            q = self.compressor.compress(b)
            sent = torch.zeros_like(b)
            self.compressor.add_(sent, q)
            b.sub_(sent)
            payload += q
        self._sent = payload
        self.bytes_sent += (self.world_size - 1) * wire(payload).numel()
        return payload

    @torch.no_grad()
    def finish(self, received: dict[int, list[Tensor]]) -> None:
        """The round's second half: decode every rank's payload (``{rank: payload}`` of the
        others), average, take the outer step and restart from the anchor."""
        if sorted(received) != self.neighbors:
            raise RuntimeError(
                f"rank {self.rank} round {self.rounds}: expected payloads from every other "
                f"rank, got {sorted(received)}"
            )
        payloads = {**received, self.rank: self._sent}
        parts = len(self._sent) // len(self.anchors)
        for t, a in enumerate(self.anchors):
            g = torch.zeros_like(a.detach())
            for j in range(self.world_size):
                try:
                    self.compressor.add_(g, payloads[j][parts * t : parts * (t + 1)])
                except PayloadError as e:  # before any anchor moved
                    raise PayloadError(
                        f"rank {self.rank} round {self.rounds}: rank {j}'s payload, tensor {t}: {e}"
                    ) from None
            a.grad = g.div_(self.world_size)
        self.outer.step()
        for p, a in zip(self.params, self.anchors):
            a.grad = None
            p.copy_(a.detach())
        self.rounds += 1

    def step(self) -> bool:
        """On a real rank, after the inner optimizer's step: count it, and every ``H``-th
        call run a round (an all-gather). Returns whether it did."""
        self.count += 1
        if self.count % self.local_steps:
            return False
        self._exchange_round()
        return True

    def flush(self) -> bool:
        """The last, shorter round of a run whose length is not a multiple of ``H`` (every
        rank must call it); returns whether there was one."""
        steps = self.count % self.local_steps
        if steps:
            self._exchange_round()
            self.count += self.local_steps - steps
        return bool(steps)

    def _exchange_round(self) -> None:
        payload = self.encode()
        flat = wire(payload)
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat, group=self.group)
        self.finish({j: unwire(gathered[j], payload) for j in self.neighbors})
