"""Accelerated linear layers: bf16 / fp8 / int8, dense or 2:4, as drop-in modules calling the
``sparsekit::`` custom ops (:mod:`sparsekit.accel.ops`).

Each class computes ``x @ W.T + b`` for x (..., K) -> (..., N) in bfloat16, and is built from a
float ``nn.Linear`` (weights already holding their 2:4 zeros for the sparse ones) or from a
:class:`~sparsekit.quant.QuantLinear` of the matching scheme, whose 8-bit weights and scales it
takes as they are. ``VARIANTS`` maps the names used in reports and configs to the classes.

The same module runs on either device: on CUDA the ops call cuSPARSELt / cuBLAS, on CPU their
plain-torch references (the weights are then kept dense). The W8A8 layers quantize activations
per token with :mod:`sparsekit.quant.numerics` (what ``quantize_`` and QAT compute), written
as plain torch ops so the compiler fuses them into the op producing the activation (a layer
built from a static-scheme QuantLinear takes its one ``input_scale``: elementwise); the 2:4
8-bit layers apply ``acc * x_scale * w_scale + bias`` in plain torch too, fused into what
consumes the output. The ``<fp8|int8>_on_bf16_<dense|2:4>`` variants run a quantized layer's
numerics on bf16 tensor cores (same activation codes, the weight rounded once to bf16), for
shapes where the 8-bit kernels lose to bf16. No forward reads tensor data on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.accel import ops
from sparsekit.errors import UsageError
from sparsekit.quant.formats import FP8, INT8, Format, get_scheme
from sparsekit.quant.modules import QuantLinear
from sparsekit.quant.numerics import channel_scales, quantize
from sparsekit.registry import Registry


def _weights(layer: nn.Module, fmt: Format | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, per-channel scale) of ``layer`` in ``fmt`` (bf16 and no scale when None).
    A QuantLinear of the same format gives its stored values; one of another format, or a
    float layer, is quantized here with quant's numerics."""
    if isinstance(layer, QuantLinear):
        if fmt is not None and layer.weight.dtype == fmt.dtype:
            return layer.weight.detach(), layer.weight_scale.detach().float()
        w = layer.dequantized_weight(torch.float32)
    else:
        w = layer.weight.detach().float()
    if fmt is None:
        return w.to(torch.bfloat16), None
    scale = channel_scales(w, fmt)
    return quantize(w, scale[:, None], fmt), scale


class _AccelLinear(nn.Module):
    variant = ""
    sparse = False
    on_bf16 = False  # runs an 8-bit format's numerics on bf16 tensor cores (_OnBF16)
    uses_alg = False
    fmt: Format | None = None

    def __init__(self, linear: nn.Module, alg_id: int = 0, fused_quant: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.alg_id = int(alg_id)
        # per-token activation quantization as plain torch ops (fused by the compiler) or as
        # the opaque sparsekit::quant_rows op (kept to measure what the fusion gains)
        self.fused_quant = fused_quant
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else
                             bias.detach().to(torch.bfloat16).contiguous())
        w, scale = _weights(linear, self.fmt)
        # a static-scheme QuantLinear's one activation scale (None: per-token dynamic scales)
        static = (self.fmt is not None and isinstance(linear, QuantLinear)
                  and "input_scale" in linear._buffers
                  and get_scheme(linear.scheme).activation == self.fmt)
        self.register_buffer("act_scale", linear.input_scale.detach().float().clone()
                             if static else None)
        w, scale = self._stored(w, scale)
        w = w.contiguous()
        if self.sparse:
            self.register_buffer("packed", ops.pack_24(w))
        else:
            self.register_buffer("weight", w)
        self.register_buffer("w_scale", scale)

    def _stored(self, w: torch.Tensor, scale: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and per-channel scale as the kernel takes them (as built, here)."""
        return w, scale

    def _quant(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.act_scale is not None:  # static: elementwise, fused into the producer
            return quantize(x2d, self.act_scale, self.fmt), self.act_scale.expand(len(x2d), 1)
        if self.fused_quant:
            return ops.act_quant_rows(x2d, self.fmt)
        return ops.quant_rows(x2d, self.fmt.dtype)

    def _epilogue(self, acc: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        y = acc.float() * x_scale
        if self.w_scale is not None:
            y = y * self.w_scale
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        alg = f", alg_id={self.alg_id}" if self.uses_alg else ""
        return f"{self.in_features}, {self.out_features}, variant={self.variant}{alg}"


class DenseBF16(_AccelLinear):
    """bf16 dense (``F.linear``, cuBLAS): the baseline every other variant is timed against."""

    variant = "bf16_dense"

    def _mm(self, x2d):
        return F.linear(x2d, self.weight, self.bias)


class Sparse24BF16(_AccelLinear):
    """bf16 2:4 on sparse tensor cores (cuSPARSELt), bias fused in the GEMM."""

    variant = "bf16_2:4"
    sparse = True
    uses_alg = True

    def _mm(self, x2d):
        return ops.sparse24_mm(x2d, self.packed, self.bias, self.out_features, self.alg_id,
                               torch.bfloat16)


class FP8Dense(_AccelLinear):
    """W8A8 float8 e4m3 dense (``torch._scaled_mm``, row-wise scales and bias in its
    epilogue); activations quantized per token."""

    variant = "fp8_dense"
    fmt = FP8

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        return ops.scaled_mm(q, self.weight, sx, self.w_scale, self.bias, torch.bfloat16)


class FP8Sparse24(_AccelLinear):
    """W8A8 float8 e4m3 2:4 (cuSPARSELt, bf16 product), activations quantized per token;
    scales and bias applied after the GEMM (cuSPARSELt has no per-row scale, and refuses
    per-channel alpha vectors for fp8 on the H200)."""

    variant = "fp8_2:4"
    sparse = True
    uses_alg = True
    fmt = FP8

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        acc = ops.sparse24_mm(q, self.packed, None, self.out_features, self.alg_id,
                              torch.bfloat16)
        return self._epilogue(acc, sx)


class Int8Dense(_AccelLinear):
    """W8A8 int8 dense (``torch._int_mm``), activations quantized per token."""

    variant = "int8_dense"
    fmt = INT8

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        return ops.scaled_mm(q, self.weight, sx, self.w_scale, self.bias, torch.bfloat16)


class Int8Sparse24(_AccelLinear):
    """W8A8 int8 2:4 (cuSPARSELt), activations quantized per token (as quant/ does), the
    product in int32 where cuSPARSELt offers it (exact) else bf16; scales and bias after."""

    variant = "int8_2:4"
    sparse = True
    uses_alg = True
    fmt = INT8

    def __init__(self, linear: nn.Module, alg_id: int = 0, fused_quant: bool = True):
        super().__init__(linear, alg_id, fused_quant)
        dev = self.packed.device
        self.acc_dtype = ops.int8_acc_dtype(dev.index or 0) if dev.type == "cuda" else torch.int32

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        acc = ops.sparse24_mm(q, self.packed, None, self.out_features, self.alg_id,
                              self.acc_dtype)
        return self._epilogue(acc, sx)


class _OnBF16(_AccelLinear):
    """An 8-bit layer's numerics on bf16 tensor cores, for shapes where the 8-bit kernels are
    slower than bf16 (a quantized model's "auto" may pick it; docs/gpu.md). The activation is
    quantized exactly as the W8A8 variant does (the same 8-bit codes) and the codes go to the
    GEMM as bf16 values (exact: every float8 e4m3 and int8 value is one); the weight is the
    dequantized 8-bit weight, times the static activation scale when there is one, rounded
    once to bf16 (relative error <= 2**-9 per element, against the 8-bit quantization's own
    2**-4 (fp8) or 2**-8 (int8) steps). With a static scale the whole layer is one bf16 GEMM
    with its bias; with per-token scales the scale and bias follow the GEMM."""

    def _stored(self, w, scale):
        folded = w.float() * scale[:, None]
        if self.act_scale is not None:
            folded = folded * self.act_scale
        return folded.to(torch.bfloat16), None

    def _codes(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the 8-bit codes of x2d as bf16, the per-token scales still to apply or None)."""
        q, sx = self._quant(x2d)
        return q.to(torch.bfloat16), (None if self.act_scale is not None else sx)

    def _finish(self, y: torch.Tensor, sx: torch.Tensor | None) -> torch.Tensor:
        return y if sx is None else self._epilogue(y, sx)


class _OnBF16Dense(_OnBF16):
    def _mm(self, x2d):
        q, sx = self._codes(x2d)
        return self._finish(F.linear(q, self.weight, self.bias if sx is None else None), sx)


class _OnBF16Sparse24(_OnBF16):
    sparse = True
    uses_alg = True

    def _mm(self, x2d):
        q, sx = self._codes(x2d)
        y = ops.sparse24_mm(q, self.packed, self.bias if sx is None else None,
                            self.out_features, self.alg_id, torch.bfloat16)
        return self._finish(y, sx)


def _on_bf16_class(base: type[_OnBF16], fmt: Format, sparse: bool) -> type[_OnBF16]:
    name = on_bf16_name(fmt.name, sparse)
    doc = f"{fmt.name} W8A8 numerics on bf16 {'2:4 sparse' if sparse else 'dense'} tensor cores"
    return type(name, (base,), {"variant": name, "fmt": fmt, "on_bf16": True,
                                "__doc__": f"{doc} (see :class:`_OnBF16`)."})


def on_bf16_name(precision: str, sparse: bool) -> str:
    """'fp8', 2:4 -> 'fp8_on_bf16_2:4': ``precision``'s numerics run on bf16 tensor cores."""
    return f"{precision}_on_bf16_{'2:4' if sparse else 'dense'}"


VARIANTS: Registry[type[_AccelLinear]] = Registry("accel variant")
for _cls in (DenseBF16, Sparse24BF16, FP8Dense, FP8Sparse24, Int8Dense, Int8Sparse24,
             *(_on_bf16_class(b, f, b.sparse) for f in (FP8, INT8)
               for b in (_OnBF16Dense, _OnBF16Sparse24))):
    VARIANTS.register(_cls.variant, _cls)
# what accelerate(sparsity=...) may ask for: the 2:4 variant, the planner's choice, dense only
SPARSITIES = ("2:4", "auto", "dense")


def precisions() -> tuple[str, ...]:
    """The precisions offering both a dense and a 2:4 variant (``accelerate(precision=...)``,
    ``accel.precision``), in registration order."""
    names = [n for n in VARIANTS.names() if not VARIANTS[n].on_bf16]
    found = dict.fromkeys(n.rsplit("_", 1)[0] for n in names)
    return tuple(p for p in found if f"{p}_dense" in names and f"{p}_2:4" in names)


def check_precision(key: str, precision: object) -> str:
    """``precision`` when it is one of :func:`precisions`; UsageError naming ``key`` else."""
    if precision not in precisions():
        raise UsageError(f"{key} must be one of {precisions()}, got {precision!r}")
    return precision


def variant_name(precision: str, sparse: bool) -> str:
    """'bf16' + sparse -> 'bf16_2:4'; 'int8' dense -> 'int8_dense'."""
    check_precision("precision", precision)
    return f"{precision}_{'2:4' if sparse else 'dense'}"
