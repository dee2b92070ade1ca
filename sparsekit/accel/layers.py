"""Accelerated linear layers: bf16 / fp8 / int8, dense or 2:4, as drop-in modules calling the
``sparsekit::`` custom ops (:mod:`sparsekit.accel.ops`); the int4 weight-only ones (W4A16) are in
:mod:`sparsekit.accel.layers_int4` and registered here too.

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
consumes the output, except an fp8 2:4 layer with one activation and one weight scale
(``fp8_static_tensor``), whose scale and bias run inside the GEMM (:class:`FP8Sparse24`).
No forward reads tensor data on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.accel.kernels.cusparselt import op as cslt_op
from sparsekit.accel.kernels.dense import op as dense_op
from sparsekit.accel.kernels.mma_sp import op as mma_op
from sparsekit.accel.kernels.triton24 import op as sk24_op
from sparsekit.accel import ops
from sparsekit.accel.kernels.triton24 import format as sk24
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
from sparsekit.accel.layers_int4 import Int4Dense, Int4Sparse24
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


class _AccelLinear(nn.Module):
    variant = ""
    sparse = False
    uses_alg = False
    decodes = False  # has the small-M path (sparsekit::sk24_mm) for M <= decode_max_m
    fmt: Format | None = None
    # weights in ``fmt``, activations left in bf16 (W8A16): the weight is widened, exactly
    weight_only = False

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
        w = w.contiguous()
        # the small-M (decode) path: sparsekit's own 2:4 format and Triton kernel for the
        # bf16 and fp8 2:4 layers, used for M <= decode_max_m (the planner may lower it)
        self.decode_max_m = 0
        self.register_buffer("dvalues", None)
        self.register_buffer("dmeta", None)
        # which small-M kernel the format is for: "mma" (sparse tensor cores, sk24_mma; "mma8":
        # its fp8 x fp8 kernel) where it is built and the shape fits, else "triton" (sk24); ""
        # without a small-M path
        self.dkernel = ""
        self.dwide = torch.bfloat16  # the dtype an fp8 layer widens x to for the mma kernel
        # the mma.sp kernel's configuration per bucket of sk24_mma.BUCKETS (the planner's)
        self.dconfig: tuple[tuple[int, ...], ...] | None = None
        # bf16 dense on a copy of the effective weight for dense_m[0] <= M <= dense_m[1]
        # (set by the planner under sparsity="auto" where dense beats both 2:4 paths)
        self.dense_m = (0, 0)
        self.register_buffer("dense_weight", None)
        # an fp8 layer on the Triton kernel that the mma.sp kernel takes too: the decode plan
        # times both and keeps the faster (use_decode_kernel)
        self.dchoice = False
        if self.sparse and self.weight_only:
            # bf16 x cannot go to cuSPARSELt with an fp8 weight: the weight's one copy is in
            # sparsekit's own 2:4 format, which the Triton kernel reads and the large-M path
            # widens (_mm)
            reason = sk24.check_shape(*w.shape)
            if reason:
                raise ValueError(f"{self.variant} layer ({self.out_features}x"
                                 f"{self.in_features}): {reason}")
            values, meta = sk24.compress(w)
            self.register_buffer("values", values)
            self.register_buffer("meta", meta)
            # mma.sp where the library takes it: faster at every M and 8B shape (docs/gpu.md)
            self._decode_format("mma" if sk24_mma.choosable(w, torch.bfloat16) else "triton", w)
        elif self.sparse:
            self.register_buffer("packed", cslt_op.pack_24(w))
            if self.decodes and sk24_mma.usable(w):
                self._decode_format("mma", w)
            elif self.decodes and sk24.check_shape(*w.shape) is None:
                self._decode_format("triton", w)
                self.dchoice = sk24_mma.choosable(w)
        else:
            self.register_buffer("weight", w)
        self.register_buffer("w_scale", scale)

    def _decode_format(self, kernel: str, w: torch.Tensor) -> None:
        """The small-M copy of the 2:4 weight ``w`` (the layer's values dtype) in the format
        of ``kernel``: "mma" (the mma.sp kernel, "mma8" where an fp8 weight goes to its fp8 x
        fp8 kernel) or "triton"; the kernel's configurations are reset to its defaults."""
        self.dconfig, self.dwide = None, torch.bfloat16
        if kernel == "triton":  # a weight-only layer's own copy is already in this format
            self.dvalues, self.dmeta = ((self.values, self.meta) if self.weight_only
                                        else sk24.compress(w))
            self.dkernel, self.decode_max_m = "triton", sk24.MAX_M
            return
        layout = "paired" if self.weight_only else sk24_mma.layout_for(w)
        self.dvalues, self.dmeta = sk24_mma.compress(w, layout)
        self.dkernel = "mma8" if layout == "e4m3" else "mma"
        # a W8A8 fp8 layer's quantized activations reach it widened, exactly: to f16 where the
        # library runs fp8 weights on the f16 sparse tensor cores, else to bf16 (a weight-only
        # layer's bf16 activations as they are)
        if (w.dtype == torch.float8_e4m3fn and not self.weight_only
                and sk24_mma.fp8_f16_ok()):
            self.dwide = torch.float16
        self.decode_max_m = sk24_mma.MAX_M

    def use_decode_kernel(self, kernel: str) -> None:
        """Move this layer's small-M path to ``kernel`` ("mma" or "triton"; a layer with
        ``dchoice``), its weight copy re-encoded from the current one (exactly: the same kept
        values and positions)."""
        if kernel not in ("mma", "triton"):
            raise ValueError(f"{self.variant} layer ({self.out_features}x{self.in_features}): "
                             f"decode kernel must be 'mma' or 'triton', got {kernel!r}")
        if self.dvalues is None:
            raise ValueError(f"{self.variant} layer ({self.out_features}x{self.in_features}): "
                             f"no small-M weight to move to the {kernel} kernel")
        if self.dkernel.startswith(kernel):
            return
        self._decode_format(kernel, self._small_m_weight())

    def _small_m_weight(self) -> torch.Tensor:
        """The 2:4 weight (N, K) in the values' dtype, decoded from the small-M copy."""
        fmt = sk24_mma if self.dkernel.startswith("mma") else sk24
        return fmt.decompress(self.dvalues, self.dmeta)

    def _decode(self, x2d: torch.Tensor) -> torch.Tensor | None:
        """The product on the small-M kernel (:func:`sk24_op.sk24_mm`) when this layer has it and
        ``x2d`` has at most ``decode_max_m`` rows, else None. The numerics are the large-M
        path's: the same activation quantization, scales and bias, in float32."""
        if self.dvalues is None or x2d.shape[0] > self.decode_max_m:
            return None
        cfg = None if self.dconfig is None else [v for c in self.dconfig for v in c]
        if self.dkernel == "mma8":  # fp8 x fp8 on the fp8 sparse tensor cores
            q, sx = self._quant(x2d)
            return mma_op.sk24_mma_mm(q, self.dvalues, self.dmeta, sx, self.w_scale, self.bias,
                                   cfg)
        if self.dkernel == "mma":  # an fp8 layer's activations widened to f16 or bf16 (exact)
            if self.fmt is None:
                return mma_op.sk24_mma_mm(x2d.to(torch.bfloat16), self.dvalues, self.dmeta, None,
                                       None, self.bias, cfg)
            q, sx = self._quant(x2d)
            return mma_op.sk24_mma_mm(q.to(self.dwide), self.dvalues, self.dmeta, sx,
                                   self.w_scale, self.bias, cfg)
        # x as the kernel's position planes, made by torch ops that the compiler fuses into
        # x's producer (the custom op itself is opaque to it)
        if self.fmt is None:
            return sk24_op.sk24_mm(sk24.planes(x2d), self.dvalues, self.dmeta, None, None,
                               self.bias)
        q, sx = self._quant(x2d)
        return sk24_op.sk24_mm(sk24.planes(q), self.dvalues, self.dmeta, sx, self.w_scale,
                           self.bias)

    def keep_dense(self, lo: int, hi: int) -> None:
        """Route inputs of ``lo`` <= M <= ``hi`` rows to ``F.linear`` on a bf16 copy of the
        effective weight (the 2:4 values times the weight scale for fp8), made from the
        small-M format's copy (which must be there); (0, 0) drops the route and the copy."""
        if hi < 1:
            self.dense_m, self.dense_weight = (0, 0), None
            return
        if self.dvalues is None:
            raise ValueError(f"{self.variant} layer ({self.out_features}x{self.in_features}): "
                             f"a dense route needs the small-M format's weight")
        w = self._small_m_weight()
        if self.w_scale is not None:
            w = w.float() * self.w_scale[:, None]
        self.dense_m = (int(lo), int(hi))
        self.dense_weight = w.to(torch.bfloat16).contiguous()

    def _dense(self, x2d: torch.Tensor) -> torch.Tensor | None:
        """``F.linear`` on the dense copy when this layer keeps one and ``x2d``'s rows are in
        ``dense_m``, else None (a Python branch on the shape: one graph per shape)."""
        if self.dense_weight is None or not self.dense_m[0] <= x2d.shape[0] <= self.dense_m[1]:
            return None
        return F.linear(x2d, self.dense_weight, self.bias)

    def _quant(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.weight_only:  # W8A16: x stays bf16, no activation scale
            return x2d.to(torch.bfloat16), None
        if self.act_scale is not None:  # static: elementwise, fused into the producer
            return quantize(x2d, self.act_scale, self.fmt), self.act_scale.expand(len(x2d), 1)
        if self.fused_quant:
            return ops.act_quant_rows(x2d, self.fmt)
        return ops.quant_rows(x2d, self.fmt.dtype)

    def _epilogue(self, acc: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        y = acc.float() * x_scale * self.w_scale
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(torch.bfloat16)

    @property
    def path(self) -> str:
        """The kernel route, part of the algorithm cache's key: "cslt" (torch's cuSPARSELt
        binding), "cslt_alpha" (sparsekit's), "dense"."""
        return "cslt" if self.sparse else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        y = self._dense(x2d)
        if y is None:
            y = self._decode(x2d)
        if y is None:
            y = self._mm(x2d)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        alg = f", alg_id={self.alg_id}" if self.uses_alg else ""
        dec = (f", decode_max_m={self.decode_max_m} ({self.dkernel}"
               + (f" {sk24_mma.config_text(self.dconfig)}" if self.dconfig else "") + ")"
               if self.dvalues is not None else "")
        if self.dense_weight is not None:
            dec += f", bf16 dense for M in {list(self.dense_m)}"
        return f"{self.in_features}, {self.out_features}, variant={self.variant}{alg}{dec}"


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
    decodes = True

    def _mm(self, x2d):
        return cslt_op.sparse24_mm(x2d, self.packed, self.bias, self.out_features, self.alg_id,
                               torch.bfloat16)


class FP8Dense(_AccelLinear):
    """W8A8 float8 e4m3 dense (``torch._scaled_mm``, row-wise scales and bias in its
    epilogue); activations quantized per token."""

    variant = "fp8_dense"
    fmt = FP8

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        return dense_op.scaled_mm(q, self.weight, sx, self.w_scale, self.bias, torch.bfloat16)


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

    variant = "fp8_2:4"
    sparse = True
    uses_alg = True
    decodes = True
    fmt = FP8

    def __init__(self, linear: nn.Module, alg_id: int = 0, fused_quant: bool = True):
        super().__init__(linear, alg_id, fused_quant)
        self.alpha: float | None = None
        if self.act_scale is not None and one_scale(self.w_scale) and (
                not self.packed.is_cuda or cslt_op.alpha_path()):
            self.alpha = float(self.act_scale.reshape(-1)[0]) * float(self.w_scale[0])

    @property
    def path(self) -> str:
        return "cslt" if self.alpha is None else "cslt_alpha"

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        if self.alpha is not None:
            return cslt_op.sparse24_mm_alpha(q, self.packed, self.bias, self.out_features,
                                         self.alg_id, self.alpha, False)
        acc = cslt_op.sparse24_mm(q, self.packed, None, self.out_features, self.alg_id,
                              torch.bfloat16)
        return self._epilogue(acc, sx)


def _widened_mm(x2d: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """A weight-only fp8 layer's large-M product: bf16 x times the e4m3 values widened to bf16
    (exact), then the per-channel scales and the bias in float32, as the decode kernels apply
    them (after the sums, never folded into the weight, which would round it a second time)."""
    acc = F.linear(x2d.to(torch.bfloat16), q.to(torch.bfloat16))
    y = acc.float() * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


class FP8WDense(_AccelLinear):
    """W8A16 float8 e4m3 weight-only dense: per-channel e4m3 weights, bf16 activations; the
    weight widened to bf16 on each call and multiplied by ``F.linear`` (cuBLAS), its scales
    applied after. It keeps 1 byte a weight; no kernel reads it narrower (under ``sparsity="auto"``
    the planner times it against bf16 dense)."""

    variant = "fp8w_dense"
    fmt = FP8
    weight_only = True

    def _mm(self, x2d):
        return _widened_mm(x2d, self.weight, self.w_scale, self.bias)


class FP8WSparse24(_AccelLinear):
    """W8A16 float8 e4m3 2:4 weight-only: the kept e4m3 values with per-channel scales in
    sparsekit's 2:4 format (``values``, ``meta``: 0.625 bytes a weight), activations in bf16,
    never quantized. Up to 32 tokens (decode) the weight is read once by a small-M kernel that
    widens it exactly in registers: the mma.sp kernel (bf16 x, the e4m3 values widened to
    bf16) where the library loads (its format a second copy, 0.625 bytes a weight more), else
    the Triton kernel. Larger token counts (prefill, compute-bound) widen the weight to bf16
    on each call and multiply with ``F.linear``, the scales applied after the sums as the
    decode kernels do."""

    variant = "fp8w_2:4"
    sparse = True
    decodes = True
    fmt = FP8
    weight_only = True

    @property
    def path(self) -> str:
        return "widen"

    def _mm(self, x2d):
        # exact widening behind one op: a compiler traces one call, not decompress's twenty-odd
        # elementwise ops a layer (the first generate's compile time)
        w = sk24_op.sk24_widen(self.values, self.meta)
        return _widened_mm(x2d, w, self.w_scale, self.bias)


class Int8Dense(_AccelLinear):
    """W8A8 int8 dense (``torch._int_mm``), activations quantized per token."""

    variant = "int8_dense"
    fmt = INT8

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        return dense_op.scaled_mm(q, self.weight, sx, self.w_scale, self.bias, torch.bfloat16)


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
        self.acc_dtype = (cslt_op.int8_acc_dtype(dev.index or 0) if dev.type == "cuda"
                          else torch.int32)

    def _mm(self, x2d):
        q, sx = self._quant(x2d)
        acc = cslt_op.sparse24_mm(q, self.packed, None, self.out_features, self.alg_id,
                              self.acc_dtype)
        return self._epilogue(acc, sx)


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
