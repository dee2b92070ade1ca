"""The run configuration: one tree of dataclasses, the schema every YAML file is checked against.

``sparsekit.run.cli`` registers :class:`Config` in Hydra's ConfigStore; this module stays free of
Hydra so the pipeline can be driven from Python with plain dataclasses:

>>> cfg = Config()
>>> cfg.prune.pattern, cfg.model.name
('2:4', 'mnist1d_cnn')
>>> validate(cfg) is cfg
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparsekit.errors import UsageError
from sparsekit.prune.patterns import parse_pattern

PATTERN_HELP = "'unstructured', 'none' or 'N:M' with 0 < N < M (e.g. '2:4')"
CRITERIA = ("magnitude", "wanda", "sparsegpt")
SCOPES = ("layer", "global")
SCHEDULES = ("oneshot", "linear", "cubic")
QUANT_SCHEMES = ("none", "int8_weight_only", "int8", "fp8")
CHANNEL_IMPORTANCE = ("magnitude", "taylor", "lamp")
TASKS = ("classification", "lm")
HF_TASKS = ("causal_lm", "masked_lm", "sequence_classification", "feature_extraction")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine")
TRACKERS = ("tensorboard", "none")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED = ("auto", "none", "ddp", "fsdp2")
ACCEL_PRECISIONS = ("bf16", "fp8", "int8")
ACCEL_SPARSITY = ("2:4", "auto", "dense")


@dataclass
class ModelConfig:
    """Which network to compress. ``_target_`` (an importable factory, ``"pkg.mod.fn"``, typed
    by the user: a saved run never re-imports it) wins over ``name`` (a registered builder such
    as a built-in model, or a torchvision model name); both get ``kwargs``."""

    name: str = "mnist1d_cnn"
    _target_: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None  # dense weights to load instead of training a baseline
    # model=hf: a local transformers directory (config.json, weights, tokenizer files), or a
    # config (a dict, or a path to a config.json) to build with random weights; task: one of
    # HF_TASKS, null = from the config's architectures
    path: str | None = None
    config: Any = None
    task: str | None = None


@dataclass
class DataConfig:
    """Which data to train and evaluate on. ``_target_`` names a function returning
    ``(train_dataset, eval_dataset)`` whose items are ``(input, target)`` pairs."""

    name: str = "mnist1d"
    _target_: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    task: str = "classification"  # classification (accuracy) | lm (perplexity)
    batch_size: int = 100
    eval_batch_size: int = 500
    eval_batches: int | None = None  # evaluate on at most this many batches; null = all
    # data=text: local .txt/.jsonl files (a file, a directory or a glob), tokenized by the
    # tokenizer in ``tokenizer`` (null: model.path) into windows of seq_len tokens
    path: str | None = None
    tokenizer: str | None = None
    seq_len: int = 128


@dataclass
class ChannelConfig:
    """Structured channel pruning before the mask pruner; ratio is the fraction of output
    channels removed per layer (0 disables it)."""

    ratio: float = 0.0
    importance: str = "magnitude"
    scope: str = "layer"
    round_to: int = 8
    steps: int = 1
    ignore: list[str] = field(default_factory=list)


@dataclass
class PruneConfig:
    """Weight masks. ``sparsity`` is the fraction of zeroed weights (implied by N:M patterns)."""

    pattern: str = "2:4"
    sparsity: float | None = None
    criterion: str = "magnitude"
    scope: str = "layer"
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)
    calibration_batches: int = 8
    strict: bool = False
    fine_tune: bool = True  # false: one shot, no fine-tuning
    channel: ChannelConfig = field(default_factory=ChannelConfig)


@dataclass
class ScheduleConfig:
    """When masks are updated, in fine-tuning steps: from ``start`` to ``end`` every ``every``."""

    kind: str = "linear"
    start: int = 0
    end: int = 500
    every: int = 50


@dataclass
class QuantConfig:
    scheme: str = "none"
    qat: bool = False
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)


@dataclass
class DistillConfig:
    """Knowledge distillation from the dense teacher: loss = (1 - alpha) * task loss +
    alpha * T^2 * KL(teacher_T || student_T). ``alpha=0`` turns it off."""

    alpha: float = 0.0
    temperature: float = 2.0


@dataclass
class TrainConfig:
    """Dense training and fine-tuning. Steps count optimizer steps (one batch each)."""

    dense_steps: int = 6000
    dense_lr: float = 1e-2
    finetune_steps: int = 1000
    finetune_lr: float = 2e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    grad_clip: float = 0.0  # max gradient norm; 0 disables clipping
    log_every: int = 50
    eval_every: int = 250
    checkpoint_every: int = 250
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = 0
    device: str = "auto"
    cpu_threads: int = 0  # torch intra-op threads on CPU; 0 keeps torch's default
    # under torchrun: ddp (replicated weights) | fsdp2 (sharded weights, fully_shard) | auto
    # (= ddp under torchrun, else none) | none; see docs/distributed.md
    distributed: str = "auto"
    quiet: bool = False  # no progress bars (also: environment SPARSEKIT_QUIET=1)


@dataclass
class TrackerConfig:
    kind: str = "tensorboard"
    flush_secs: int = 10
    histograms: bool = True
    histogram_every: int = 200  # at least this many steps between two sets of weight histograms


@dataclass
class BenchConfig:
    enabled: bool = True
    batch_size: int = 256  # throughput batch; latency is always measured at batch 1
    warmup: int = 5
    repeats: int = 20


@dataclass
class AccelConfig:
    enabled: bool = False
    precision: str = "bf16"
    sparsity: str = "2:4"
    min_speedup: float = 1.0
    fuse: bool = True


@dataclass
class SensitivityConfig:
    """A per-layer sensitivity scan of the dense model before pruning (``sk.sensitivity``):
    each selected layer pruned alone (``prune.pattern``, ``prune.criterion``) to each of
    ``sparsities`` (fractions zeroed; unstructured only), the run's metric measured; written to
    sensitivity.json/.md and one TensorBoard chart per layer. ``target`` (optional, an overall
    sparsity): ``sk.allocate`` picks per-layer levels for it, which replace prune.sparsity."""

    enabled: bool = False
    sparsities: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 0.9])
    target: float | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    accel: AccelConfig = field(default_factory=AccelConfig)
    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)
    cache_dir: str | None = None  # null: $SPARSEKIT_CACHE or ~/.cache/sparsekit
    resume: Any = False  # true: continue the latest run directory; a path: continue that one


class ConfigError(UsageError):
    """A configuration value outside its allowed set; the message is one line."""


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:  # NaN too
        raise ConfigError(f"{key}={value!r} must be >= {low}")


def parse_nm(pattern: str) -> tuple[int, int] | None:
    """``"2:4" -> (2, 4)``; ``"unstructured"``/``"none"`` -> None; anything else raises
    :class:`ConfigError` naming ``prune.pattern`` and the allowed values."""
    if pattern == "none":
        return None
    try:
        return parse_pattern(pattern)
    except (ValueError, TypeError):
        raise ConfigError(
            f"prune.pattern={pattern!r} is not allowed; choose {PATTERN_HELP}") from None


def validate(cfg: Config) -> Config:
    """Check every enumerated option and range; raise :class:`ConfigError` (one line naming the
    option and its allowed values) on the first bad one. Returns ``cfg``."""
    p = cfg.prune
    nm = parse_nm(p.pattern)
    if p.sparsity is not None and not 0.0 <= p.sparsity < 1.0:
        raise ConfigError(f"prune.sparsity={p.sparsity!r} must be in [0, 1) or null")
    if p.pattern == "unstructured" and p.sparsity is None:
        raise ConfigError("prune.sparsity (a float in [0, 1)) is required for unstructured")
    if nm is not None and p.sparsity is not None and abs(p.sparsity - 1 + nm[0] / nm[1]) > 1e-9:
        raise ConfigError(
            f"prune.sparsity={p.sparsity!r} contradicts prune.pattern={p.pattern!r} "
            f"(which implies {1 - nm[0] / nm[1]:g}); set prune.sparsity=null"
        )
    _choice("prune.criterion", p.criterion, CRITERIA)
    if p.criterion == "sparsegpt" and p.fine_tune and cfg.schedule.kind != "oneshot":
        raise ConfigError(
            "prune.criterion=sparsegpt is one shot: set schedule=oneshot (prune at "
            "schedule.start, then fine-tune) or prune.fine_tune=false"
        )
    _choice("prune.scope", p.scope, SCOPES)
    sens = cfg.sensitivity
    if sens.enabled and p.pattern == "none":
        raise ConfigError("sensitivity.enabled=true needs a prune.pattern (not none)")
    if any(not 0.0 < v < 1.0 for v in sens.sparsities):
        raise ConfigError(f"sensitivity.sparsities={list(sens.sparsities)} must be in (0, 1)")
    if sens.target is not None and not (
        sens.enabled and p.pattern == "unstructured" and p.scope == "layer" and 0 <= sens.target < 1
    ):
        raise ConfigError(
            f"sensitivity.target={sens.target!r} needs sensitivity.enabled=true, "
            "prune.pattern=unstructured, prune.scope=layer and a value in [0, 1)"
        )
    _at_least("prune.calibration_batches", p.calibration_batches, 1)
    c = p.channel
    if not 0.0 <= c.ratio < 1.0:
        raise ConfigError(f"prune.channel.ratio={c.ratio!r} must be in [0, 1)")
    _choice("prune.channel.importance", c.importance, CHANNEL_IMPORTANCE)
    _choice("prune.channel.scope", c.scope, SCOPES)
    _at_least("prune.channel.round_to", c.round_to, 1)
    _at_least("prune.channel.steps", c.steps, 1)
    s = cfg.schedule
    _choice("schedule.kind", s.kind, SCHEDULES)
    _at_least("schedule.start", s.start, 0)
    _at_least("schedule.every", s.every, 1)
    if s.end < s.start:
        raise ConfigError(f"schedule.end={s.end} must be >= schedule.start={s.start}")
    _choice("quant.scheme", cfg.quant.scheme, QUANT_SCHEMES)
    _choice("data.task", cfg.data.task, TASKS)
    if cfg.model.task is not None:
        _choice("model.task", cfg.model.task, HF_TASKS)
    _at_least("data.seq_len", cfg.data.seq_len, 1)
    _at_least("data.batch_size", cfg.data.batch_size, 1)
    _at_least("data.eval_batch_size", cfg.data.eval_batch_size, 1)
    if cfg.data.eval_batches is not None and not cfg.data.eval_batches >= 1:
        raise ConfigError(
            f"data.eval_batches={cfg.data.eval_batches!r} must be >= 1, or null to evaluate on "
            "every batch (0 batches would report a meaningless 0% accuracy)"
        )
    t = cfg.train
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    _choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    _choice("train.device", t.device, DEVICES)
    _choice("train.distributed", t.distributed, DISTRIBUTED)
    for key in ("dense_steps", "finetune_steps", "warmup_steps", "cpu_threads"):
        _at_least(f"train.{key}", getattr(t, key), 0)
    for key in ("log_every", "eval_every", "checkpoint_every"):
        _at_least(f"train.{key}", getattr(t, key), 1)
    if not 0.0 <= t.distill.alpha <= 1.0:
        raise ConfigError(f"train.distill.alpha={t.distill.alpha!r} must be in [0, 1]")
    if not t.distill.temperature > 0:
        raise ConfigError(f"train.distill.temperature={t.distill.temperature!r} must be > 0")
    _choice("tracker.kind", cfg.tracker.kind, TRACKERS)
    _at_least("tracker.flush_secs", cfg.tracker.flush_secs, 1)
    _at_least("bench.batch_size", cfg.bench.batch_size, 1)
    _at_least("bench.repeats", cfg.bench.repeats, 1)
    _choice("accel.precision", cfg.accel.precision, ACCEL_PRECISIONS)
    _choice("accel.sparsity", cfg.accel.sparsity, ACCEL_SPARSITY)
    return cfg
