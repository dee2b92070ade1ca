"""Accelerated linear layers: bf16 / fp8 / int8, dense or 2:4 (their numerics); the int4
weight-only ones (W4A16) are in :mod:`sparsekit.accel.layers_int4` and registered here too.

Each class computes ``x @ W.T + b`` for x (..., K) -> (..., N) in bfloat16, and is built from a
float ``nn.Linear`` (weights already holding their 2:4 zeros for the sparse ones) or from a
:class:`~sparsekit.quant.QuantLinear` of the matching scheme, whose 8-bit weights and scales it
takes as they are. ``VARIANTS`` maps the names used in reports and configs to the classes.
Which kernels run a layer is its plan's business (:class:`~sparsekit.accel.linear.AccelLinear`:
one forward over a frozen per-layer plan of registered kernels); a class here says only what
the kernels compute: its ``precision`` and pattern, the activation quantization, the scales,
the bias.

The same module runs on either device: on CUDA the kernels' ops run cuSPARSELt / cuBLAS /
sparsekit's kernels, on CPU their plain-torch references. The W8A8 layers quantize activations
per token with :mod:`sparsekit.quant.numerics` (what ``quantize_`` and QAT compute), written
as plain torch ops so the compiler fuses them into the op producing the activation (a layer
built from a static-scheme QuantLinear takes its one ``input_scale``: elementwise); the 2:4
8-bit layers apply ``acc * x_scale * w_scale + bias`` in plain torch too, fused into what
consumes the output, except an fp8 2:4 layer with one activation and one weight scale
(``fp8_static_tensor``), whose scale and bias run inside the GEMM (:class:`FP8Sparse24`).
No forward reads tensor data on the host.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekit.accel import ops
from sparsekit.accel.layers_int4 import Int4Dense, Int4Sparse24
from sparsekit.accel.linear import AccelLinear
from sparsekit.errors import UsageError
from sparsekit.quant.formats import FP8, INT8, Format, get_scheme
from sparsekit.quant.modules import QuantLinear
from sparsekit.quant.numerics import channel_scales, quantize
from sparsekit.registry import Registry


def _weights(layer: nn.Module, fmt: Format | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, per-channel scale) of ``layer`` in ``fmt`` (bf16 and no scale when None).
    A QuantLinear of the same format gives its stored values; one of another format (int4
    values are stored in int8 too: the scheme's format decides), or a float layer, is quantized
    here with quant's numerics."""
    if isinstance(layer, QuantLinear):
        if fmt is not None and get_scheme(layer.scheme).weight == fmt:
            return layer.weight.detach(), layer.weight_scale.detach().float()
        w = layer.dequantized_weight(torch.float32)
    else:
        w = layer.weight.detach().float()
    if fmt is None:
        return w.to(torch.bfloat16), None
    scale = channel_scales(w, fmt)
    return quantize(w, scale[:, None], fmt), scale


def one_scale(scale: torch.Tensor | None) -> bool:
    """Whether per-channel weight ``scale`` holds one value (a per-tensor scheme's scale,
    stored once per output channel): the rescale is then a scalar a GEMM epilogue can take."""
    return scale is not None and bool((scale == scale.reshape(-1)[0]).all())


class _AccelLinear(AccelLinear):
    """The bf16 and 8-bit layers' numerics. ``alg_id``: the cuSPARSELt algorithm (2:4 layers);
    ``fused_quant``: per-token activation quantization as plain torch ops (fused by the
    compiler) or as the opaque ``sparsekit::quant_rows`` op (kept to measure the fusion)."""

    # the planner times up to which M a 2:4 layer's small-M kernel beats its large-M one
    tune_limit = True

    def __init__(self, linear: nn.Module, alg_id: int = 0, fused_quant: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.alg_id = int(alg_id)
        self.fused_quant = fused_quant
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else
                             bias.detach().to(torch.bfloat16).contiguous())
        w, scale = _weights(linear, self.fmt)
        self.register_buffer("w_scale", scale)
        # a static-scheme QuantLinear's one activation scale (None: per-token dynamic scales)
        static = (self.fmt is not None and isinstance(linear, QuantLinear)
                  and "input_scale" in linear._buffers
                  and get_scheme(linear.scheme).activation == self.fmt)
        self.register_buffer("act_scale", linear.input_scale.detach().float().clone()
                             if static else None)
        # for the report's notes: built from a quantized layer, with one weight scale
        self.quantized = isinstance(linear, QuantLinear)
        self.tensor_scale = (self.quantized
                             and get_scheme(linear.scheme).weight_granularity == "tensor")
        self.start(w.contiguous())

    def quant(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x2d in the weight's format and its per-row scale (M, 1) float32: bf16 and None for a
        weight-only layer (W8A16), elementwise by a static scale, else per token."""
        if self.weight_only:
            return x2d.to(torch.bfloat16), None
        if self.act_scale is not None:  # static: elementwise, fused into the producer
            return quantize(x2d, self.act_scale, self.fmt), self.act_scale.expand(len(x2d), 1)
        if self.fused_quant:
            return ops.act_quant_rows(x2d, self.fmt)
        return ops.quant_rows(x2d, self.fmt.dtype)

    def epilogue(self, acc: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """``acc * x_scale * w_scale + bias`` in float32, as bf16."""
        y = acc.float() * x_scale * self.w_scale
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(torch.bfloat16)

    def gemm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The weight a 2:4 GEMM of this layer's numerics takes: its values as they are."""
        return w

    @property
    def path(self) -> str:
        """The large-M route, part of the algorithm cache's key: "cslt" (torch's cuSPARSELt
        binding), "cslt_alpha" (sparsekit's), "widen" (fp8 weight-only 2:4), "dense"."""
        return "cslt" if self.sparse else "dense"


class DenseBF16(_AccelLinear):
    """bf16 dense (cuBLAS): the baseline every other variant is timed against."""

    variant, precision = "bf16_dense", "bf16"


class Sparse24BF16(_AccelLinear):
    """bf16 2:4: cuSPARSELt at large M (bias fused in the GEMM), a small-M kernel up to 32."""

    variant, precision = "bf16_2:4", "bf16"
    sparse = True
    uses_alg = True


class FP8Dense(_AccelLinear):
    """W8A8 float8 e4m3 dense (``torch._scaled_mm``, row-wise scales and bias in its
    epilogue); activations quantized per token."""

    variant, precision = "fp8_dense", "fp8"
    fmt = FP8


class FP8Sparse24(_AccelLinear):
    """W8A8 float8 e4m3 2:4 (cuSPARSELt), activations quantized per token (or by a static
    scheme's one scale).

    With one activation scale and one weight scale per tensor (the ``fp8_static_tensor``
    scheme) the layer is ``act(alpha * x @ W.T + bias)`` with a scalar alpha, run by sparsekit's
    own binding with the scale and bias in cuSPARSELt's epilogue (``path`` "cslt_alpha"; GELU
    too, after the compiler pass :class:`~sparsekit.accel.epilogue.FuseGelu`). Otherwise
    (per-token or per-channel scales: cuSPARSELt has no per-row scale and refuses per-channel
    alpha vectors for fp8 on the H200, or the binding could not be built) the bf16 product
    comes from torch's binding and the scales and bias are applied after it in plain torch
    (``path`` "cslt")."""

    variant, precision = "fp8_2:4", "fp8"
    sparse = True
    uses_alg = True
    fmt = FP8

    @property
    def scalar_scale(self) -> float | None:
        if self.act_scale is None or not one_scale(self.w_scale):
            return None
        return float(self.act_scale.reshape(-1)[0]) * float(self.w_scale[0])

    @property
    def alpha(self) -> float | None:
        """The scalar scale where a kernel of its plan applies it inside the GEMM (the
        cuSPARSELt binding loaded), else None."""
        return next((w.alpha for w in self.formats.values()
                     if w.items().get("alpha") is not None), None)

    @property
    def path(self) -> str:
        return "cslt" if self.alpha is None else "cslt_alpha"


class FP8WDense(_AccelLinear):
    """W8A16 float8 e4m3 weight-only dense: per-channel e4m3 weights, bf16 activations; the
    weight widened to bf16 on each call and multiplied by ``F.linear`` (cuBLAS), its scales
    applied after. It keeps 1 byte a weight; no kernel reads it narrower (under ``sparsity="auto"``
    the planner times it against bf16 dense)."""

    variant, precision = "fp8w_dense", "fp8w"
    fmt = FP8
    weight_only = True


class FP8WSparse24(_AccelLinear):
    """W8A16 float8 e4m3 2:4 weight-only: the kept e4m3 values with per-channel scales in
    sparsekit's 2:4 format (0.625 bytes a weight), activations in bf16, never quantized. Up to
    32 tokens (decode) the weight is read once by a small-M kernel that widens it exactly in
    registers (the mma.sp kernel where the library loads, its format a second copy, else the
    Triton kernel on the same copy). Larger token counts (prefill, compute-bound) widen the
    weight to bf16 on each call and multiply with ``F.linear``, the scales applied after the
    sums as the decode kernels do."""

    variant, precision = "fp8w_2:4", "fp8w"
    sparse = True
    fmt = FP8
    weight_only = True

    @property
    def path(self) -> str:
        return "widen"


class Int8Dense(_AccelLinear):
    """W8A8 int8 dense (``torch._int_mm``), activations quantized per token."""

    variant, precision = "int8_dense", "int8"
    fmt = INT8


class Int8Sparse24(_AccelLinear):
    """W8A8 int8 2:4 (cuSPARSELt), activations quantized per token (as quant/ does), the
    product in int32 where cuSPARSELt offers it (exact) else bf16; scales and bias after."""

    variant, precision = "int8_2:4", "int8"
    sparse = True
    uses_alg = True
    fmt = INT8


VARIANTS: Registry[type[nn.Module]] = Registry("accel variant")
# the W4A16 layers (int4 weights, bf16 activations) live in sparsekit.accel.layers_int4
for _cls in (DenseBF16, Sparse24BF16, FP8Dense, FP8Sparse24, FP8WDense, FP8WSparse24, Int8Dense,
             Int8Sparse24, Int4Dense, Int4Sparse24):
    VARIANTS.register(_cls.variant, _cls)
# what accelerate(sparsity=...) may ask for: the 2:4 variant, the planner's choice, dense only
SPARSITIES = ("2:4", "auto", "dense")


def precisions() -> tuple[str, ...]:
    """The precisions offering both a dense and a 2:4 variant (``accelerate(precision=...)``,
    ``accel.precision``), in registration order."""
    names = VARIANTS.names()
    found = dict.fromkeys(n.rsplit("_", 1)[0] for n in names)
    return tuple(p for p in found if f"{p}_dense" in names and f"{p}_2:4" in names)


def scheme_precision(scheme: str) -> str | None:
    """The accel precision that keeps quantization scheme ``scheme``'s numerics: a W8A8
    scheme's activation format ("fp8" for fp8 and the static fp8 schemes, "int8" for int8 and
    int8_static), "fp8w" for fp8_weight_only; None for the others (int8 and int4 weight-only
    layers run under any precision)."""
    s = get_scheme(scheme)
    if s.activation is not None:
        return s.activation.name
    return "fp8w" if s.weight == FP8 else None


def check_precision(key: str, precision: object) -> str:
    """``precision`` when it is one of :func:`precisions`; UsageError naming ``key`` else."""
    if precision not in precisions():
        raise UsageError(f"{key} must be one of {precisions()}, got {precision!r}")
    return precision


def variant_name(precision: str, sparse: bool) -> str:
    """'bf16' + sparse -> 'bf16_2:4'; 'int8' dense -> 'int8_dense'."""
    check_precision("precision", precision)
    return f"{precision}_{'2:4' if sparse else 'dense'}"
