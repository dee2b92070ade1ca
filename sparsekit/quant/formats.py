"""The number formats (int8, float8 e4m3, int4) and the schemes built from them.

A *format* is a storage dtype plus the largest magnitude it represents; symmetric scales map a
tensor's absolute maximum onto that magnitude. A *scheme* says which format the weights use,
whether (and in which format) activations are quantized, and how their scales are found.

``int8_weight_only`` and ``fp8_weight_only`` (W8A16) quantize the weights alone; activations
stay in the model's dtype. Weights have one scale per output channel, except in
``fp8_static_tensor``: one scale for the
whole weight (``max |W| / 448``, torchao's default fp8 granularity). With its static activation
scale the GEMM's whole rescale is then one scalar, which a kernel taking only a scalar in its
epilogue (cuSPARSELt's fp8 ``alpha``) applies inside the GEMM. The 4-bit weight-only schemes
(W4A16, activations stay in the model's dtype) have one scale per *group* of input channels:
``int4_weight`` one per 128 consecutive inputs of each output channel, ``int4_weight_g64`` and
``int4_weight_g32`` one per 64 and 32, ``int4_weight_channel`` one per output channel (a single
group spanning the input); see :mod:`sparsekit.quant.modules` for how those layers store them.
``quantize_``'s and ``prepare_qat_``'s ``group_size`` (``quant.group_size``) picks among them
per model or, with ``"auto"``, per layer (:func:`layer_scheme`). Activation scales are:

- dynamic (``int8``, ``fp8``): one scale per token (per sample for convolutions), from the
  activation itself at every call. Nothing to calibrate; one extra pass over each row.
- static (``int8_static``, ``fp8_static``, ``fp8_static_tensor``): one scale per layer input,
  fixed: set from calibration batches by ``quantize_`` or tracked during QAT (a moving average
  of the batch absmax), then frozen. Values beyond it saturate. Quantizing is then elementwise,
  so on the GPU it fuses into the op producing the activation with no reduction over the row
  (the vLLM / compressed-tensors "static per-tensor" activation scheme).

>>> get_scheme("int8")  # doctest: +NORMALIZE_WHITESPACE
Scheme(name='int8', weight=Format(name='int8'), activation=Format(name='int8'), static=False,
       weight_granularity='channel')
>>> get_scheme("int8_weight_only").activation is None
True
>>> get_scheme("fp8_static").static
True
>>> get_scheme("fp8_static_tensor").weight_granularity
'tensor'
>>> get_scheme("int4_weight").group_size, get_scheme("int4_weight").weight.qmin
(128, -8.0)
>>> layer_scheme("int4_weight", "auto", "mlp.up", 576).name  # 576 = 64 * 9
'int4_weight_g64'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.names import INT4_GROUP_SIZES, check_group_size
from sparsekit.registry import Registry


@dataclass(frozen=True)
class Format:
    """A storage format: ``dtype`` holds the values, ``qmax`` is the largest magnitude a
    symmetric scale maps the absolute maximum to (127 for int8, so -128 is never used and the
    grid is symmetric; 448 for float8 e4m3fn, its largest finite value; 7 for int4), and
    ``qmin`` the lowest value quantized values are clamped to (``-qmax`` unless given: -8 for
    int4, reachable only where a fixed scale or GPTQ's error feedback pushes a value past
    ``-7``). int4 values are held one per byte in an int8 tensor.

    :meth:`cast` is the format's handler: how values already divided by their scale become
    stored values. A scheme with a format of its own subclasses ``Format``, overrides ``cast``
    and registers the scheme (:func:`register_scheme`); quantization, QAT and checkpoints then
    use it. The built-in GPU kernels (``sparsekit.accel``) take the built-in formats only."""

    name: str
    dtype: torch.dtype = field(repr=False)
    qmax: float = field(repr=False)
    qmin: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.qmin is None:
            object.__setattr__(self, "qmin", -self.qmax)

    @property
    def integer(self) -> bool:
        """Whether values round to integers (int8, int4) rather than cast to float8."""
        return not self.dtype.is_floating_point

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (float32, already divided by the scale) as stored values in ``dtype``: an
        integer dtype rounds half to even and clamps to [qmin, qmax]; a float dtype clamps,
        then casts (round to nearest even). May work in place on ``t``."""
        if not self.dtype.is_floating_point:
            return t.round_().clamp_(self.qmin, self.qmax).to(self.dtype)
        # Clamp first: how an out-of-range cast to float8 behaves (saturate or NaN) varies by
        # torch version.
        return t.clamp_(-self.qmax, self.qmax).to(self.dtype)


INT8 = Format("int8", torch.int8, 127.0)
FP8 = Format("fp8", torch.float8_e4m3fn, 448.0)
INT4 = Format("int4", torch.int8, 7.0, -8.0)

# How many weight scales a scheme has: one per output channel, one for the whole tensor, or
# one per group of ``group_size`` consecutive input channels of each output channel.
WEIGHT_GRANULARITIES = ("channel", "tensor", "group")


@dataclass(frozen=True)
class Scheme:
    """A quantization scheme: weight format, activation format (None keeps activations in
    float), whether activation scales are ``static`` (one per layer input, calibrated) rather
    than dynamic (one per token row or per sample), and ``weight_granularity``: ``"channel"``
    (one weight scale per output channel), ``"tensor"`` (one for the whole weight; the
    quantized layers still store it once per output channel, all equal) or ``"group"`` (one
    per ``group_size`` consecutive input channels of each output channel; int4 weights only).
    int4 layers always store 2-D scales (out, in // group), a per-channel scheme as one group
    spanning the input."""

    name: str
    weight: Format
    activation: Format | None
    static: bool = False
    weight_granularity: str = "channel"
    group_size: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.static and self.activation is None:
            raise UsageError(f"scheme {self.name!r}: static=True needs an activation format")
        if self.weight_granularity not in WEIGHT_GRANULARITIES:
            raise UsageError(f"scheme {self.name!r}: unknown weight_granularity "
                             f"{self.weight_granularity!r}; allowed: "
                             f"{', '.join(map(repr, WEIGHT_GRANULARITIES))}")
        grouped = self.weight_granularity == "group"
        if grouped != (self.group_size is not None):
            raise UsageError(f"scheme {self.name!r}: group_size goes with "
                             "weight_granularity='group' (and only with it)")
        if grouped and not (self.group_size > 0 and self.weight is INT4):
            raise UsageError(f"scheme {self.name!r}: group scales need int4 weights and a "
                             f"positive group_size, got {self.weight.name}, {self.group_size}")
        if self.weight is INT4 and (self.activation is not None or
                                    self.weight_granularity == "tensor"):
            raise UsageError(f"scheme {self.name!r}: int4 weights are weight-only, with group "
                             "or channel scales")

    @property
    def grouped(self) -> bool:
        """Whether layers store 2-D weight scales (out, in // group): the int4 schemes."""
        return self.weight is INT4

    def layer_group_size(self, in_features: int) -> int:
        """Input channels per weight scale of a layer with ``in_features`` inputs (grouped
        schemes): ``group_size``, or ``in_features`` for one scale per output channel."""
        return self.group_size if self.group_size is not None else in_features


SCHEMES: Registry[Scheme] = Registry("quantization scheme")


def register_scheme(scheme: Scheme) -> None:
    """Make ``scheme`` available by its name to ``quantize_``, ``prepare_qat_``, ``sk.load``
    and ``quant.scheme``. Its formats' :meth:`Format.cast` is how its values are stored.

    >>> class Int4(Format):  # int8 storage, [-7, 7], halves rounded away from zero
    ...     def cast(self, t):
    ...         return (t.sign() * (t.abs() + 0.5).floor()).clamp_(-7, 7).to(torch.int8)
    >>> register_scheme(Scheme("int4_weight_only", Int4("int4", torch.int8, 7.0), None))
    >>> get_scheme("int4_weight_only").weight.cast(torch.tensor([2.5, -0.5, 9.0]))
    tensor([ 3, -1,  7], dtype=torch.int8)
    >>> SCHEMES.unregister("int4_weight_only")
    """
    if not isinstance(scheme, Scheme):
        raise ConfigTypeError(f"register_scheme takes a Scheme, got {type(scheme).__name__}")
    SCHEMES.register(scheme.name, scheme)


# the int4 weight schemes by group size (names.INT4_GROUP_SIZES, largest first; "channel": one
# group spanning the input)
INT4_GROUP_SCHEMES = {128: "int4_weight", 64: "int4_weight_g64", 32: "int4_weight_g32",
                      "channel": "int4_weight_channel"}

for _scheme in (Scheme("int8_weight_only", INT8, None), Scheme("fp8_weight_only", FP8, None),
                Scheme("int8", INT8, INT8),
                Scheme("fp8", FP8, FP8), Scheme("int8_static", INT8, INT8, static=True),
                Scheme("fp8_static", FP8, FP8, static=True),
                Scheme("fp8_static_tensor", FP8, FP8, static=True,
                       weight_granularity="tensor"),
                *(Scheme(INT4_GROUP_SCHEMES[g], INT4, None, weight_granularity="group",
                         group_size=g) for g in INT4_GROUP_SIZES),
                Scheme("int4_weight_channel", INT4, None)):
    register_scheme(_scheme)


def get_scheme(scheme: str | Scheme) -> Scheme:
    """The :class:`Scheme` named ``scheme``; ValueError naming the allowed names otherwise."""
    if isinstance(scheme, Scheme):
        return scheme
    if not isinstance(scheme, str):
        raise UsageError(f"unknown quantization scheme {scheme!r}; allowed: "
                         f"{', '.join(map(repr, SCHEMES.names()))}")
    return SCHEMES[scheme]


def check_scheme_group_size(scheme: str | Scheme, group_size: object,
                            option: str = "group_size") -> int | str | None:
    """:func:`~sparsekit.names.check_group_size`, and a UsageError when a group size is given
    for a scheme other than the int4 weight ones."""
    scheme = get_scheme(scheme)
    group = check_group_size(group_size, option)
    if group is not None and not scheme.grouped:
        raise UsageError(f"{option}={group} applies to the int4 weight schemes "
                         f"({', '.join(INT4_GROUP_SCHEMES.values())}), not {scheme.name!r}")
    return group


def fitting_group_sizes(in_features: int) -> list[int | str]:
    """The int4 group sizes that divide ``in_features`` (largest first), then ``"channel"``
    (which always fits).

    >>> fitting_group_sizes(576), fitting_group_sizes(1536), fitting_group_sizes(100)
    ([64, 32, 'channel'], [128, 64, 32, 'channel'], ['channel'])
    """
    return [g for g in INT4_GROUP_SIZES if in_features % g == 0] + ["channel"]


def layer_scheme(scheme: str | Scheme, group_size: object, layer: str,
                 in_features: int) -> Scheme:
    """The scheme a Linear ``layer`` with ``in_features`` inputs is quantized with under
    ``scheme`` and ``group_size`` (one of :data:`~sparsekit.names.GROUP_SIZE_CHOICES`):
    ``scheme`` itself when ``group_size`` is None; else the int4 scheme of that group
    (``scheme`` must be an int4 one), the one-line UsageError naming the layer, its input
    size and the group sizes that fit when the group does not divide it; ``"auto"``: the
    largest of 128, 64, 32 dividing ``in_features``, else one scale per output channel."""
    scheme = get_scheme(scheme)
    group = check_scheme_group_size(scheme, group_size)
    if group is None:
        return scheme
    fits = fitting_group_sizes(in_features)
    if group == "auto":
        group = fits[0]
    elif group not in fits:
        raise UsageError(f"layer {layer!r}: in_features={in_features} is not a multiple of "
                         f"group_size={group}; group sizes that fit it: "
                         f"{', '.join(map(str, fits))} (or group_size=auto: the largest "
                         "that fits, per layer; or exclude the layer)")
    return SCHEMES[INT4_GROUP_SCHEMES[group]]
