"""The cuSPARSELt kernels as custom ops (the CUDA implementation, a plain-torch CPU reference
and a fake each): ``sparsekit::sparse24_mm`` (torch's binding) and
``sparsekit::sparse24_mm_alpha`` (sparsekit's, :mod:`.ext`: scale, bias and GELU in the
epilogue); :func:`pack_24` puts a 2:4 weight in the form they take on its device.

- ``sparse24_mm(x, packed, bias, out_features, alg_id, out_dtype)``: ``x @ W.T (+ bias)`` for a
  2:4 weight W (N, K). On CUDA ``packed`` is W compressed by ``torch._cslt_compress`` (values
  and metadata, opaque); on CPU it is W itself, dense with its zeros (:func:`pack_24`). ``x``
  (M, K) is bf16, float8 e4m3fn or int8 with W of the same dtype; the 8-bit products come back
  unscaled (``out_dtype`` bf16, or int32 for int8 where cuSPARSELt offers it): the scales are
  applied by the caller in plain torch, where the compiler fuses them into what follows.
- ``sparse24_mm_alpha(x, packed, bias, out_features, alg_id, alpha, gelu)``: bf16
  ``act(alpha * x @ W.T + bias)`` for an 8-bit 2:4 weight W and a host scalar ``alpha`` (a
  static activation scale times a per-tensor weight scale), the scale, bias and GELU in
  cuSPARSELt's epilogue. ``gelu`` is set by the compiler pass
  :class:`sparsekit.accel.epilogue.FuseGelu`, never by a layer.
"""

from typing import Optional

import torch
import functools

import torch.nn.functional as F

from sparsekit import _compat
from sparsekit.accel.kernels import M_MULTIPLE, pad_rows
from sparsekit.accel.kernels.cusparselt import ext as cslt_ext

# the GELU cuSPARSELt's epilogue computes (F.gelu's ``approximate``): the tanh form, measured on
# the H200 (cuSPARSELt 0.8.0) by tests/accel/test_accel_gpu.py at pre-activations near -3, where
# the two forms differ by 10%. An erf GELU (BERT's, ViT's) is left to the compiler.
GELU_APPROXIMATE = "tanh"


# --- sparse24_mm -------------------------------------------------------------------------------

@torch.library.custom_op("sparsekit::sparse24_mm", mutates_args=(), device_types="cuda")
def sparse24_mm(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                out_features: int, alg_id: int, out_dtype: torch.dtype) -> torch.Tensor:
    m = x.shape[0]
    xp = pad_rows(x, M_MULTIPLE)
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
    xp = pad_rows(x, M_MULTIPLE)
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
    """Whether the 8-bit 2:4 layers may use :func:`sparse24_mm_alpha` on CUDA: the current
    plan allows it (``PlanOptions.cslt_epilogue``) and the binding is built and loads."""
    return cslt_ext.enabled() and cslt_ext.load() is not None


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


__all__ = ["GELU_APPROXIMATE", "alpha_path", "int8_acc_dtype", "pack_24", "sparse24_mm",
           "sparse24_mm_alpha"]
