"""The accelerated layers' kernels as PyTorch custom ops (namespace ``sparsekit::``).

Each op has a CUDA implementation (cuSPARSELt, ``torch._scaled_mm``, ``torch._int_mm``), a CPU
reference that computes the same numbers in plain torch, and a fake (meta) implementation, so
``torch.compile`` traces a model that calls them without graph breaks and without running them.
Nothing in a forward reads tensor data on the host.

- ``sparse24_mm(x, packed, bias, out_features, alg_id, out_dtype)``: ``x @ W.T (+ bias)`` for a
  2:4 weight W (N, K). On CUDA ``packed`` is W compressed by ``torch._cslt_compress`` (values
  and metadata, opaque); on CPU it is W itself, dense with its zeros (:func:`pack_24`). ``x``
  (M, K) is bf16, float8 e4m3fn or int8 with W of the same dtype; the 8-bit products come back
  unscaled (``out_dtype`` bf16, or int32 for int8 where cuSPARSELt offers it): the scales are
  applied by the caller in plain torch, where the compiler fuses them into what follows.
- ``sparse24_mm_alpha(x, packed, bias, out_features, alg_id, alpha, gelu)``: bf16
  ``act(alpha * x @ W.T + bias)`` for an 8-bit 2:4 weight W and a host scalar ``alpha`` (a
  static activation scale times a per-tensor weight scale), the scale, bias and GELU in
  cuSPARSELt's epilogue through sparsekit's own binding (:mod:`sparsekit.accel.cslt_ext`).
  ``gelu`` is set by the compiler pass :class:`sparsekit.accel.epilogue.FuseGelu`, never by a
  layer.
- ``sk24_mm(x, values, meta, x_scale, w_scale, bias)`` (x (M, K) or its planes (M, 4, K/4),
  :func:`sparsekit.accel.sk24.planes`): bf16 ``(x @ W.T) * x_scale * w_scale
  + bias`` for a 2:4 weight in sparsekit's own format (:mod:`sparsekit.accel.sk24`: values and
  2-bit indices), bf16 or float8 e4m3 ``x`` of the weight's dtype, on sparsekit's Triton kernel
  for small M (decode, M <= 32; it takes any M); the CPU reference expands the weight.
- ``sk24_mma_mm(x, values, meta, x_scale, w_scale, bias, config=None)``: the same product for
  M <= 32 on the sparse tensor cores (``mma.sp``; :mod:`sparsekit.accel.sk24_mma`: the
  fragment-ordered format, bf16 or fp8 e4m3 values; ``config`` the kernel configuration, by
  default per shape), x (M, K) bf16 (an fp8 layer's quantized activations widened, exactly) or
  fp8 for the "e4m3" layout; the CPU reference expands the weight.
- ``sk24_mma_int4_mm(x, values, meta, scales, bias, config=None)``: bf16
  ``x @ (q * scale).T + bias`` for an int4 2:4 weight in the kernel's int4 format
  (:func:`sparsekit.accel.sk24_mma.compress_int4`), M <= 32, on the same sparse tensor cores
  (nibbles widened to bf16 in registers, group scales applied in float32).
- ``scaled_mm(xq, wq, x_scale, w_scale, bias, out_dtype)``: the dense W8A8 product
  ``(xq @ wq.T) * x_scale * w_scale + bias`` (x_scale (M, 1), w_scale (N,), float32).
- ``quant_rows(x, dtype)``: dynamic activation quantization per token (row), with the
  numerics of :mod:`sparsekit.quant.numerics` (absmax scales, int8 rounds half to even). The
  layers call the same plain-torch definitions directly (:func:`act_quant_rows`) so inductor
  fuses them into the op that produces the activation; the op form is the opaque (unfused)
  alternative, kept to measure the difference.
- ``int4_24_mm(x, values, meta, scales, bias)`` and ``int4_mm(x, values, scales, bias)``: bf16
  ``x @ (q * scale).T + bias`` for int4 weights with group scales (W4A16), 2:4 or dense, in
  sparsekit's packed formats (:mod:`sparsekit.accel.w4a16`), on its Triton kernels for small M
  (decode, M <= 32; they take any M); the CPU references dequantize the weight.
- ``decode_attention(q, k, v, mask, scale)``: attention of one query token per sequence over a
  static KV cache, grouped-query heads read once, masked positions never loaded
  (:mod:`sparsekit.accel.attention`); the CPU reference is plain float32 torch.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from sparsekit import _compat
from sparsekit.accel import attention, cslt_ext, sk24, sk24_mma
from sparsekit.accel import w4a16
from sparsekit.quant.formats import FP8, INT8, Format
from sparsekit.quant.kernels import scaled_matmul
from sparsekit.quant.numerics import quantize, row_scales

_FORMATS = {torch.int8: INT8, torch.float8_e4m3fn: FP8}
# the GELU cuSPARSELt's epilogue computes (F.gelu's ``approximate``): the tanh form, measured on
# the H200 (cuSPARSELt 0.8.0) by tests/accel/test_accel_gpu.py at pre-activations near -3, where
# the two forms differ by 10%. An erf GELU (BERT's, ViT's) is left to the compiler.
GELU_APPROXIMATE = "tanh"
_M_MULTIPLE = 16  # rows the 8-bit and 2:4 CUDA kernels take as they are; fewer are padded


def fmt_of(dtype: torch.dtype) -> Format:
    """The quant :class:`Format` stored as ``dtype`` (int8 or float8 e4m3fn)."""
    if dtype not in _FORMATS:
        raise ValueError(f"quantized dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    return _FORMATS[dtype]


def act_quant_rows(x: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of x (M, K): (q (M, K) in ``fmt.dtype``, scale (M, 1) float32),
    exactly what :class:`~sparsekit.quant.QuantLinear` does to its input. Plain torch ops."""
    scale = row_scales(x, fmt)
    return quantize(x, scale, fmt), scale


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    m = x.shape[0]
    if m % multiple == 0 and m > 0:
        return x
    out = torch.zeros((max(multiple, -(-m // multiple) * multiple), x.shape[1]), dtype=x.dtype,
                      device=x.device)
    out[:m] = x
    return out


# --- sparse24_mm -------------------------------------------------------------------------------

@torch.library.custom_op("sparsekit::sparse24_mm", mutates_args=(), device_types="cuda")
def sparse24_mm(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                out_features: int, alg_id: int, out_dtype: torch.dtype) -> torch.Tensor:
    m = x.shape[0]
    xp = _pad_rows(x, _M_MULTIPLE)
    # cuSPARSELt takes out_dtype for 8-bit inputs only; bf16 in gives bf16 out
    y = _compat.cslt_sparse_mm(packed, xp.t(), bias, transpose_result=True, alg_id=alg_id,
                              out_dtype=None if x.dtype == out_dtype else out_dtype)
    return y[:m] if xp.shape[0] != m else y


@sparse24_mm.register_kernel("cpu")
def _sparse24_mm_ref(x, packed, bias, out_features, alg_id, out_dtype):
    if x.dtype == torch.int8:  # exact integer products
        y = (x.long() @ packed.long().t()).to(torch.int32)
        return y if out_dtype == torch.int32 else y.float().to(out_dtype)
    y = F.linear(x.float(), packed.float(), None if bias is None else bias.float())
    return y.to(out_dtype)


@sparse24_mm.register_fake
def _sparse24_mm_fake(x, packed, bias, out_features, alg_id, out_dtype):
    return x.new_empty((x.shape[0], out_features), dtype=out_dtype)


def pack_24(weight: torch.Tensor) -> torch.Tensor:
    """A 2:4 weight (N, K) in the form ``sparse24_mm`` takes on its device: cuSPARSELt's
    compressed buffer on CUDA, the dense weight itself on CPU."""
    weight = weight.contiguous()
    return _compat.cslt_compress(weight) if weight.is_cuda else weight.clone()


@torch.library.custom_op("sparsekit::sparse24_mm_alpha", mutates_args=(), device_types="cuda")
def sparse24_mm_alpha(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                      out_features: int, alg_id: int, alpha: float, gelu: bool) -> torch.Tensor:
    ext = cslt_ext.load()
    if ext is None:
        raise RuntimeError(f"sparsekit::sparse24_mm_alpha needs sparsekit's cuSPARSELt binding: "
                           f"{cslt_ext.reason()}")
    m = x.shape[0]
    xp = _pad_rows(x, _M_MULTIPLE)
    y = ext.sparse24_mm_alpha(packed, xp, out_features, bias, alpha, gelu, alg_id)
    if y is None:
        raise RuntimeError(f"sparsekit::sparse24_mm_alpha ({out_features}x{x.shape[1]}, "
                           f"alg_id={alg_id}): {ext.last_error()}")
    return y[:m] if xp.shape[0] != m else y


@sparse24_mm_alpha.register_kernel("cpu")
def _sparse24_mm_alpha_ref(x, packed, bias, out_features, alg_id, alpha, gelu):
    y = (x.float() @ packed.float().t()) * alpha
    if bias is not None:
        y = y + bias.float()
    return (F.gelu(y, approximate=GELU_APPROXIMATE) if gelu else y).to(torch.bfloat16)


@sparse24_mm_alpha.register_fake
def _sparse24_mm_alpha_fake(x, packed, bias, out_features, alg_id, alpha, gelu):
    return x.new_empty((x.shape[0], out_features), dtype=torch.bfloat16)


def alpha_path() -> bool:
    """Whether the 8-bit 2:4 layers may use :func:`sparse24_mm_alpha` on CUDA (the binding
    builds; it is built here on the first call)."""
    return cslt_ext.load() is not None


@functools.cache
def int8_acc_dtype(device_index: int) -> torch.dtype:
    """int32 where this cuSPARSELt writes int8 2:4 products as int32 (exact), else bfloat16."""
    dev = torch.device("cuda", device_index)
    w = torch.zeros(32, 64, dtype=torch.int8, device=dev)
    w[:, 0::4] = 3
    x = torch.ones(32, 64, dtype=torch.int8, device=dev)
    try:
        y = _compat.cslt_sparse_mm(_compat.cslt_compress(w), x.t(), out_dtype=torch.int32,
                                  transpose_result=True)
        return torch.int32 if bool((y == 48).all()) else torch.bfloat16
    except RuntimeError:
        return torch.bfloat16


# --- sk24_mm (small-M 2:4, sparsekit's format) ---------------------------------------------

@torch.library.custom_op("sparsekit::sk24_mm", mutates_args=(), device_types="cuda")
def sk24_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
            x_scale: Optional[torch.Tensor], w_scale: Optional[torch.Tensor],
            bias: Optional[torch.Tensor]) -> torch.Tensor:
    return sk24.launch(x, values, meta, x_scale, w_scale, bias)


@sk24_mm.register_kernel("cpu")
def _sk24_mm_ref(x, values, meta, x_scale, w_scale, bias):
    return sk24.reference(x, values, meta, x_scale, w_scale, bias)


@sk24_mm.register_fake
def _sk24_mm_fake(x, values, meta, x_scale, w_scale, bias):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=torch.bfloat16)


# --- sk24_widen (the format's weight widened to dense bf16: the weight-only fp8 prefill) -----

@torch.library.custom_op("sparsekit::sk24_widen", mutates_args=(), device_types="cuda")
def sk24_widen(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    return sk24.widen(values, meta)


@sk24_widen.register_kernel("cpu")
def _sk24_widen_ref(values, meta):
    return sk24.decompress(values, meta, dtype=torch.bfloat16)


@sk24_widen.register_fake
def _sk24_widen_fake(values, meta):
    return values.new_empty((values.shape[0], 2 * values.shape[1]), dtype=torch.bfloat16)


# --- sk24_mma_mm (small-M 2:4 on the sparse tensor cores, the fragment-ordered format) ------

@torch.library.custom_op("sparsekit::sk24_mma_mm", mutates_args=(), device_types="cuda")
def sk24_mma_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                x_scale: Optional[torch.Tensor], w_scale: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], config: Optional[list[int]] = None
                ) -> torch.Tensor:
    return sk24_mma.launch(x, values, meta, x_scale, w_scale, bias,
                           None if config is None else tuple(config))


@sk24_mma_mm.register_kernel("cpu")
def _sk24_mma_mm_ref(x, values, meta, x_scale, w_scale, bias, config=None):
    return sk24_mma.reference(x, values, meta, x_scale, w_scale, bias)


@sk24_mma_mm.register_fake
def _sk24_mma_mm_fake(x, values, meta, x_scale, w_scale, bias, config=None):
    return x.new_empty((x.shape[0], 16 * values.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("sparsekit::sk24_mma_int4_mm", mutates_args=(), device_types="cuda")
def sk24_mma_int4_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                     scales: torch.Tensor, bias: Optional[torch.Tensor],
                     config: Optional[list[int]] = None) -> torch.Tensor:
    return sk24_mma.launch_int4(x, values, meta, scales, bias,
                                None if config is None else tuple(config))


@sk24_mma_int4_mm.register_kernel("cpu")
def _sk24_mma_int4_mm_ref(x, values, meta, scales, bias, config=None):
    return sk24_mma.reference_int4(x, values, meta, scales, bias)


@sk24_mma_int4_mm.register_fake
def _sk24_mma_int4_mm_fake(x, values, meta, scales, bias, config=None):
    return x.new_empty((x.shape[0], 16 * values.shape[0]), dtype=torch.bfloat16)


# --- scaled_mm (dense W8A8) ------------------------------------------------------------------

@torch.library.custom_op("sparsekit::scaled_mm", mutates_args=(), device_types="cuda")
def scaled_mm(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    m = xq.shape[0]
    if xq.dtype == torch.int8:
        acc = _compat.int_mm(_pad_rows(xq, 32), wq.t())[:m]
        y = acc.float() * x_scale * w_scale
        return (y if bias is None else y + bias.float()).to(out_dtype)
    xp = _pad_rows(xq, _M_MULTIPLE)
    sp = _pad_rows(x_scale, _M_MULTIPLE) if xp.shape[0] != m else x_scale.contiguous()
    sw = w_scale.reshape(1, -1)
    try:  # row-wise scales and bias in cuBLAS's epilogue
        y = _compat.scaled_mm(xp, wq.t(), scale_a=sp, scale_b=sw, bias=bias, out_dtype=out_dtype)
    except RuntimeError:  # a cuBLAS without bias for row-wise scaling: add it after
        y = _compat.scaled_mm(xp, wq.t(), scale_a=sp, scale_b=sw, out_dtype=out_dtype)
        y = y if bias is None else y + bias
    return y[:m] if xp.shape[0] != m else y


@scaled_mm.register_kernel("cpu")
def _scaled_mm_ref(xq, wq, x_scale, w_scale, bias, out_dtype):
    return scaled_matmul(xq, x_scale, wq, w_scale, bias, out_dtype)


@scaled_mm.register_fake
def _scaled_mm_fake(xq, wq, x_scale, w_scale, bias, out_dtype):
    return xq.new_empty((xq.shape[0], wq.shape[0]), dtype=out_dtype)


# --- activation quantization -----------------------------------------------------------------

@torch.library.custom_op("sparsekit::quant_rows", mutates_args=())
def quant_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = act_quant_rows(x, fmt_of(dtype))
    return q, s


@quant_rows.register_fake
def _quant_rows_fake(x, dtype):
    fmt_of(dtype)
    return (x.new_empty(x.shape, dtype=dtype),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


# --- int4_24_mm / int4_mm (W4A16, small M; sparsekit's formats) ----------------------------

@torch.library.custom_op("sparsekit::int4_24_mm", mutates_args=(), device_types="cuda")
def int4_24_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    return w4a16.launch_24(x, values, meta, scales, bias)


@int4_24_mm.register_kernel("cpu")
def _int4_24_mm_ref(x, values, meta, scales, bias):
    return w4a16.reference_24(x, values, meta, scales, bias)


@int4_24_mm.register_fake
def _int4_24_mm_fake(x, values, meta, scales, bias):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("sparsekit::int4_24_widen", mutates_args=(), device_types="cuda")
def int4_24_widen(values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor
                  ) -> torch.Tensor:
    return w4a16.widen_24(values, meta, scales)


@int4_24_widen.register_kernel("cpu")
def _int4_24_widen_ref(values, meta, scales):
    return w4a16.dequantize_packed_24(values, meta, scales, torch.bfloat16)


@int4_24_widen.register_fake
def _int4_24_widen_fake(values, meta, scales):
    return values.new_empty((values.shape[0], 4 * values.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("sparsekit::int4_mm", mutates_args=(), device_types="cuda")
def int4_mm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
            bias: Optional[torch.Tensor]) -> torch.Tensor:
    return w4a16.launch(x, values, scales, bias)


@int4_mm.register_kernel("cpu")
def _int4_mm_ref(x, values, scales, bias):
    return w4a16.reference(x, values, scales, bias)


@int4_mm.register_fake
def _int4_mm_fake(x, values, scales, bias):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=torch.bfloat16)


# --- decode_attention (one query token over a static KV cache) -------------------------------

@torch.library.custom_op("sparsekit::decode_attention", mutates_args=(), device_types="cuda")
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    return attention.launch(q, k, v, mask, scale)


@decode_attention.register_kernel("cpu")
def _decode_attention_ref(q, k, v, mask, scale):
    return attention.reference(q, k, v, mask, scale)


@decode_attention.register_fake
def _decode_attention_fake(q, k, v, mask, scale):
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


__all__ = ["GELU_APPROXIMATE", "act_quant_rows", "alpha_path", "decode_attention", "fmt_of",
           "int4_24_mm", "int4_24_widen", "int4_mm", "int8_acc_dtype", "pack_24", "quant_rows",
           "scaled_mm", "sk24_mm", "sk24_mma_int4_mm", "sk24_mma_mm", "sk24_widen", "sparse24_mm",
           "sparse24_mm_alpha"]
