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


import contextlib
import contextvars
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from sparsekit import names
from sparsekit.errors import UsageError
from sparsekit.names import parse_pattern
from sparsekit.prune import schedules

if typing.TYPE_CHECKING:
    from sparsekit.registry import Registry

PATTERN_HELP = "'unstructured', 'none' or 'N:M' with 0 < N < M (e.g. '2:4')"


def _choices(name: str, values: Iterable[str], doc: str) -> type[StrEnum]:
    """A StrEnum whose members are named by their values (what YAML and overrides spell)."""
    enum = StrEnum(name, [(v, v) for v in values], module=__name__)
    enum.__doc__ = doc
    return enum


# fixed sets, each taken from the module that implements it
Scope = _choices("Scope", names.SCOPES, "Pruner/ChannelPruner scope: per layer or global.")
ScheduleKind = _choices("ScheduleKind", schedules.SCHEDULES, "When masks move (schedules.py).")
HFTask = _choices("HFTask", names.AUTO_CLASSES, "What a transformers model is built for.")
Distributed = _choices("Distributed", names.DISTRIBUTED_MODES, "How ranks share the model.")
# fixed sets of the run itself (train.py, tracking.py)
Task = _choices("Task", ("classification", "lm", "embedding"),
               "classification (accuracy) | lm (perplexity) | embedding (mean cosine to the "
               "dense model's pooled embeddings)")
DistillLoss = _choices("DistillLoss", names.DISTILL_LOSSES, "Distiller losses (prune/distill.py).")
DistillTarget = _choices("DistillTarget", names.DISTILL_TARGETS, "What the Distiller matches.")
FeatureLoss = _choices("FeatureLoss", ("cosine", "mse"), "Per-layer feature matching loss.")
Optimizer = _choices("Optimizer", ("adam", "adamw", "sgd"), "train.make_optimizer's names.")
LRSchedule = _choices("LRSchedule", ("constant", "cosine"), "train.lr_at's schedules.")
TrainPrecision = _choices("TrainPrecision", ("fp32", "bf16"),
                          "fine-tuning arithmetic: fp32 | bf16 autocast (float32 weights)")
TrackerKind = _choices("TrackerKind", ("tensorboard", "none"), "Where metrics go.")
QuantMethod = _choices("QuantMethod", names.QUANT_METHODS,
                       "rtn: round to nearest | gptq: GPTQ's error compensation (int4)")
Device = _choices("Device", ("auto", "cpu", "cuda"), "auto: cuda when visible.")


# The registries (criteria, quantization schemes, accel variants) are filled by modules that
# import torch: they are imported on first use, so that the schema alone loads in well under a
# second and the command line's first check (:func:`without_registries`) answers before torch.
_REGISTRIES = contextvars.ContextVar("sparsekit_config_registries", default=True)


@contextlib.contextmanager
def without_registries() -> Iterator[None]:
    """Within this block, config checks that need a registry (criterion, quantization scheme,
    accel precision and sparsity, channel criterion; what a criterion or scheme allows) are
    skipped and nothing imports torch; every other check runs. The CLI checks the command line
    this way first, then in full."""
    token = _REGISTRIES.set(False)
    try:
        yield
    finally:
        _REGISTRIES.reset(token)


def checks_registries() -> bool:
    """False within :func:`without_registries`."""
    return _REGISTRIES.get()


def _criteria():  # noqa: ANN202 - the module sparsekit.prune.criteria
    from sparsekit.prune import criteria

    return criteria


def _channel_criteria() -> Registry:
    from sparsekit.prune.channels import CHANNEL_CRITERIA

    return CHANNEL_CRITERIA


def _schemes() -> Registry:
    from sparsekit.quant.formats import SCHEMES

    return SCHEMES


def _schemes_module():  # noqa: ANN202 - the module sparsekit.quant.formats
    from sparsekit.quant import formats

    return formats


def _kernels():  # noqa: ANN202 - the module sparsekit.accel.layers
    from sparsekit.accel import layers

    return layers


@functools.cache
def _optional(cls: type, name: str) -> bool:
    """Whether field ``name`` of dataclass ``cls`` may be None."""
    return type(None) in typing.get_args(typing.get_type_hints(cls)[name])


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


INT_MAX = 2**31 - 1  # counts and sizes beyond this overflow the C ints of torch and numpy


@dataclass(frozen=True)
class Range:
    """The values a numeric option takes: finite, ``low <= v`` (``low < v`` when
    ``low_open``) and ``v <= high`` (``v < high`` when ``high_open``); ``high`` None: no upper
    bound but finiteness (an int option is capped at :data:`INT_MAX`).

    >>> str(Range(0, 1, high_open=True)), 0.5 in Range(0, 1), float("nan") in Range(0)
    ('in [0, 1)', True, False)
    """

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        def fmt(x: float) -> str:
            return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"

        if self.high is None:
            return f"{'>' if self.low_open else '>='} {fmt(self.low)}"
        return (f"in {'(' if self.low_open else '['}{fmt(self.low)}, {fmt(self.high)}"
                f"{')' if self.high_open else ']'}")


def number(default: float | None, low: float, high: float | None = None, *,
           low_open: bool = False, high_open: bool = False) -> Any:
    """A numeric field whose :class:`Range` is part of the schema (``field.metadata``): every
    int and float option declares one, and :class:`_Checked` refuses a value outside it (NaN
    and inf included) before any work starts."""
    return field(default=default,
                 metadata={"range": Range(low, high, low_open=low_open, high_open=high_open)})


def _numeric_type(hint: Any) -> type | None:
    """int or float for a field typed ``int``, ``float`` or an optional one; else None."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for t in (hint, *(typing.get_args(hint) if union else ())):
        if t is bool:
            return None
        if t in (int, float):
            return t
    return None


@functools.cache
def numeric_fields(cls: type) -> dict[str, tuple[type, Range | None]]:
    """The int/float fields of dataclass ``cls``: name -> (type, declared Range)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kind = _numeric_type(hints[f.name])
        if kind is not None:
            out[f.name] = (kind, f.metadata.get("range"))
    return out


@functools.cache
def string_fields(cls: type) -> tuple[str, ...]:
    """The fields of dataclass ``cls`` typed ``str`` or ``str | None`` (names, paths)."""
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls)
                 if hints[f.name] is str or hints[f.name] == (str | None))


class _Checked:
    """Choice and range checks run by ``__post_init__`` (OmegaConf runs it when it builds the
    dataclasses; :func:`validate` runs it again after code changed fields). ``_key`` is the
    section's place in the config tree, so that messages name the full option. Every
    Enum-typed field is checked against its enum; ``_open`` maps the fields whose set is open
    (a registry) to a function giving the allowed names."""

    _key: ClassVar[str] = ""
    _open: ClassVar[dict[str, Callable[[], Iterable[str]]]] = {}

    def __post_init__(self) -> None:
        self._check_schema()
        for name, enum in enum_fields(type(self)).items():
            if getattr(self, name) is not None:
                self._choice(name, enum)
        if checks_registries():
            for name, allowed in self._open.items():
                self._choice(name, allowed())
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` on the first bad value; coerce strings to enums."""

    def _check_schema(self) -> None:
        """What the schema itself says: every number of the right type, finite and in its
        declared :class:`Range` (an int at most :data:`INT_MAX`); every name or path a
        non-empty string (or null)."""
        cls = type(self)
        for name, (kind, allowed) in numeric_fields(cls).items():
            value = getattr(self, name)
            if value is None and _optional(cls, name):
                continue
            if allowed is None:
                allowed = Range(-math.inf)
            if kind is int and allowed.high is None:
                allowed = dataclasses.replace(allowed, high=INT_MAX)
            wrong_type = kind is int and (isinstance(value, bool) or not isinstance(value, int))
            if wrong_type or value not in allowed:
                what = "an integer" if kind is int else "a finite number"
                null = " (or null)" if _optional(cls, name) else ""
                raise ConfigError(f"{self._option(name)}={value!r} must be {what} {allowed}{null}")
        for name in string_fields(type(self)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{self._option(name)}={value!r} must be a non-empty string"
                                  f"{' (or null)' if _optional(type(self), name) else ''}")

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
    # model=hf: a local transformers directory (config.json, weights, tokenizer files), a .gguf
    # file (or a directory holding one), or a config (a dict, or a path to a config.json) to
    # build with random weights; task: null = from the config's architectures (GGUF: causal_lm)
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
    batch_size: int = number(100, 1)
    eval_batch_size: int = number(500, 1)
    eval_batches: int | None = number(None, 1)  # evaluate on at most this many batches; null = all
    # data=text: local .txt/.jsonl files (a file, a directory or a glob), tokenized by the
    # tokenizer in ``tokenizer`` (null: model.path) into windows of seq_len tokens
    path: str | None = None
    tokenizer: str | None = None
    seq_len: int = number(128, 1)
    # data=text: held-out evaluation on all of this text instead of data.path's held-out part
    # (a domain the run neither calibrates nor trains on)
    eval_path: str | None = None
    # model=hf causal LM, data=text: teacher_samples sequences written by the dense model itself
    # (sparsekit.data.teacher; 0: none), each BOS + seq_len tokens: the first
    # teacher_first_tokens from its full distribution, the rest at teacher_temperature (0:
    # greedy) within the teacher_top_p nucleus, teacher_batch_size at a time, seeded by
    # teacher_seed. teacher_mix: the fraction of the training and calibration windows that are
    # teacher samples (1: data-free, data.path then optional); evaluation never sees them.
    teacher_samples: int = number(0, 0)
    teacher_mix: float = number(0.5, 0, 1, low_open=True)
    teacher_temperature: float = number(1.0, 0, 100)
    teacher_top_p: float = number(0.95, 0, 1, low_open=True)
    teacher_first_tokens: int = number(0, 0)
    teacher_batch_size: int = number(16, 1)
    teacher_seed: int = number(0, 0, 2**32 - 1)


@dataclass
class ChannelConfig(_Checked):
    """Structured channel pruning before the mask pruner; ratio is the fraction of output
    channels removed per layer (0 disables it)."""

    _key: ClassVar[str] = "prune.channel"
    _open: ClassVar = {"criterion": lambda: _channel_criteria().names()}
    ratio: float = number(0.0, 0, 1, high_open=True)
    criterion: str = "magnitude"
    scope: Scope = Scope.layer
    round_to: int = number(8, 1)
    steps: int = number(1, 1)
    exclude: list[str] = field(default_factory=list)

    def check(self) -> None:
        if checks_registries():
            self._choice("criterion", _channel_criteria().names())


@dataclass
class CriterionOptions(_Checked):
    """Options of the one-shot solvers (null: the criterion's default). sparsegpt takes
    blocksize (columns per lazy-update block), percdamp (Hessian damping, a fraction of
    mean(diag H)) and sequential (each layer calibrated on the already pruned layers' outputs);
    alps takes percdamp, sequential, rho (first ADMM penalty), iters (most ADMM steps) and
    cg_iters (refit steps). Both take reconstruct_steps (Adam steps per transformer block fitting
    the block to the dense model's outputs after pruning it; 0 = off) and reconstruct_lr.
    Setting one the criterion does not take is an error."""

    _key: ClassVar[str] = "prune.options"
    blocksize: int | None = number(None, 1, 2**20)
    percdamp: float | None = number(None, 0, 10, low_open=True)
    sequential: bool | None = None
    rho: float | None = number(None, 0, 1e6, low_open=True)
    iters: int | None = number(None, 1, 10**6)
    cg_iters: int | None = number(None, 0, 10**6)
    reconstruct_steps: int | None = number(None, 0, 10**7)
    reconstruct_lr: float | None = number(None, 0, 1, low_open=True)

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
    _open: ClassVar = {"criterion": lambda: _criteria().CRITERIA}
    pattern: str = "2:4"
    sparsity: float | None = number(None, 0, 1, high_open=True)
    criterion: str = "magnitude"
    scope: Scope = Scope.layer
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)
    calibration_batches: int = number(8, 1)
    strict: bool = False
    fine_tune: bool = True  # false: one shot, no fine-tuning
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    options: CriterionOptions = field(default_factory=CriterionOptions)

    def check(self) -> None:
        check_include(self.include, self._option("include"))
        nm = parse_nm(self.pattern)
        if self.pattern == "unstructured" and self.sparsity is None:
            raise ConfigError("prune.sparsity (a float in [0, 1)) is required for unstructured")
        if nm is not None and self.sparsity is not None and not math.isclose(
            self.sparsity, 1 - nm[0] / nm[1], abs_tol=1e-9
        ):
            raise ConfigError(
                f"prune.sparsity={self.sparsity!r} contradicts prune.pattern={self.pattern!r} "
                f"(which implies {1 - nm[0] / nm[1]:g}); set prune.sparsity=null"
            )
        given = self.options.given()
        if given and checks_registries() and self.criterion in _criteria().CRITERIA:
            takes = tuple(getattr(_criteria().get_criterion(self.criterion), "options", ()))
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
    start: int = number(0, 0)
    end: int = number(500, 0)
    every: int = number(50, 1)

    def check(self) -> None:
        if self.end < self.start:
            raise ConfigError(f"schedule.end={self.end} must be >= schedule.start={self.start}")


@dataclass
class QuantConfig(_Checked):
    """``scheme``: none or a registered quantization scheme (:data:`quant.SCHEMES`).
    ``method`` (post-training): ``rtn`` rounds to nearest; ``gptq`` (int4 schemes) quantizes
    layer by layer on the calibration batches with GPTQ's error compensation; with
    ``prune.criterion=sparsegpt`` (N:M, no fine-tuning) pruning and quantization are then one
    sweep (joint SparseGPT + GPTQ). ``act_order``: GPTQ's columns by decreasing Hessian diagonal
    (not with a joint N:M sweep). ``compare``: with ``method=gptq``, also evaluate the pruned
    model before quantization and with round-to-nearest, for summary.json's ``variants``.
    ``group_size`` (int4 schemes; null: the scheme's own): 128, 64 or 32 inputs per weight
    scale, ``channel`` (one per output channel) or ``auto`` (per layer the largest of 128, 64,
    32 dividing its input size, else channel); a group that does not divide a selected
    layer's input size stops the run with one line naming the layer and the sizes that fit."""

    _key: ClassVar[str] = "quant"
    _open: ClassVar = {"scheme": lambda: ("none", *_schemes().names()), }
    scheme: str = "none"
    qat: bool = False
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=list)
    method: QuantMethod = QuantMethod.rtn
    act_order: bool = False
    compare: bool = False
    group_size: Any = None  # null or one of names.GROUP_SIZE_CHOICES

    def check(self) -> None:
        if self.group_size is not None:
            if self.scheme == "none":
                raise ConfigError(f"quant.group_size={self.group_size} needs an int4 "
                                  "quant.scheme (int4_weight, int4_weight_channel)")
            try:
                self.group_size = names.check_group_size(self.group_size, "quant.group_size")
                if checks_registries():  # the scheme takes groups: an int4 one
                    _schemes_module().check_scheme_group_size(self.scheme, self.group_size,
                                                              "quant.group_size")
            except UsageError as e:
                raise ConfigError(str(e)) from None
        if (self.method == "gptq" and self.scheme != "none" and checks_registries()
                and not _schemes()[self.scheme].grouped):
            raise ConfigError(f"quant.method=gptq quantizes int4 weights; quant.scheme="
                              f"{self.scheme} takes quant.method=rtn")
        if self.method == "gptq" and self.qat:
            raise ConfigError("quant.method=gptq is post-training; set quant.qat=false (QAT "
                              "converts its fake-quantized weights by rounding)")
        if (self.act_order or self.compare) and self.method != "gptq":
            raise ConfigError("quant.act_order and quant.compare go with quant.method=gptq")
        check_include(self.include, self._option("include"))


@dataclass
class DistillConfig(_Checked):
    """Knowledge distillation from the dense teacher (``sk.Distiller``): loss = (1 - alpha) *
    task loss + alpha * distillation loss; ``alpha=0`` turns it off. ``target``/``loss`` auto:
    KL on the logits (``T^2 * KL(teacher_T || student_T)``) for classifiers and language
    models, ``1 - cos`` of the pooled embeddings for ``data.task=embedding`` (where the
    distillation loss is the whole loss). ``feature_weight`` > 0 adds per-layer feature
    matching of the hidden states (``feature_loss`` per token)."""

    _key: ClassVar[str] = "train.distill"
    alpha: float = number(0.0, 0, 1)
    temperature: float = number(2.0, 0, 1e4, low_open=True)
    target: DistillTarget = DistillTarget.auto
    loss: DistillLoss = DistillLoss.auto
    feature_weight: float = number(0.0, 0, 1e6)
    feature_loss: FeatureLoss = FeatureLoss.cosine


@dataclass
class TrainConfig(_Checked):
    """Dense training and fine-tuning. Steps count optimizer steps (one batch each)."""

    _key: ClassVar[str] = "train"
    dense_steps: int = number(6000, 0)
    dense_lr: float = number(1e-2, 0, 10)  # 0: no dense training (dense_steps=0)
    finetune_steps: int = number(1000, 0)
    finetune_lr: float = number(2e-3, 0, 10)
    finetune_warmup: int = number(0, 0)  # linear warm-up steps of the fine-tuning's lr
    finetune_dropout: bool = True  # false: fine-tune in eval mode (no dropout)
    optimizer: Optimizer = Optimizer.adamw
    weight_decay: float = number(0.0, 0, 10)
    lr_schedule: LRSchedule = LRSchedule.cosine
    warmup_steps: int = number(0, 0)
    grad_clip: float = number(0.0, 0)  # max gradient norm; 0 disables clipping
    log_every: int = number(50, 1)
    eval_every: int = number(250, 1)
    checkpoint_every: int = number(250, 1)
    # fine-tuning arithmetic: fp32, or bf16 autocast (weights and optimizer stay float32)
    precision: TrainPrecision = TrainPrecision.fp32
    # stop fine-tuning after this many minutes (0: no limit), writing the resume checkpoint:
    # `resume=true` goes on where it stopped (a GPU lent for 10 minutes a call, a queue slot)
    max_minutes: float = number(0.0, 0, 10**6)
    # fine-tuning arithmetic: fp32, or bf16 autocast (weights and optimizer stay float32)
    precision: TrainPrecision = TrainPrecision.fp32
    # stop fine-tuning after this many minutes (0: no limit), writing the resume checkpoint:
    # `resume=true` goes on where it stopped (a GPU lent for 10 minutes a call, a queue slot)
    max_minutes: float = number(0.0, 0)
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = number(0, 0, 2**32 - 2)  # numpy seeds are < 2**32; the run also uses seed + 1
    device: Device = Device.auto
    cpu_threads: int = number(0, 0, 4096)  # torch intra-op threads on CPU; 0 keeps torch's default
    # under torchrun: ddp (replicated weights) | fsdp2 (sharded weights, fully_shard) | auto
    # (= ddp under torchrun, else none) | none; see docs/distributed.md
    distributed: Distributed = Distributed.auto
    quiet: bool = False  # no progress bars (also: environment SPARSEKIT_QUIET=1)


@dataclass
class TrackerConfig(_Checked):
    _key: ClassVar[str] = "tracker"
    kind: TrackerKind = TrackerKind.tensorboard
    flush_secs: int = number(10, 1)
    histograms: bool = True
    # at least this many steps between two sets of weight histograms
    histogram_every: int = number(200, 1)


@dataclass
class BenchConfig(_Checked):
    _key: ClassVar[str] = "bench"
    enabled: bool = True
    batch_size: int = number(256, 1)  # throughput batch; latency is always measured at batch 1
    warmup: int = number(5, 0)
    repeats: int = number(20, 1)  # timed calls; figures are their median, with p10 and p90
    # a causal LM with accel on CUDA: generation speed, new tokens after a prompt (batch 1)
    new_tokens: int = number(128, 1)
    prompt_tokens: int = number(128, 1)


@dataclass
class AccelConfig(_Checked):
    """``precision``: one with dense and 2:4 accel variants registered (accel.layers).
    ``siblings``: layers fed one tensor (q/k/v, gate/up) as one GEMM (``sk.accelerate``).
    ``decode_dense``: under sparsity auto, a bf16 copy of a 2:4 layer for the decode batch
    sizes where dense is faster (``sk.PlanOptions``). ``capture``: sparsekit's own CUDA graphs
    (null: where the inputs allow; false: torch.compile's reduce-overhead mode)."""

    _key: ClassVar[str] = "accel"
    _open: ClassVar = {"precision": lambda: _kernels().precisions(),
                       "sparsity": lambda: _kernels().SPARSITIES}
    enabled: bool = False
    precision: str = "bf16"
    sparsity: str = "2:4"
    min_speedup: float = number(1.0, 0, 1e3, low_open=True)
    siblings: bool = False
    decode_dense: bool = True
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
    target: float | None = number(None, 0, 1, high_open=True)
    dense_layers: int | None = number(None, 0, 2**31 - 1)
    dense_params: float | None = number(None, 0, 1, high_open=True)

    def check(self) -> None:
        levels = list(self.sparsities)
        if (not levels or any(isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0.0 < v < 1.0 for v in levels)
                or len(set(levels)) != len(levels)):
            raise ConfigError(f"sensitivity.sparsities={levels} must be distinct levels in (0, 1)"
                              " (e.g. [0.5, 0.9])")


# The keyword arguments of the built-in models and data (``model.kwargs``, ``data.kwargs``),
# as schemas of their own: the same type and range checks as every other key, before any work.
# Defaults are the builders' own (tests/test_cli_fuzz.py compares them with the signatures).
SEED = (0, 2**32 - 1)  # numpy's seeds


@dataclass
class Mnist1dArgs(_Checked):
    """data=mnist1d: :func:`sparsekit.data.mnist1d.mnist1d`."""

    _key: ClassVar[str] = "data.kwargs"
    num_samples: int = number(5000, 10, 10**7)
    seed: int = number(42, *SEED)
    train_split: float = number(0.8, 0, 1, low_open=True, high_open=True)


@dataclass
class StdlibTextArgs(_Checked):
    """data=stdlib_text: :func:`sparsekit.data.text.stdlib_text`."""

    _key: ClassVar[str] = "data.kwargs"
    seq_len: int = number(128, 1, 2**20)
    max_bytes: int = number(2_000_000, 1)
    eval_fraction: float = number(0.1, 0, 1, low_open=True, high_open=True)


@dataclass
class TextArgs(_Checked):
    """data=text: :func:`sparsekit.data.hf_text.text_data` (besides path, tokenizer and
    seq_len, which are keys of ``data``)."""

    _key: ClassVar[str] = "data.kwargs"
    eval_fraction: float = number(0.1, 0, 1, low_open=True, high_open=True)
    calibration_fraction: float = number(0.05, 0, 1, low_open=True, high_open=True)
    text_field: str = "text"
    mlm_probability: float = number(0.15, 0, 1, low_open=True, high_open=True)
    seed: int = number(0, *SEED)

    def check(self) -> None:
        if self.eval_fraction + self.calibration_fraction >= 1:
            raise ConfigError("data.kwargs.eval_fraction + data.kwargs.calibration_fraction "
                              f"= {self.eval_fraction + self.calibration_fraction:g} must be < 1")


@dataclass
class Mnist1dCNNArgs(_Checked):
    """model=mnist1d_cnn: :func:`sparsekit.models.cnn1d.mnist1d_cnn`."""

    _key: ClassVar[str] = "model.kwargs"
    num_classes: int = number(10, 1, 2**20)
    channels: int = number(32, 1, 2**16)
    in_len: int = number(40, 3, 2**20)  # three stride-2 convolutions need 3 samples


@dataclass
class TinyLMArgs(_Checked):
    """model=tiny_lm: :func:`sparsekit.models.lm.tiny_lm`."""

    _key: ClassVar[str] = "model.kwargs"
    vocab_size: int = number(256, 1, 2**20)
    d_model: int = number(128, 1, 2**16)
    n_layers: int = number(4, 1, 1024)
    n_heads: int = number(4, 1, 2**16)
    seq_len: int = number(128, 1, 2**20)

    def check(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.kwargs.d_model={self.d_model} must be a multiple of "
                              f"model.kwargs.n_heads={self.n_heads}")


#: (section, built-in name) -> the schema of its kwargs
BUILTIN_KWARGS: dict[tuple[str, str], type[_Checked]] = {
    ("data", "mnist1d"): Mnist1dArgs, ("data", "stdlib_text"): StdlibTextArgs,
    ("data", "text"): TextArgs, ("model", "mnist1d_cnn"): Mnist1dCNNArgs,
    ("model", "tiny_lm"): TinyLMArgs,
}


def check_builtin_kwargs(section: str, name: str, kwargs: dict[str, Any]) -> None:
    """``kwargs`` of the built-in ``section`` (model or data) ``name`` against its schema
    (:data:`BUILTIN_KWARGS`): known names, types and ranges; ConfigError naming the key."""
    schema = BUILTIN_KWARGS.get((section, name))
    if schema is None:
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key in kwargs:
        if key not in names:
            raise ConfigError(f"{section}.kwargs.{key}: {section}={name} takes no such argument; "
                              f"it takes: {', '.join(names)}")
    schema(**kwargs)


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

    def _check_inputs_used(self) -> None:
        for option, value, used, by in _used_by(self):
            if value is not None and not used:
                choice = (f"model={self.model.name}" if option.startswith("model")
                          else f"data={self.data.name}")
                raise ConfigError(
                    f"{option}={value!r} is read only by {by}, and this run uses {choice}: add "
                    f"{by.split()[0]} (or a recipe such as recipe=llm_sparsegpt_24), or drop "
                    f"{option}"
                )

    def _check_teacher(self) -> None:
        d, m = self.data, self.model
        if d.teacher_samples and not (m.name == "hf" and m._target_ is None
                                      and d.name == "text" and d._target_ is None):
            raise ConfigError(
                f"data.teacher_samples={d.teacher_samples} needs a causal LM to write them and "
                f"text to window them: model=hf and data=text (this run: model={m.name}, "
                f"data={d.name}); or recipe=llm_datafree_24_distill")

    def _check_schedule_in_steps(self) -> None:
        """Masks that move while fine-tuning reach their target by its last step: a schedule
        ending at or after ``train.finetune_steps`` would prune the rest at finalize, with no
        step left to recover (an error, not a silent drop in accuracy)."""
        p, s, steps = self.prune, self.schedule, self.train.finetune_steps
        prunes = p.pattern != "none" or p.channel.ratio > 0
        if not (prunes and p.fine_tune and steps > 0):
            return
        key, last = ("schedule.start", s.start) if s.kind == "oneshot" else ("schedule.end",
                                                                              s.end)
        if last >= steps:
            raise ConfigError(
                f"{key}={last} is not before the last fine-tuning step (train.finetune_steps="
                f"{steps}: steps 0..{steps - 1}): the masks would reach their target only at "
                f"the end, with no step to recover; set {key} below {steps} (e.g. "
                f"{key}={steps // 2}) or train.finetune_steps above {last}")

    def check(self) -> None:
        self._check_inputs_used()
        self._check_teacher()
        for section in (self.model, self.data):
            if section._target_ is None:
                check_builtin_kwargs(section._key, section.name, dict(section.kwargs))
        if not (self.resume is None or isinstance(self.resume, bool)
                or (isinstance(self.resume, str) and self.resume.strip())):
            raise ConfigError(f"resume={self.resume!r} must be true, false or a run directory")
        p, sens = self.prune, self.sensitivity
        if (self.model.task == "feature_extraction" and self.data.name == "text"
                and self.data.task == "lm"):
            # text for an embedding model: no next token to predict; agreement with the dense
            # model's embeddings is what is measured (and what fine-tuning distils)
            self.data.task = Task.embedding
        if (checks_registries() and _criteria().is_solver(p.criterion) and p.fine_tune
                and self.schedule.kind != "oneshot"):
            raise ConfigError(
                f"prune.criterion={p.criterion} is one shot: set schedule=oneshot (prune at "
                "schedule.start, then fine-tune) or prune.fine_tune=false"
            )
        if joint_gptq(self) and (p.include != self.quant.include
                                 or p.exclude != self.quant.exclude):
            raise ConfigError(
                "prune.criterion=sparsegpt with quant.method=gptq prunes and quantizes in one "
                "sweep: give prune and quant the same include/exclude")
        if joint_gptq(self) and self.quant.act_order:
            raise ConfigError("quant.act_order=true cannot go with a joint SparseGPT + GPTQ "
                              "sweep (N:M groups must stay consecutive columns)")
        own = (None if self.quant.scheme == "none" or not checks_registries()
               else _kernels().scheme_precision(self.quant.scheme))
        if self.accel.enabled and own is not None and self.accel.precision != own:
            raise ConfigError(
                f"accel.precision={self.accel.precision} cannot run quant.scheme="
                f"{self.quant.scheme} layers: set accel.precision={own} (the scheme's "
                "numerics)"
            )
        self._check_schedule_in_steps()
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


def joint_gptq(cfg: Config) -> bool:
    """Whether the run prunes and quantizes in one sweep: SparseGPT N:M in one shot (no
    fine-tuning) with GPTQ post-training quantization."""
    p, q = cfg.prune, cfg.quant
    return (q.scheme != "none" and q.method == "gptq" and str(p.criterion) == "sparsegpt"
            and not p.fine_tune and parse_nm(str(p.pattern)) is not None)


def _used_by(cfg: Config) -> list[tuple[str, object, bool, str]]:
    """(option, its value, whether this run reads it, the choice that reads it) for the
    options only some models or data read: set where nothing reads them, they would be
    ignored without a word (model.path without model=hf would run the default model)."""
    m, d = cfg.model, cfg.data
    hf = m.name == "hf" and m._target_ is None
    text = d.name == "text" and d._target_ is None
    return [
        ("model.path", m.path, hf, "model=hf (a local transformers directory or .gguf file)"),
        ("model.config", m.config, hf, "model=hf (a transformers config: random weights)"),
        ("model.task", m.task, hf, "model=hf"),
        ("data.path", d.path, text, "data=text (local .txt/.jsonl files)"),
        ("data.tokenizer", d.tokenizer, text or hf, "data=text or model=hf"),
        ("data.eval_path", d.eval_path, text, "data=text (local .txt/.jsonl files)"),
    ]


def plugin_keys() -> dict[str, Registry]:
    """The registry-backed keys: a run directory's recorded value must be registered in code
    (built in), never an installed plugin (``sparsekit.registry.from_file``)."""
    return {"prune.criterion": _criteria().CRITERIA,
            "prune.channel.criterion": _channel_criteria(), "quant.scheme": _schemes()}


def check_include(include: list[str], option: str) -> None:
    """An include list selects layers: an empty one would select none (refused here rather
    than after the dense model is trained)."""
    if not list(include):
        raise ConfigError(f"{option}=[] selects no layer: use {option}=['*'] for every layer, "
                          "or name the layers")


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
