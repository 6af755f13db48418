"""The kinds of job of the task distribution (:mod:`learned_opt.tasks.distribution`).

Each kind is a pair: ``sample(rng) -> (options, batch_size)`` draws its choices from a
``random.Random``, and ``make(options, np_rng) -> (model, loss, source)`` builds the model,
its loss of ``(model, batch)`` and its batch source, called as ``source(gen, batch_size)``.
Adding a kind is adding one pair and its name to :data:`KINDS`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import job_data as data
from . import job_models as m

BATCHES = (16, 32, 64, 128, 256)


# ----------------------------------------------------------------------------- drawing helpers
def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _widths(rng: random.Random, depth: tuple[int, int], lo: int, hi: int) -> tuple[int, ...]:
    return tuple(int(log_uniform(rng, lo, hi)) for _ in range(rng.randint(*depth)))


def horizon(rng: random.Random) -> int:
    u = rng.random()
    lo, hi = (100, 500) if u < 0.6 else (500, 2000) if u < 0.9 else (2000, 5000)
    return int(round(log_uniform(rng, lo, hi), -1))


def _batch(rng: random.Random, p_full: float, sizes=BATCHES) -> int:
    return 0 if rng.random() < p_full else rng.choice(sizes)


def _noise(rng: random.Random, hi: float) -> float:
    return 0.0 if rng.random() < 0.4 else round(rng.uniform(0, hi), 3)


# ----------------------------------------------------------------------------- the kinds
def _on_model(fit):
    """The loss of a batch ``(inputs, targets)`` from a loss of ``(outputs, targets)``."""
    return lambda model, batch: fit(model(batch[0]), batch[1])


_classify = _on_model(F.cross_entropy)


def _regress(kind: str):
    return F.mse_loss if kind == "mse" else F.smooth_l1_loss


def _table_head(opts, r):
    x, y, classes = data.table(opts["data"], r, opts["noise"])
    return x, y, classes, max(classes, 1)


def _fit(classes: int, opts: dict):
    """Cross-entropy (with the drawn label smoothing) or the drawn regression loss."""
    smoothing = opts.get("smoothing", 0.0)
    if classes:
        return lambda out, y: F.cross_entropy(out, y, label_smoothing=smoothing)
    reg = _regress(opts.get("loss", "mse"))
    return lambda out, y: reg(out[:, 0], y)


def _table_options(rng, exclude=()):
    name = rng.choice([n for n in data.CLASSIFICATION + data.REGRESSION if n not in exclude])
    opts = {"data": name, "noise": _noise(rng, 0.3)}
    if name in data.CLASSIFICATION:
        opts["smoothing"] = rng.choice([0.0, 0.0, 0.1])
    else:
        opts["loss"] = rng.choice(["mse", "huber"])
    return opts


def sample_mlp(rng):
    opts = _table_options(rng) | {"widths": _widths(rng, (1, 4), 16, 512),
            "act": rng.choice(list(m.ACTIVATIONS)), "norm": rng.choice(["none", "batch", "layer"])}  # fmt: skip
    return opts, _batch(rng, 0.15)


def make_mlp(opts, r):
    x, y, classes, out = _table_head(opts, r)
    model = m.mlp(x.shape[1], opts["widths"], out, opts["act"], opts["norm"])
    return model, _on_model(_fit(classes, opts)), data.Rows(x, y)


def sample_convnet(rng):
    opts = {"data": rng.choice(["digits", "blobs"]), "noise": _noise(rng, 0.5),
            "channels": _widths(rng, (2, 4), 8, 32), "norm": rng.choice(["batch", "group"])}  # fmt: skip
    return opts, _batch(rng, 0.0, (16, 32, 64))


def make_convnet(opts, r):
    x, y, classes = data.images(opts["data"], r, opts["noise"])
    return (
        m.ConvNet(x.shape[1], opts["channels"], classes, opts["norm"]),
        _classify,
        data.Rows(x, y),
    )


def sample_resnet(rng):
    conv = rng.random() < 0.5
    opts = {"conv": conv, "blocks": rng.randint(1, 3), "noise": _noise(rng, 0.3),
            "width": int(log_uniform(rng, 8, 16) if conv else log_uniform(rng, 32, 256)),
            "norm": rng.choice(["batch", "group"] if conv else ["layer", "none"])}  # fmt: skip
    opts["data"] = rng.choice(["digits", "blobs"]) if conv else rng.choice(data.CLASSIFICATION)
    return opts, _batch(rng, 0.0 if conv else 0.15, (16, 32, 64) if conv else BATCHES)


def make_resnet(opts, r):
    source = data.images if opts["conv"] else data.table
    x, y, classes = source(opts["data"], r, opts["noise"])
    model = m.ResNet(x.shape[1], opts["width"], opts["blocks"], classes, opts["conv"], opts["norm"])
    return model, _classify, data.Rows(x, y)


def lm_loss(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def sample_rnn(rng):
    opts = {"cell": rng.choice(["gru", "lstm"]), "embed": int(log_uniform(rng, 16, 48)),
            "hidden": int(log_uniform(rng, 32, 96)), "layers": rng.randint(1, 2),
            "length": rng.choice([16, 32])}  # fmt: skip
    return opts, rng.choice([16, 32])


def make_rnn(opts, r):
    model = m.RecurrentLM(
        data.VOCAB_SIZE, opts["embed"], opts["hidden"], opts["layers"], opts["cell"]
    )
    return model, None, data.text(r, opts["length"])


def _attention(rng, dims=(32, 48, 64)):
    return {"dim": rng.choice(dims), "heads": rng.choice([2, 4]), "layers": rng.randint(1, 2),
            "pre_norm": rng.random() < 0.7}  # fmt: skip


def sample_text_transformer(rng):
    return _attention(rng, (32, 48)) | {"length": rng.choice([16, 32])}, rng.choice([16, 32])


def make_text_transformer(opts, r):
    model = m.TransformerLM(data.VOCAB_SIZE, opts["dim"], opts["heads"], opts["layers"],
                            opts["length"], opts["pre_norm"])  # fmt: skip
    return model, None, data.text(r, opts["length"])


def sample_image_transformer(rng):
    opts = _attention(rng, (32, 48)) | {"data": rng.choice(["digits", "blobs"]),
                                        "noise": _noise(rng, 0.5), "patch": 4}  # fmt: skip
    return opts, rng.choice([32, 64])


def make_image_transformer(opts, r):
    x, y, classes = data.images(opts["data"], r, opts["noise"])
    patch = opts["patch"] if x.shape[-1] > 8 else 2  # 16 tokens at most
    model = m.VisionTransformer(x.shape[1], x.shape[-1], patch, opts["dim"], opts["heads"],
                                opts["layers"], classes, opts["pre_norm"])  # fmt: skip
    return model, _classify, data.Rows(x, y)


def sample_tab_transformer(rng):
    opts = _table_options(rng, exclude=("digits",)) | _attention(rng, (16, 32))  # 64 tokens
    return opts, rng.choice([16, 32, 64])


def make_tab_transformer(opts, r):
    x, y, classes, out = _table_head(opts, r)
    model = m.TabularTransformer(x.shape[1], opts["dim"], opts["heads"], opts["layers"], out,
                                 opts["pre_norm"])  # fmt: skip
    return model, _on_model(_fit(classes, opts)), data.Rows(x, y)


def sample_recommender(rng):
    opts = {"dim": int(log_uniform(rng, 8, 64)), "towers": rng.random() < 0.3,
            "noise": round(rng.uniform(0.1, 1.0), 3), "loss": rng.choice(["mse", "huber"])}  # fmt: skip
    return opts, rng.choice([64, 128, 256, 512, 1024])


def make_recommender(opts, r):
    pairs, scores, users, items = data.ratings(r, opts["noise"])
    model = m.Recommender(users, items, opts["dim"], opts["towers"])
    return model, _on_model(_regress(opts["loss"])), data.Rows(pairs, scores)


def _flat_inputs(name, r, noise):
    if name == "digits":
        return data.images("digits", r)[0].flatten(1)
    return data.table(name, r, noise)[0]


def sample_autoencoder(rng):
    opts = {"data": rng.choice(["digits", "breast_cancer", "wine", "synthetic", "low_rank"]),
            "widths": _widths(rng, (1, 3), 16, 256), "code": int(log_uniform(rng, 2, 32)),
            "act": rng.choice(list(m.ACTIVATIONS)), "variational": rng.random() < 0.35,
            "beta": round(log_uniform(rng, 0.01, 1.0), 4), "noise": 0.0}  # fmt: skip
    return opts, _batch(rng, 0.15)


def make_autoencoder(opts, r):
    x = _flat_inputs(opts["data"], r, 0.0)
    model = m.AutoEncoder(
        x.shape[1], opts["widths"], opts["code"], opts["act"], opts["variational"]
    )

    def loss(model, batch):
        recon, kl = model(batch[0])
        return F.mse_loss(recon, batch[0]) + opts["beta"] * kl / batch[0].shape[1]

    return model, loss, data.Rows(x)


def sample_contrastive(rng):
    opts = {"data": rng.choice(["digits", "breast_cancer", "wine", "synthetic"]),
            "widths": _widths(rng, (1, 3), 32, 256), "out": int(log_uniform(rng, 16, 64)),
            "temperature": round(log_uniform(rng, 0.05, 0.5), 4),
            "jitter": round(rng.uniform(0.1, 0.5), 3), "drop": round(rng.uniform(0.0, 0.3), 3)}  # fmt: skip
    return opts, rng.choice([32, 64, 128, 256])


def make_contrastive(opts, r):
    x = _flat_inputs(opts["data"], r, 0.0)
    rows = data.Rows(x)

    def views(gen, batch_size):
        xb = rows(gen, batch_size)[0]

        def view():
            keep = torch.rand(xb.shape, generator=gen) >= opts["drop"]
            return (xb + opts["jitter"] * torch.randn(xb.shape, generator=gen)) * keep

        return view(), view()

    def loss(model, batch):
        a, b = (F.normalize(model(v), dim=1) for v in batch)
        logits = a @ b.T / opts["temperature"]
        target = torch.arange(len(a))
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))

    return m.mlp(x.shape[1], opts["widths"], opts["out"], "relu"), loss, views


def sample_graph(rng):
    return {"widths": _widths(rng, (1, 2), 16, 96), "noise": _noise(rng, 0.5)}, 0


def make_graph(opts, r):
    adjacency, x, y, classes = data.sbm_graph(r, opts["noise"])
    train = torch.as_tensor(r.random(len(y)) < 0.5)
    model = m.GraphNet(adjacency, x.shape[1], opts["widths"], classes)
    return (
        model,
        lambda model, batch: F.cross_entropy(model(batch[0])[train], batch[1][train]),
        data.Rows(x, y),
    )


def sample_moe(rng):
    opts = _table_options(rng) | {"width": int(log_uniform(rng, 16, 64)),
            "experts": rng.randint(2, 6), "k": rng.choice([1, 2]), "balance": 0.01}  # fmt: skip
    return opts, rng.choice([32, 64, 128])


def make_moe(opts, r):
    x, y, classes, out = _table_head(opts, r)
    model = m.MixtureOfExperts(x.shape[1], opts["width"], opts["experts"], opts["k"], out)
    fit = _fit(classes, opts)

    def loss(model, batch):
        pred, balance = model(batch[0])
        return fit(pred, batch[1]) + opts["balance"] * balance

    return model, loss, data.Rows(x, y)


def sample_sci_regression(rng):
    freqs = 0 if rng.random() < 0.5 else rng.choice([8, 16, 32])
    opts = {"widths": _widths(rng, (2, 4), 32, 128), "act": rng.choice(["tanh", "silu", "gelu"]),
            "freqs": freqs, "scale": round(log_uniform(rng, 1.0, 10.0), 3),
            "noise": _noise(rng, 0.1)}  # fmt: skip
    return opts, _batch(rng, 0.7, (32, 64, 128, 256))


def make_sci_regression(opts, r):
    x, y = data.function(r, opts["noise"])
    model = m.FourierMLP(x.shape[1], opts["widths"], opts["act"], opts["freqs"], opts["scale"])
    return model, _on_model(F.mse_loss), data.Rows(x, y)


def sample_convex(rng):
    opts = _table_options(rng) | {
        "l2": 0.0 if rng.random() < 0.5 else round(log_uniform(rng, 1e-4, 1e-2), 6)
    }
    return opts, _batch(rng, 0.4)


def make_convex(opts, r):
    x, y, classes, out = _table_head(opts, r)
    model, fit = nn.Linear(x.shape[1], out), _fit(classes, opts)

    def loss(model, batch):
        return fit(model(batch[0]), batch[1]) + 0.5 * opts["l2"] * model.weight.square().sum()

    return model, loss, data.Rows(x, y)


_KIND_NAMES = ("mlp", "convnet", "resnet", "rnn", "text_transformer", "image_transformer",
               "tab_transformer", "recommender", "autoencoder", "contrastive", "graph", "moe",
               "sci_regression", "convex")  # fmt: skip
#: kind -> (sample, make)
KINDS: dict[str, tuple[Callable, Callable]] = {
    k: (globals()[f"sample_{k}"], globals()[f"make_{k}"]) for k in _KIND_NAMES
}
