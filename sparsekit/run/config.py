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

import warnings

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from sparsekit.accel.kernels import SPARSITIES, precisions
from sparsekit.prune import distill, pruner, schedules
from sparsekit.prune.channels import CHANNEL_CRITERIA
from sparsekit.prune.criteria import CRITERIA, get_criterion, is_solver
from sparsekit.run import distributed
from sparsekit.errors import UsageError
from sparsekit.models.hf import AUTO_CLASSES
from sparsekit.prune.patterns import parse_pattern
from sparsekit.quant.formats import SCHEMES

PATTERN_HELP = "'unstructured', 'none' or 'N:M' with 0 < N < M (e.g. '2:4')"


def _choices(name: str, values: Iterable[str], doc: str) -> type[StrEnum]:
    """A StrEnum whose members are named by their values (what YAML and overrides spell)."""
    enum = StrEnum(name, [(v, v) for v in values], module=__name__)
    enum.__doc__ = doc
    return enum


# fixed sets, each taken from the module that implements it
Scope = _choices("Scope", pruner.SCOPES, "Pruner/ChannelPruner scope: per layer or global.")
ScheduleKind = _choices("ScheduleKind", schedules.SCHEDULES, "When masks move (schedules.py).")
HFTask = _choices("HFTask", AUTO_CLASSES, "What a transformers model is built for.")
Distributed = _choices("Distributed", distributed.MODES, "How ranks share the model.")
# fixed sets of the run itself (train.py, tracking.py)
Task = _choices("Task", ("classification", "lm", "embedding"),
               "classification (accuracy) | lm (perplexity) | embedding (mean cosine to the "
               "dense model's pooled embeddings)")
DistillLoss = _choices("DistillLoss", distill.LOSSES, "Distiller losses (prune/distill.py).")
DistillTarget = _choices("DistillTarget", distill.TARGETS, "What the Distiller matches.")
FeatureLoss = _choices("FeatureLoss", ("cosine", "mse"), "Per-layer feature matching loss.")
Optimizer = _choices("Optimizer", ("adam", "adamw", "sgd"), "train.make_optimizer's names.")
LRSchedule = _choices("LRSchedule", ("constant", "cosine"), "train.lr_at's schedules.")
TrackerKind = _choices("TrackerKind", ("tensorboard", "none"), "Where metrics go.")
Device = _choices("Device", ("auto", "cpu", "cuda"), "auto: cuda when visible.")


@functools.cache
def enum_fields(cls: type) -> dict[str, type[StrEnum]]:
    """The fields of dataclass ``cls`` typed with a StrEnum (or an optional one)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        for t in (hints[f.name], *typing.get_args(hints[f.name])):
            if isinstance(t, type) and issubclass(t, StrEnum):
                found[f.name] = t
    return found


class ConfigError(UsageError):
    """A configuration value outside its allowed set; the message is one line."""


class _Checked:
    """Choice and range checks run by ``__post_init__`` (OmegaConf runs it when it builds the
    dataclasses; :func:`validate` runs it again after code changed fields). ``_key`` is the
    section's place in the config tree, so that messages name the full option. Every
    Enum-typed field is checked against its enum; ``_open`` maps the fields whose set is open
    (a registry) to a function giving the allowed names."""

    _key: ClassVar[str] = ""
    _open: ClassVar[dict[str, Callable[[], Iterable[str]]]] = {}

    def __post_init__(self) -> None:
        for name, enum in enum_fields(type(self)).items():
            if getattr(self, name) is not None:
                self._choice(name, enum)
        for name, allowed in self._open.items():
            self._choice(name, allowed())
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` on the first bad value; coerce strings to enums."""

    def _option(self, name: str) -> str:
        return f"{self._key}.{name}" if self._key else name

    def _choice(self, name: str, allowed: type[StrEnum] | Iterable[str]) -> None:
        value = getattr(self, name)
        if isinstance(allowed, type):  # an enum: strings become its members
            if isinstance(value, str) and value in [m.value for m in allowed]:
                setattr(self, name, allowed(value))
                return
        elif isinstance(value, str) and value in allowed:  # a registry looks for new plugins
            return
        values = [str(v) for v in allowed]
        raise ConfigError(
            f"{self._option(name)}={value!r} is not allowed; choose one of: {', '.join(values)}"
        )

    def _at_least(self, *names: str, low: float) -> None:
        for name in names:
            value = getattr(self, name)
            if not value >= low:  # NaN too
                raise ConfigError(f"{self._option(name)}={value!r} must be >= {low}")

    def _fraction(self, name: str, *, closed: bool = False, what: str = "") -> None:
        """``value`` in [0, 1) ([0, 1] when ``closed``)."""
        value = getattr(self, name)
        if not (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0):
            raise ConfigError(
                f"{self._option(name)}={value!r} must be in [0, 1{']' if closed else ')'}{what}"
            )


@dataclass
class ModelConfig(_Checked):
    """Which network to compress. ``_target_`` (an importable factory, ``"pkg.mod.fn"``, typed
    by the user: a saved run never re-imports it) wins over ``name`` (a registered builder such
    as a built-in model, or a torchvision model name); both get ``kwargs``."""

    _key: ClassVar[str] = "model"
    name: str = "mnist1d_cnn"
    _target_: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None  # dense weights to load instead of training a baseline
    # model=hf: a local transformers directory (config.json, weights, tokenizer files), or a
    # config (a dict, or a path to a config.json) to build with random weights; task: null =
    # from the config's architectures
    path: str | None = None
    config: Any = None
    task: HFTask | None = None


@dataclass
class DataConfig(_Checked):
    """Which data to train and evaluate on. ``_target_`` names a function returning
    ``(train_dataset, eval_dataset)`` whose items are ``(input, target)`` pairs."""

    _key: ClassVar[str] = "data"
    name: str = "mnist1d"
    _target_: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    task: Task = Task.classification
    batch_size: int = 100
    eval_batch_size: int = 500
    eval_batches: int | None = None  # evaluate on at most this many batches; null = all
    # data=text: local .txt/.jsonl files (a file, a directory or a glob), tokenized by the
    # tokenizer in ``tokenizer`` (null: model.path) into windows of seq_len tokens
    path: str | None = None
    tokenizer: str | None = None
    seq_len: int = 128

    def check(self) -> None:
        self._at_least("seq_len", "batch_size", "eval_batch_size", low=1)
        if self.eval_batches is not None and not self.eval_batches >= 1:
            raise ConfigError(
                f"data.eval_batches={self.eval_batches!r} must be >= 1, or null to evaluate on "
                "every batch (0 batches would report a meaningless 0% accuracy)"
            )


@dataclass
class ChannelConfig(_Checked):
    """Structured channel pruning before the mask pruner; ratio is the fraction of output
    channels removed per layer (0 disables it)."""

    _key: ClassVar[str] = "prune.channel"
    _open: ClassVar = {"criterion": CHANNEL_CRITERIA.names}
    ratio: float = 0.0
    criterion: str = "magnitude"
    scope: Scope = Scope.layer
    round_to: int = 8
    steps: int = 1
    exclude: list[str] = field(default_factory=list)
    importance: str | None = None  # deprecated: criterion
    ignore: list[str] | None = None  # deprecated: exclude

    def check(self) -> None:
        self._fraction("ratio")
        self._at_least("round_to", "steps", low=1)
        self._renamed("importance", "criterion", "magnitude")
        self._renamed("ignore", "exclude", [])
        self._choice("criterion", CHANNEL_CRITERIA.names())  # the old key's value too

    def _renamed(self, old: str, new: str, default: Any) -> None:
        """The old key's value moves to the new one, with a FutureWarning naming both."""
        value = getattr(self, old)
        if value is None:
            return
        if getattr(self, new) != default and getattr(self, new) != value:
            raise ConfigError(f"{self._option(old)} is the old name of {self._option(new)}: "
                              "give one of them")
        # FutureWarning: Python shows it to command-line users (DeprecationWarning it hides)
        warnings.warn(f"{self._option(old)} is deprecated: use {self._option(new)}",
                      FutureWarning, stacklevel=2)
        setattr(self, new, list(value) if isinstance(value, list) else value)
        setattr(self, old, None)


@dataclass
class CriterionOptions(_Checked):
    """Options of the one-shot solvers (null: the criterion's default). sparsegpt takes
    blocksize (columns per lazy-update block), percdamp (Hessian damping, a fraction of
    mean(diag H)) and sequential (each layer calibrated on the already pruned layers' outputs);
    alps takes percdamp, sequential, rho (first ADMM penalty), iters (most ADMM steps) and
    cg_iters (refit steps). Setting one the criterion does not take is an error."""

    _key: ClassVar[str] = "prune.options"
    blocksize: int | None = None
    percdamp: float | None = None
    sequential: bool | None = None
    rho: float | None = None
    iters: int | None = None
    cg_iters: int | None = None

    def given(self) -> dict[str, Any]:
        """The options set (not null), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


@dataclass
class PruneConfig(_Checked):
    """Weight masks. ``sparsity`` is the fraction of zeroed weights (implied by N:M patterns).
    ``criterion``: a registered criterion (:func:`sparsekit.register_criterion`, or an installed
    ``sparsekit.criteria`` entry point)."""

    _key: ClassVar[str] = "prune"
    _open: ClassVar = {"criterion": lambda: CRITERIA}
    pattern: str = "2:4"
    sparsity: float | None = None
    criterion: str = "magnitude"
    scope: Scope = Scope.layer
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)
    calibration_batches: int = 8
    strict: bool = False
    fine_tune: bool = True  # false: one shot, no fine-tuning
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    options: CriterionOptions = field(default_factory=CriterionOptions)

    def check(self) -> None:
        nm = parse_nm(self.pattern)
        if self.sparsity is not None:
            self._fraction("sparsity", what=" or null")
        if self.pattern == "unstructured" and self.sparsity is None:
            raise ConfigError("prune.sparsity (a float in [0, 1)) is required for unstructured")
        if nm is not None and self.sparsity is not None and not math.isclose(
            self.sparsity, 1 - nm[0] / nm[1], abs_tol=1e-9
        ):
            raise ConfigError(
                f"prune.sparsity={self.sparsity!r} contradicts prune.pattern={self.pattern!r} "
                f"(which implies {1 - nm[0] / nm[1]:g}); set prune.sparsity=null"
            )
        self._at_least("calibration_batches", low=1)
        given = self.options.given()
        if given and self.criterion in CRITERIA:
            takes = tuple(getattr(get_criterion(self.criterion), "options", ()))
            wrong = [k for k in given if k not in takes]
            if wrong:
                raise ConfigError(
                    f"prune.options.{wrong[0]} is not an option of prune.criterion="
                    f"{self.criterion} (its options: {', '.join(takes) or 'none'})")


@dataclass
class ScheduleConfig(_Checked):
    """When masks are updated, in fine-tuning steps: from ``start`` to ``end`` every ``every``."""

    _key: ClassVar[str] = "schedule"
    kind: ScheduleKind = ScheduleKind.linear
    start: int = 0
    end: int = 500
    every: int = 50

    def check(self) -> None:
        self._at_least("start", low=0)
        self._at_least("every", low=1)
        if self.end < self.start:
            raise ConfigError(f"schedule.end={self.end} must be >= schedule.start={self.start}")


@dataclass
class QuantConfig(_Checked):
    """``scheme``: none or a registered quantization scheme (:data:`quant.SCHEMES`)."""

    _key: ClassVar[str] = "quant"
    _open: ClassVar = {"scheme": lambda: ("none", *SCHEMES.names())}
    scheme: str = "none"
    qat: bool = False
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)


@dataclass
class DistillConfig(_Checked):
    """Knowledge distillation from the dense teacher (``sk.Distiller``): loss = (1 - alpha) *
    task loss + alpha * distillation loss; ``alpha=0`` turns it off. ``target``/``loss`` auto:
    KL on the logits (``T^2 * KL(teacher_T || student_T)``) for classifiers and language
    models, ``1 - cos`` of the pooled embeddings for ``data.task=embedding`` (where the
    distillation loss is the whole loss). ``feature_weight`` > 0 adds per-layer feature
    matching of the hidden states (``feature_loss`` per token)."""

    _key: ClassVar[str] = "train.distill"
    alpha: float = 0.0
    temperature: float = 2.0
    target: DistillTarget = DistillTarget.auto
    loss: DistillLoss = DistillLoss.auto
    feature_weight: float = 0.0
    feature_loss: FeatureLoss = FeatureLoss.cosine

    def check(self) -> None:
        self._fraction("alpha", closed=True)
        if not self.temperature > 0:
            raise ConfigError(f"train.distill.temperature={self.temperature!r} must be > 0")
        self._at_least("feature_weight", low=0.0)


@dataclass
class TrainConfig(_Checked):
    """Dense training and fine-tuning. Steps count optimizer steps (one batch each)."""

    _key: ClassVar[str] = "train"
    dense_steps: int = 6000
    dense_lr: float = 1e-2
    finetune_steps: int = 1000
    finetune_lr: float = 2e-3
    optimizer: Optimizer = Optimizer.adamw
    weight_decay: float = 0.0
    lr_schedule: LRSchedule = LRSchedule.cosine
    warmup_steps: int = 0
    grad_clip: float = 0.0  # max gradient norm; 0 disables clipping
    log_every: int = 50
    eval_every: int = 250
    checkpoint_every: int = 250
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = 0
    device: Device = Device.auto
    cpu_threads: int = 0  # torch intra-op threads on CPU; 0 keeps torch's default
    # under torchrun: ddp (replicated weights) | fsdp2 (sharded weights, fully_shard) | auto
    # (= ddp under torchrun, else none) | none; see docs/distributed.md
    distributed: Distributed = Distributed.auto
    quiet: bool = False  # no progress bars (also: environment SPARSEKIT_QUIET=1)

    def check(self) -> None:
        self._at_least("dense_steps", "finetune_steps", "warmup_steps", "cpu_threads", low=0)
        self._at_least("log_every", "eval_every", "checkpoint_every", low=1)


@dataclass
class TrackerConfig(_Checked):
    _key: ClassVar[str] = "tracker"
    kind: TrackerKind = TrackerKind.tensorboard
    flush_secs: int = 10
    histograms: bool = True
    histogram_every: int = 200  # at least this many steps between two sets of weight histograms

    def check(self) -> None:
        self._at_least("flush_secs", low=1)


@dataclass
class BenchConfig(_Checked):
    _key: ClassVar[str] = "bench"
    enabled: bool = True
    batch_size: int = 256  # throughput batch; latency is always measured at batch 1
    warmup: int = 5
    repeats: int = 20

    def check(self) -> None:
        self._at_least("batch_size", "repeats", low=1)


@dataclass
class AccelConfig(_Checked):
    """``precision``: one with dense and 2:4 accel variants registered (accel.kernels).
    ``siblings``: layers fed one tensor (q/k/v, gate/up) as one GEMM (``sk.accelerate``).
    ``capture``: sparsekit's own CUDA graphs (null: where the inputs allow; false:
    torch.compile's reduce-overhead mode)."""

    _key: ClassVar[str] = "accel"
    _open: ClassVar = {"precision": precisions, "sparsity": lambda: SPARSITIES}
    enabled: bool = False
    precision: str = "bf16"
    sparsity: str = "2:4"
    min_speedup: float = 1.0
    siblings: bool = False
    capture: bool | None = None


@dataclass
class SensitivityConfig(_Checked):
    """A per-layer sensitivity scan of the dense model before pruning (``sk.sensitivity``):
    each selected layer pruned alone (``prune.pattern``, ``prune.criterion``) to each of
    ``sparsities`` (fractions zeroed; unstructured only), the run's metric measured; written to
    sensitivity.json/.md and one TensorBoard chart per layer. ``target`` (optional, an overall
    sparsity): ``sk.allocate`` picks per-layer levels for it, which replace prune.sparsity.
    With an N:M ``prune.pattern``, ``dense_layers`` (a number of layers) or ``dense_params`` (a
    fraction of the weights) keeps the most sensitive layers dense (``sk.allocate``); they are
    added to the pruner's exclusions."""

    _key: ClassVar[str] = "sensitivity"
    enabled: bool = False
    sparsities: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 0.9])
    target: float | None = None
    dense_layers: int | None = None
    dense_params: float | None = None

    def check(self) -> None:
        if any(not 0.0 < v < 1.0 for v in self.sparsities):
            raise ConfigError(f"sensitivity.sparsities={list(self.sparsities)} must be in (0, 1)")
        if self.dense_layers is not None:
            self._at_least("dense_layers", low=0)
        if self.dense_params is not None:
            self._fraction("dense_params")


@dataclass
class Config(_Checked):
    """The whole run. Each section checks its own values; this checks how they combine."""

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

    def check(self) -> None:
        p, sens = self.prune, self.sensitivity
        if (self.model.task == "feature_extraction" and self.data.name == "text"
                and self.data.task == "lm"):
            # text for an embedding model: no next token to predict; agreement with the dense
            # model's embeddings is what is measured (and what fine-tuning distils)
            self.data.task = Task.embedding
        if is_solver(p.criterion) and p.fine_tune and self.schedule.kind != "oneshot":
            raise ConfigError(
                f"prune.criterion={p.criterion} is one shot: set schedule=oneshot (prune at "
                "schedule.start, then fine-tune) or prune.fine_tune=false"
            )
        act = None if self.quant.scheme == "none" else SCHEMES[self.quant.scheme].activation
        if self.accel.enabled and act is not None and self.accel.precision != act.name:
            raise ConfigError(
                f"accel.precision={self.accel.precision} cannot run quant.scheme="
                f"{self.quant.scheme} layers: set accel.precision={act.name} (the scheme's "
                "activation numerics)"
            )
        if sens.enabled and p.pattern == "none":
            raise ConfigError("sensitivity.enabled=true needs a prune.pattern (not none)")
        if sens.target is not None and not (
            sens.enabled and p.pattern == "unstructured" and p.scope == "layer"
            and 0 <= sens.target < 1
        ):
            raise ConfigError(
                f"sensitivity.target={sens.target!r} needs sensitivity.enabled=true, "
                "prune.pattern=unstructured, prune.scope=layer and a value in [0, 1)"
            )
        dense = [k for k in ("dense_layers", "dense_params") if getattr(sens, k) is not None]
        if len(dense) > 1 or (dense and not (sens.enabled and parse_nm(p.pattern))):
            raise ConfigError(
                f"sensitivity.{dense[0]} needs sensitivity.enabled=true and an N:M prune.pattern "
                "(e.g. 2:4), and excludes sensitivity.dense_layers/dense_params together")
        if self.data.task == "embedding" and p.fine_tune and p.pattern != "none" and (
                self.train.distill.alpha <= 0 and self.train.finetune_steps > 0):
            raise ConfigError(
                "data.task=embedding has no labels: fine-tuning learns from the dense model, "
                "so set train.distill.alpha > 0 (e.g. 1) or train.finetune_steps=0")


def choices(cls: type = Config, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """Every option with a set of allowed values, and those values (enums, registries), by
    qualified key: what ``sparsekit --help`` lists."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(choices(hints[f.name], f"{prefix}{f.name}."))
    out.update({f"{prefix}{n}": tuple(map(str, e)) for n, e in enum_fields(cls).items()})
    out.update({f"{prefix}{n}": tuple(names()) for n, names in getattr(cls, "_open", {}).items()})
    return dict(sorted(out.items()))


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
    """Check ``cfg`` again after code changed its fields (construction checks it already):
    every section, then the whole. Raises :class:`ConfigError` (one line naming the option and
    its allowed values) on the first bad value; strings become their enum members. Returns
    ``cfg``."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if isinstance(section, _Checked):
            validate(section)
    cfg.__post_init__()
    return cfg
