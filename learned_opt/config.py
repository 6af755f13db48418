"""Configuration of the learned optimizer network (its update rule, :class:`NetConfig`, and
its gossip side, :class:`MixingConfig`) and its input features."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields, replace

#: Momentum decays of the per-parameter state (up to three momenta: those the rule reads,
#: see :func:`learned_opt.step.moment_rows`; and one second moment).
MOMENTUM_DECAYS = (0.9, 0.99, 0.999)
SECOND_MOMENT_DECAY = 0.999

#: Number of per-element input features (see ``features.element_features``).
NUM_ELEMENT_FEATURES = 11
#: Number of per-tensor statistics besides the time features (see ``features.tensor_stats``).
NUM_TENSOR_STATS = 8
#: Number of symmetric edge features besides the time features (see ``features.edge_features``).
NUM_EDGE_STATS = 5
#: Output parameterisations understood by ``NetConfig.output``.
OUTPUTS = ("adam", "ortho")


@dataclass(frozen=True)
class NetConfig:
    """The update rule: the per-tensor and per-element networks' shapes, the output
    parameterisation and the step-size adaptation. What changes under gossip (the mixing
    head, the adaptation's bounds there) is :class:`MixingConfig`."""

    width: int = 8  # hidden width of the per-element MLP: 8, 16 or 32
    tensor_width: int = 32  # hidden width of the per-tensor network
    step_mult: float = 1e-3  # base step; zero-initialised heads give exactly Adam(lr=step_mult)
    exp_mult: float = 1e-3  # magnitude output enters as exp(exp_mult * a)
    max_direction: float = 10.0  # the per-element direction is clamped to +-max_direction
    max_log_scale: float = 5.0  # per-tensor log step scale, bounded by tanh to +-this
    time_taus: tuple[float, ...] = field(default=(10.0, 100.0, 1000.0, 10000.0))  # tanh(t/tau - 1)
    eps: float = 1e-8  # epsilon inside rsqrt(v + eps)
    clip_value: float = 3.0  # clip(g) clips g / rms(g) to +-clip_value
    # Output parameterisation (see learned_opt.orthogonal): "adam" steps every tensor along
    # clamp(adam_dir + d); "ortho" steps 2-D matrices (both dims >= ortho_min_dim) along the
    # Newton-Schulz orthogonalisation of (unit-RMS 0.9 momentum + d), scaled to unit RMS
    # and to ortho_step_mult, and the other tensors as "adam".
    output: str = "adam"
    ortho_step_mult: float = 2e-3  # RMS of a matrix's step at zero heads ("ortho" only)
    # The base step's factor on a row-sparse table (an embedding whose first gradient left
    # at least half its rows empty; see features.shape_stats). A row steps only while its
    # momentum holds its last visit, so a rarely seen row moves a few steps' worth per
    # visit; tuned AdamW takes such models at 10-90 times Adam's default rate. 1: none.
    table_step_mult: float = 1.0
    ortho_min_dim: int = 2  # smallest dimension of a matrix that is orthogonalised
    # Largest "smaller dimension" of a matrix that is orthogonalised: Newton-Schulz costs
    # about 10 * r^2 * c FLOPs per iteration for r <= c (a 1024 x 1024 matrix: 50 GFLOP a
    # step), so larger matrices take the Adam form unless this is raised (on a GPU, say).
    ortho_max_dim: int = 256
    # Width scaling of the Adam form for wide matrices (0: off). A 2-D matrix that is not
    # orthogonalised and whose smaller dimension n exceeds adam_max_width steps at
    # adam_max_width / n times the Adam step: a sign-like Adam step moves an n x n
    # matrix's spectral norm by about lr * n, so without it the first steps of a wide
    # layer are far too large (a 1024-wide MLP's loss rose 13x at lr x3). This is
    # muP's 1 / width Adam rate for hidden layers; adapt_init sets it to ortho_max_dim, so
    # it scales the matrices too wide to orthogonalise. See features.width_log_factor.
    adam_max_width: int = 0
    ns_steps: int = 5  # Newton-Schulz iterations ("ortho" only)
    # Newton-Schulz on every ns_every-th step of a matrix whose smaller side is at least
    # ns_reuse_min_dim ("ortho" only; 1: every step). On the steps between, the matrix
    # keeps the Gram polynomial Q of its last iteration as optimizer state (an r x r matrix,
    # r its smaller side) and steps along Q times its current unit-norm input: one product
    # instead of ns_steps iterations (see orthogonal.newton_schulz_reusing).
    ns_every: int = 1
    ns_reuse_min_dim: int = 64
    # The gradient's weight w in what a matrix whose smaller side is at least
    # ns_reuse_min_dim orthogonalises ("ortho" only): (1 - w) m1 + w g, with m1 the 0.9
    # momentum after this step's update; at 0.1 this is the Nesterov form of that momentum
    # (0.9 m1 + 0.1 g), which Muon steps along. 0: m1 itself. See orthogonal.takes_nesterov.
    ortho_nesterov: float = 0.0
    normalize: bool = False  # scale the non-matrix direction to unit RMS per tensor
    # Per-tensor step-size adaptation (hypergradient; see features.adapt_log_lr): each
    # tensor keeps a log step multiplier that moves by lr_adapt_rate * cos(g_t, m1_{t-1})
    # per step, clamped to [lr_adapt_min, lr_adapt_max], its growth braked once the
    # gradient's RMS falls below lr_adapt_brake times its running RMS. 0 turns it off.
    lr_adapt_rate: float = 0.0
    # The bounds, measured on the held-out suite: e^7 lets a convex model reach its tuned
    # step (logistic regression: AdamW's best lr 0.95 is e^6.9 times Adam's 1e-3); e^-4
    # leaves a long run room to anneal (a wide MLP's tensors sat at e^-3 from step 500).
    lr_adapt_min: float = -4.0
    lr_adapt_max: float = 7.0
    lr_adapt_brake: float = 0.1
    # The ceiling for orthogonalised matrices (None: lr_adapt_max). The adaptation's signal
    # is cos(g_t, m1_{t-1}), dominated by the momentum's top singular directions, while an
    # orthogonalised step moves every direction by the same amount: the gradient can keep
    # agreeing with the momentum while the step, grown 1000x, blows the weakly-driven
    # directions up (an MLP on digits: its training loss rose from 0.2 to 300 within 2000
    # steps). See features.adapt_ceiling.
    lr_adapt_max_ortho: float | None = None
    # The signal-to-noise factor of orthogonalised matrices: their step is scaled by
    # min(1, rms(m1_hat) / rms(g))^ortho_snr per tensor (bias-corrected 0.9 momentum over
    # the root of the bias-corrected second moment's mean; see step.momentum_snr). An
    # orthogonalised step has the same size whatever the gradient's noise, where Adam's
    # per-element m/sqrt(v) shrinks in noise (to about 0.23 for pure noise at 0.9); 0 turns
    # it off (see MixingConfig.ortho_snr_gossip for the exponent under gossip).
    ortho_snr: float = 0.0
    # Decoupled weight decay, AdamW's at its learning rate step_mult times the lr
    # multiplier: before its update every tensor is multiplied by
    # 1 - weight_decay * step_mult * lr, so weight_decay=0.1 decays as
    # AdamW(lr=1e-3, weight_decay=0.1) does, and follows the multiplier's schedule. Not
    # scaled by the adapted step sizes: decay makes the gradient agree with itself, which
    # would grow them, and a decay grown with them fed back on itself (a 10-128-128-2 MLP's
    # weights overflowed at 1.0). 0 (every shipped rule): none. LearnedOptimizer sets it
    # per param group (its weight_decay).
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.width not in (8, 16, 32):
            raise ValueError(f"NetConfig.width must be 8, 16 or 32, got {self.width!r}")
        if int(self.tensor_width) < 1:
            raise ValueError("NetConfig.tensor_width must be a positive integer")
        for name in (
            "step_mult",
            "exp_mult",
            "max_direction",
            "max_log_scale",
            "eps",
            "clip_value",
            "ortho_step_mult",
            "table_step_mult",
            "lr_adapt_brake",
        ):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"NetConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not float(self.lr_adapt_rate) >= 0:
            raise ValueError(f"NetConfig.lr_adapt_rate must be >= 0, got {self.lr_adapt_rate!r}")
        if not float(self.lr_adapt_min) <= 0 <= float(self.lr_adapt_max):
            raise ValueError(
                "NetConfig needs lr_adapt_min <= 0 <= lr_adapt_max, got "
                f"{self.lr_adapt_min!r} and {self.lr_adapt_max!r}"
            )
        if self.lr_adapt_max_ortho is not None and not 0 <= float(self.lr_adapt_max_ortho):
            raise ValueError(
                "NetConfig.lr_adapt_max_ortho must be None or >= 0, got "
                f"{self.lr_adapt_max_ortho!r}"
            )
        if not 0 <= float(self.ortho_nesterov) <= 1:
            raise ValueError(
                f"NetConfig.ortho_nesterov must be in [0, 1], got {self.ortho_nesterov!r}"
            )
        if not 0 <= float(self.weight_decay) < float("inf"):
            raise ValueError(
                f"NetConfig.weight_decay must be a finite number >= 0, got {self.weight_decay!r}"
            )
        if not 0 <= float(self.ortho_snr) <= 4:
            raise ValueError(f"NetConfig.ortho_snr must be in [0, 4], got {self.ortho_snr!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"NetConfig.output must be one of {OUTPUTS}, got {self.output!r}")
        for name in ("ortho_min_dim", "ortho_max_dim", "ns_steps", "ns_every", "ns_reuse_min_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"NetConfig.{name} must be a positive integer")
        width = self.adam_max_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise ValueError(f"NetConfig.adam_max_width must be an integer >= 0, got {width!r}")
        if len(self.time_taus) == 0 or any(float(t) <= 0 for t in self.time_taus):
            raise ValueError(
                f"NetConfig.time_taus must be non-empty and positive: {self.time_taus!r}"
            )
        object.__setattr__(self, "time_taus", tuple(float(t) for t in self.time_taus))

    @property
    def adapts_lr(self) -> bool:
        """Whether the per-tensor step-size adaptation is on."""
        return self.lr_adapt_rate > 0

    @staticmethod
    def under_gossip(*_) -> NetConfig:
        """Moved: the rule under gossip is ``MixingConfig.under_gossip(rule)``, as
        ``net.mixing.under_gossip(net.config)``. Kept by name because optimizers pickled
        before the move hold it as their ``config_transform``; unpickling replaces it with
        their network's ``mixing.under_gossip``."""
        raise TypeError(
            "NetConfig.under_gossip moved to MixingConfig.under_gossip(rule): call "
            "net.mixing.under_gossip(net.config)"
        )

    @property
    def num_time_features(self) -> int:
        return len(self.time_taus)

    def to_dict(self) -> dict:
        """A plain dict (lists, floats, ints) suitable for a ``weights_only`` checkpoint."""
        d = asdict(self)
        d["time_taus"] = list(self.time_taus)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> NetConfig:
        """Build from :meth:`to_dict` output; unknown keys raise ``ValueError``."""
        d = dict(d)
        if "time_taus" in d:
            d["time_taus"] = tuple(d["time_taus"])
        return _strict_from_dict(cls, d)


@functools.lru_cache(maxsize=32)
def with_weight_decay(cfg: NetConfig, weight_decay: float) -> NetConfig:
    """``cfg`` with its ``weight_decay`` set (cached: ``dataclasses.replace`` validates the
    whole config again, about 20 us, which every step of a decayed group would pay)."""
    return replace(cfg, weight_decay=weight_decay)


def _strict_from_dict(cls, d: dict):
    """``cls(**d)`` for a frozen config dataclass; unknown keys raise ``ValueError``."""
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; valid: {sorted(known)}")
    return cls(**d)


@dataclass(frozen=True)
class MixingConfig:
    """The gossip side of a learned optimizer: its mixing head (the edge network that
    weighs each neighbour) and the bounds its update rule takes under gossip.

    A :class:`NetConfig` is the update rule alone: one worker, or each worker between
    exchanges. A worker under gossip steps with :meth:`under_gossip` of it. Both are stored
    in each checkpoint; checkpoints written before the split hold these fields in their
    ``config`` (see :func:`split_config`).
    """

    edge_width: int = 16  # hidden width of the edge (mixing) head
    # The ceiling of the log step multiplier under gossip. With
    # heterogeneous data each worker's gradient keeps a part that points to its own
    # optimum, whatever the step size, while the mixing pulls it back: consecutive
    # gradients agree, the cosine above stays positive, and steps would grow until the
    # workers' disagreement ruins the averaged model. The lower ceiling bounds that; too
    # low, it holds convex problems far below their tuned step (D-SGD's best rate was 1 on
    # logistic regression). adapt_init_2x sets e^5, chosen on the decentralized validation
    # settings (docs/changelog.md: gossip_rule_choice.py, in git at c2adf13).
    lr_adapt_max_gossip: float = 2.0
    # The floor under gossip. The other way round, under label skew a worker's gradient
    # meets its neighbourhood's mixed momentum at a negative cosine even where the step
    # size is right (a conv net with batch norm: its steps shrank to e^-4 and it trained
    # slower than D-SGD). e^-2 was picked on the decentralized validation suite (see the
    # README, "The adaptation floor under gossip").
    lr_adapt_min_gossip: float = -2.0
    # The adaptation's rate under gossip (None: lr_adapt_rate). adapt_init_2x adapts at 0.2
    # alone and keeps 0.3 under gossip, where 0.2 lowered the decentralized validation
    # settings' lowest row (0.58x against 0.74x; validation_rate02_decentralized.json).
    lr_adapt_rate_gossip: float | None = None
    # The exponent of NetConfig.ortho_snr under gossip (None: the rule's own). adapt_init_2x
    # sets 1: under gossip an orthogonalised step shrinks in gradient noise as Adam's does.
    ortho_snr_gossip: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.edge_width, bool) or int(self.edge_width) < 1:
            raise ValueError("MixingConfig.edge_width must be a positive integer")
        if not 0 <= float(self.lr_adapt_max_gossip):
            raise ValueError(
                f"MixingConfig.lr_adapt_max_gossip must be >= 0, got {self.lr_adapt_max_gossip!r}"
            )
        if not float(self.lr_adapt_min_gossip) <= 0:
            raise ValueError(
                f"MixingConfig.lr_adapt_min_gossip must be <= 0, got {self.lr_adapt_min_gossip!r}"
            )
        if self.lr_adapt_rate_gossip is not None and not float(self.lr_adapt_rate_gossip) > 0:
            raise ValueError(
                "MixingConfig.lr_adapt_rate_gossip must be None or > 0, got "
                f"{self.lr_adapt_rate_gossip!r}"
            )
        snr = self.ortho_snr_gossip
        if snr is not None and not 0 <= float(snr) <= 4:
            raise ValueError(f"MixingConfig.ortho_snr_gossip must be in [0, 4], got {snr!r}")

    def under_gossip(self, rule: NetConfig) -> NetConfig:
        """The update rule a worker steps with under gossip (decentralized training, real
        or simulated): ``rule`` with its adapted step multipliers' ceiling lowered to
        ``lr_adapt_max_gossip``, their floor raised to ``lr_adapt_min_gossip``, their rate
        ``lr_adapt_rate_gossip`` and its matrices' signal-to-noise exponent
        ``ortho_snr_gossip`` where set, and the single-worker rule's own fields at the
        values the gossip rule was chosen with (:data:`SINGLE_WORKER_ONLY`). The bounds and
        rate apply only where ``rule`` adapts step sizes. Memoised (every step asks for it)."""
        return _under_gossip(self, rule)

    def to_dict(self) -> dict:
        """A plain dict suitable for a ``weights_only`` checkpoint."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MixingConfig:
        """Build from :meth:`to_dict` output; unknown keys raise ``ValueError``."""
        return _strict_from_dict(cls, d)


#: The fields that hold for single-worker runs alone, and their values under gossip (the
#: gossip rule was chosen with them).
SINGLE_WORKER_ONLY = {"table_step_mult": 1.0}


@functools.lru_cache(maxsize=16)
def _under_gossip(mixing: MixingConfig, cfg: NetConfig) -> NetConfig:
    """:meth:`MixingConfig.under_gossip`, memoised: building and validating a config costs
    about 10 us, the lookup under 1 us."""
    ceiling = min(float(cfg.lr_adapt_max), float(mixing.lr_adapt_max_gossip))
    floor = max(float(cfg.lr_adapt_min), float(mixing.lr_adapt_min_gossip))
    rate = mixing.lr_adapt_rate_gossip
    rate = cfg.lr_adapt_rate if rate is None else rate
    snr = cfg.ortho_snr if mixing.ortho_snr_gossip is None else mixing.ortho_snr_gossip
    if not cfg.adapts_lr:
        ceiling, floor, rate = cfg.lr_adapt_max, cfg.lr_adapt_min, cfg.lr_adapt_rate
    new = {"lr_adapt_max": ceiling, "lr_adapt_min": floor, "lr_adapt_rate": rate,
           "ortho_snr": snr, **SINGLE_WORKER_ONLY}  # fmt: skip
    if all(getattr(cfg, k) == v for k, v in new.items()):
        return cfg
    return replace(cfg, **new)


def split_config(config: dict, mixing: dict | None = None) -> tuple[NetConfig, MixingConfig]:
    """The update rule and the mixing head of a checkpoint (or of a set of overrides).

    ``config`` holds :class:`NetConfig`'s fields, and ``mixing`` :class:`MixingConfig`'s.
    A key of either may sit in ``config``: checkpoints written before the two were split
    held one flat config. A key that is neither's, or one of ``NetConfig``'s in
    ``mixing``, raises ``ValueError``."""
    rule_names = {f.name for f in fields(NetConfig)}
    mixing_names = {f.name for f in fields(MixingConfig)}
    misplaced = set(mixing or {}) - mixing_names
    if misplaced:
        raise ValueError(
            f"unknown MixingConfig fields {sorted(misplaced)}; valid: {sorted(mixing_names)}"
        )
    flat = {**config, **(mixing or {})}
    unknown = set(flat) - rule_names - mixing_names
    if unknown:
        raise ValueError(
            f"unknown config fields {sorted(unknown)}; valid: NetConfig's "
            f"{sorted(rule_names)} and MixingConfig's {sorted(mixing_names)}"
        )
    return (
        NetConfig.from_dict({k: v for k, v in flat.items() if k in rule_names}),
        MixingConfig.from_dict({k: v for k, v in flat.items() if k in mixing_names}),
    )
