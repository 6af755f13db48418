"""What the speed benchmarks time, and how: the models and transformer-shaped parameter
sets, Muon with AdamW, and the timer that lets optimizers take turns."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from benchmarks import rules
from benchmarks.validation_anchors import ADAMW
from learned_opt import LearnedOptimizer
from learned_opt.kernel import COMPILE_AFTER, compile_after_seconds
from learned_opt.orthogonal import is_matrix


class GPT(nn.Module):
    """A small pre-norm transformer language model (token + position embeddings, untied head)."""

    def __init__(self, vocab: int, d: int, layers: int, seq: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(
            d, max(d // 64, 2), 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.vocab, self.seq = vocab, seq

    def batch(self, gen: torch.Generator, size: int = 8):
        x = torch.randint(self.vocab, (size, self.seq + 1), generator=gen)
        return x[:, :-1], x[:, 1:]

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.norm(self.blocks(h, mask=mask, is_causal=True))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class ConvNet(nn.Module):
    """A small ResNet-like conv net with batch norm on 32x32 RGB images, 10 classes."""

    def __init__(self, c: int = 32):
        super().__init__()

        def block(i, o, stride):
            return nn.Sequential(
                nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU()
            )

        self.net = nn.Sequential(
            block(3, c, 1), block(c, c, 1), block(c, 2 * c, 2), block(2 * c, 2 * c, 1),
            block(2 * c, 4 * c, 2), block(4 * c, 4 * c, 1), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(4 * c, 10),
        )  # fmt: skip

    def batch(self, gen: torch.Generator, size: int = 32):
        return torch.randn(size, 3, 32, 32, generator=gen), torch.randint(
            10, (size,), generator=gen
        )

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


#: name -> model factory; each is timed on the optimizer step and the full training step.
MODELS = {
    "transformer-0.5M": lambda: GPT(vocab=512, d=128, layers=2),
    "transformer-10M": lambda: GPT(vocab=4000, d=256, layers=12),
    "convnet-bn": lambda: ConvNet(32),
}
#: name -> (vocab, d_model, layers) of transformer-shaped tensor sets (optimizer step only).
SHAPES = {"shapes-10M": (8000, 256, 10), "shapes-100M": (16000, 768, 14)}


def transformer_shapes(vocab: int, d: int, layers: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a small GPT-like model: embeddings, attention, 4x MLP, layernorms."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (256, d)]  # token and position embeddings
    for _ in range(layers):
        shapes += [(d,), (d,)]  # layernorm 1
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,)]  # attention qkv and output
        shapes += [(d,), (d,)]  # layernorm 2
        shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # MLP
    shapes += [(d,), (d,)]  # final layernorm
    return shapes


def make_params(shapes, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append(p)
    return params


def muon_adamw(params, cfg):
    """``torch.optim.Muon`` on the matrices the learned rule orthogonalises under ``cfg``,
    AdamW (as the anchors run it) on the rest: the two steps' costs compare like for like."""
    params = list(params)
    return rules.muon_with_adamw(params, [is_matrix(tuple(p.shape), cfg) for p in params], **ADAMW)


def compile_kernels(steps: dict, opts: dict, timeout: float = 1800) -> dict:
    """Step every optimizer until its kernel is compiled (see :mod:`learned_opt.kernel`);
    returns the seconds each learned optimizer waited for it (``RuntimeError`` when one
    waited ``timeout`` seconds)."""
    with compile_after_seconds(0):  # the kernel is what is timed: queue it right away
        for fn in steps.values():
            for _ in range(COMPILE_AFTER):
                fn()
    waited = {}
    for name, opt in opts.items():
        if isinstance(opt, LearnedOptimizer) and opt.compile:
            t0 = time.perf_counter()
            if not opt.wait_compiled(timeout=timeout):
                raise RuntimeError(f"{name}: the kernel did not compile")
            waited[name] = round(time.perf_counter() - t0, 1)
    return waited


#: Consecutive steps timed as one sample (their mean): the rule's step time alternates
#: with its Newton-Schulz steps (``NetConfig.ns_every``).
PERIOD = 2


def time_turns(steps: dict, warmup: int, repeats: int) -> dict:
    """``{name: {part: median ms}}`` of callables ``steps[name]() -> {part: seconds}``,
    each sample the mean of :data:`PERIOD` consecutive calls, taking turns in an order
    that rotates each round; also each part's fastest sample (``<part>_best``) and the
    first call of each (``first``, ms)."""
    times: dict = {name: {} for name in steps}
    first = {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        fn()
        first[name] = 1e3 * (time.perf_counter() - t0)
    names = list(steps)
    for k in range(warmup + repeats):
        # the order turns each round: no optimizer always follows the same one (whose
        # threads, caches or allocations would otherwise slow it alike every round)
        for name in names[k % len(names) :] + names[: k % len(names)]:
            sums: dict = {}
            for _ in range(PERIOD):
                for part, sec in steps[name]().items():
                    sums[part] = sums.get(part, 0.0) + sec
            if k >= warmup:
                for part, sec in sums.items():
                    times[name].setdefault(part, []).append(1e3 * sec / PERIOD)
    return {
        name: {
            **{p: statistics.median(t) for p, t in parts.items()},
            **{f"{p}_best": min(t) for p, t in parts.items()},
            "first": first[name],
        }
        for name, parts in times.items()
    }
