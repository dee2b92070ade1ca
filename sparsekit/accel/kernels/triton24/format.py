"""sparsekit's own 2:4 format and its small-M (decode) GEMM kernel, written in Triton.

At batch 1-32 a decode step's GEMMs read every weight once and do almost no arithmetic per
byte: they are bound by HBM bandwidth. cuSPARSELt is built for large M and runs slower than
dense there; this kernel streams the compressed weight once and expands it in registers.

The format (per weight W (N, K) with at most 2 nonzeros in every group of 4 along K):
- ``values`` (N, K/2), W's dtype (bfloat16 or float8 e4m3fn): per row, the first kept entry
  of every group (K/4 of them), then the second kept entry of every group, each kept pair in
  increasing column order (zeros where a group keeps fewer than two);
- ``meta`` (N, K/32) int32: one 4-bit code per group, ``i0 | i1 << 2`` with i0 < i1 the kept
  columns' positions inside the group; with W = K/32 words per row, word ``w`` holds group
  ``s * W + w`` in bits ``4*s`` (s = 0..7: eight slabs of K/8 columns, so that the kernel
  never reshapes a register tile, :mod:`sparsekit.accel.kernels.triton24.kernel`).
Bytes per dense weight: bf16 1.125 (values 1, metadata 0.125), fp8 0.625.

``matmul(x, values, meta, x_scale, w_scale, bias)`` computes, in float32,
``(x @ W.T) * x_scale * w_scale + bias`` in bfloat16, with x (M, K) of ``values``' dtype
(bfloat16 x with an fp8 weight too: weight-only layers, the weight widened exactly) (or
its position planes, :func:`planes`: what the model passes, so that no extra kernel runs),
``x_scale`` (M, 1) or (1, 1) float32 or None, ``w_scale`` (N,) float32 or None, ``bias`` (N,)
bfloat16 or None. Up to 8 rows it multiplies on CUDA cores, from 2 on tensor cores
(``tl.dot``, M padded to 16 or 32): the autotuner picks per shape. :func:`reference` is the
same product in plain torch (CPU and tests).
"""

from __future__ import annotations

import functools

import torch

GROUPS_PER_WORD = 8
K_MULTIPLE = 512  # K must be a multiple (16 metadata words per slab; Llama-style K all are)
MAX_M = 32       # the M range the kernel is tuned for (decode batches)
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
LAYOUTS = ("slabs", "interleaved")


def check_shape(out_features: int, in_features: int) -> str | None:
    """None when a weight (out_features, in_features) can take the format, else why not."""
    if in_features % K_MULTIPLE:
        return (f"in_features {in_features} is not a multiple of {K_MULTIPLE} "
                f"(sparsekit's 2:4 decode kernel takes whole {K_MULTIPLE}-column blocks)")
    if out_features < 1:
        return "out_features must be at least 1"
    return None


def kept(weight: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (N, K/4, 2) in ``weight``'s dtype, positions (N, K/4, 2) int64) of a 2:4 weight
    (N, K): per group of 4 along K its two kept entries in column order (the nonzeros, then the
    lowest free positions), their raw bits gathered; ValueError naming ``what`` when a group
    holds more than two nonzeros. Shared by the small-M formats (here and :mod:`sk24_mma`)."""
    n, k = weight.shape
    w4 = weight.reshape(n, k // 4, 4)
    nz = w4.float() != 0
    if bool((nz.sum(-1) > 2).any()):
        raise ValueError(f"{what}: the weight has a group of 4 (along in_features) with more "
                         f"than 2 nonzeros; prune it to 2:4 first")
    key = nz.to(torch.int32) * 8 + (3 - torch.arange(4, device=weight.device, dtype=torch.int32))
    idx = key.topk(2, dim=-1).indices.sort(dim=-1).values
    bits = torch.int8 if weight.element_size() == 1 else torch.int16
    return torch.gather(w4.view(bits), -1, idx).view(weight.dtype), idx


def compress(weight: torch.Tensor, layout: str = "slabs") -> tuple[torch.Tensor, torch.Tensor]:
    """(values (N, K/2), meta (N, K/32) int32) of a 2:4 weight (N, K); ValueError when a group
    of 4 holds more than two nonzeros or K does not fit the layout. ``layout`` "slabs" (the
    small-M kernel's, K a multiple of 512) or "interleaved" (group g in nibble g % 8 of word
    g // 8, K a multiple of 32: the int4 kernels' :mod:`sparsekit.accel.kernels.int4.format`)."""
    n, k = weight.shape
    reason = check_shape(n, k) if layout == "slabs" else (
        None if k % 32 == 0 else f"in_features {k} is not a multiple of 32")
    if layout not in LAYOUTS:
        raise ValueError(f"2:4 decode format: layout must be one of {LAYOUTS}, got {layout!r}")
    if reason:
        raise ValueError(f"2:4 decode format: {reason}")
    if weight.dtype not in DTYPES:
        raise ValueError(f"2:4 decode format: weight dtype must be one of {DTYPES}, "
                         f"got {weight.dtype}")
    values, idx = kept(weight, "2:4 decode format")
    if layout == "slabs":  # the first kept values of a row, then its second ones
        values = values.transpose(1, 2)
    values = values.reshape(n, k // 2).contiguous()
    code = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.int64)  # (N, K/4)
    shifts = 4 * torch.arange(GROUPS_PER_WORD, device=weight.device, dtype=torch.int64)
    if layout == "slabs":  # slab s of the groups (K/32 of them) goes to nibble s of the words
        words = (code.reshape(n, GROUPS_PER_WORD, k // 32) << shifts[:, None]).sum(1)
    else:
        words = (code.reshape(n, k // 32, GROUPS_PER_WORD) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # as signed int32 bits
    if weight.is_cuda:
        counters(weight.device)  # before any graph capture that launches the kernel
    return values, words.to(torch.int32).contiguous()


def decompress(values: torch.Tensor, meta: torch.Tensor, layout: str = "slabs",
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight (N, K) in ``dtype`` (default ``values``' dtype; a wider float widens
    exactly): the inverse of :func:`compress`, in elementwise ops (the kept values placed by
    where-selects, no scatter) that a compiler fuses into one pass over the weight (the
    weight-only fp8 layers' prefill widens their weight this way on each call)."""
    n, half = values.shape
    k = 2 * half
    shifts = 4 * torch.arange(GROUPS_PER_WORD, device=meta.device, dtype=torch.int32)
    if layout == "slabs":
        code = (meta[:, None, :] >> shifts[:, None]) & 0xF  # (N, 8, K/32)
    else:
        code = (meta[..., None] >> shifts) & 0xF  # (N, K/32, 8)
    code = code.reshape(n, k // 4)
    i0, i1 = code & 3, code >> 2
    pairs = (values.reshape(n, 2, k // 4).transpose(1, 2) if layout == "slabs" else
             values.reshape(n, k // 4, 2))
    out = dtype or values.dtype
    work = torch.float32 if out.itemsize == 1 else out  # no where-select on float8 everywhere
    v0, v1 = pairs[..., 0].to(work), pairs[..., 1].to(work)
    cols = [torch.where(i0 == j, v0, torch.where(i1 == j, v1, 0.0)) for j in range(4)]
    return torch.stack(cols, dim=-1).reshape(n, k).to(out)


WIDEN_BLOCK = (16, 128)  # (rows, groups) a program of the widening kernel


def widen_grid(n: int, k: int) -> tuple[int, int]:
    """The launch grid of a widening kernel (this format's or the int4 2:4 one's) for an
    (N, K) weight: :data:`WIDEN_BLOCK` rows and groups of 4 a program."""
    bn, bg = WIDEN_BLOCK
    return -(-n // bn), -(-(k // 4) // bg)


def widen(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """:func:`decompress` of the "slabs" layout to bfloat16 (exact), as one Triton kernel (on
    CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``; the op
    :func:`sparsekit.accel.kernels.triton24.op.sk24_widen` runs :func:`decompress` on CPU). The
    weight-only
    fp8 layers' prefill widens its weight through that op on each call: a compiler traces one
    call, not decompress's twenty-odd elementwise ops a layer (compile time)."""
    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    n, k = values.shape[0], 2 * values.shape[1]
    out = torch.empty((n, k), dtype=torch.bfloat16, device=values.device)
    sk24_triton.widen_kernel[widen_grid(n, k)](values.contiguous(), meta.contiguous(), out, n,
                                               k, BLOCK_N=WIDEN_BLOCK[0],
                                               BLOCK_G=WIDEN_BLOCK[1])
    return out


def reference(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
              x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in plain torch: float32 products of the dense weight (x as
    (M, K) or as its position planes, :func:`planes`)."""
    if x.dim() == 3:
        x = unplanes(x)
    y = x.float() @ decompress(values, meta).float().t()
    if x_scale is not None:
        y = y * x_scale.float()
    if w_scale is not None:
        y = y * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


@functools.cache
def _kernel():
    """(triton, the autotuned kernel, the plain kernel), imported on first use."""
    import triton

    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton
    return triton, sk24_triton.tuned, sk24_triton.sk24_kernel


def planes(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the kernel reads it: (M, 4, K/4), plane p holding x[:, 4g + p] at g. Made
    outside the kernel's op, so that a compiler writes it from x's producer directly."""
    m, k = x.shape
    return x.reshape(m, k // 4, 4).transpose(1, 2).contiguous()


def unplanes(xp: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`planes`: (M, 4, K/4) back to (M, K)."""
    m, _, q = xp.shape
    return xp.transpose(1, 2).reshape(m, 4 * q)


def m_bucket(m: int) -> int:
    """The autotuner's M key: 1, 2, 4, 8, 16, 32 (the next power of two, at most 32)."""
    return 1 if m <= 1 else min(1 << (m - 1).bit_length(), MAX_M)


MAX_SPLIT = 4          # the largest SPLIT_K in the kernel's configs (workspace size)
_COUNTERS = 1 << 16    # per-device tile counters of the split-K reduction
_counters: dict = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters (int32 zeros; every launch leaves them at zero).
    Made outside any CUDA graph capture: :func:`compress` makes them for a CUDA weight."""
    key = str(torch.device(device))
    if key not in _counters:
        _counters[key] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return _counters[key]


def launch(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
           x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
           bias: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """Run the Triton kernel on x (M, K), or on its position planes (M, 4, K/4) (:func:`planes`:
    the fast form; (M, K) is rearranged here first): autotuned per (M bucket, N, K, scales) on
    CUDA; with ``config`` (``MODE``, ``BLOCK_N``, ``BLOCK_W``, ``SPLIT_K``, optionally
    ``num_warps``) fixed, as on CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter
    cannot time)."""
    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    triton, tuned, raw = _kernel()
    xp = planes(x) if x.dim() == 2 else x.contiguous()
    m, k = xp.shape[0], 4 * xp.shape[2]
    if xp.shape[1] != 4 or k != 2 * values.shape[1]:
        raise ValueError(f"sk24 kernel: x must be (M, {2 * values.shape[1]}) or its planes "
                         f"(M, 4, {values.shape[1] // 2}), got {tuple(x.shape)}")
    if xp.dtype != values.dtype and not (xp.dtype == torch.bfloat16
                                         and values.dtype == torch.float8_e4m3fn):
        raise ValueError(f"sk24 kernel: x is {xp.dtype}, the weight {values.dtype} (x must be "
                         f"the weight's dtype, or bfloat16 for a float8_e4m3fn weight)")
    if config is None and not xp.is_cuda:
        mode = sk24_triton.SELECT if m <= 2 else (sk24_triton.PLANES if m <= 8 else
                                                   sk24_triton.DOT)
        config = {"MODE": mode, "BLOCK_N": 16, "BLOCK_W": 16,
                  "SPLIT_K": 2 if (k // 32) >= 32 else 1}
    if config is not None:
        config = {"SPLIT_K": 1, **config}
        if (k // 32) % config["BLOCK_W"] or (k // 32) // config["BLOCK_W"] < config["SPLIT_K"]:
            raise ValueError(f"sk24 kernel: config {config} needs K/32 = {k // 32} words to "
                             f"be a multiple of BLOCK_W, in at least SPLIT_K blocks")
    kernel = tuned if config is None else raw
    n = values.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=xp.device)
    small_m = max(1, 1 << (min(m, 8) - 1).bit_length())  # rows per program on CUDA cores
    dot_m = 16 if m <= 16 else 32                        # rows per program on tensor cores
    split_max = MAX_SPLIT if config is None else config["SPLIT_K"]
    part = torch.empty((split_max, m, n), dtype=torch.float32, device=xp.device)
    cnt = counters(xp.device)
    xs = x_scale.reshape(-1).float() if x_scale is not None else None

    def grid(meta_):
        tiles_n = triton.cdiv(n, meta_["BLOCK_N"])
        tiles_m = triton.cdiv(m, dot_m if meta_["MODE"] == sk24_triton.DOT else small_m)
        if tiles_n * tiles_m > _COUNTERS:
            raise ValueError(f"sk24 kernel: {tiles_n * tiles_m} output tiles, at most "
                             f"{_COUNTERS}")
        return (tiles_n, meta_["SPLIT_K"], tiles_m)
    dummy = y
    kernel[grid](xp, values, meta, dummy if xs is None else xs,
                 dummy if w_scale is None else w_scale, dummy if bias is None else bias, y,
                 part, cnt, m, n, k, xp.stride(0), 0 if xs is None or xs.numel() == 1 else 1,
                 m_bucket(m), HAS_XS=xs is not None, HAS_WS=w_scale is not None,
                 HAS_BIAS=bias is not None, DOT_F32=not xp.is_cuda, SMALL_M=small_m,
                 DOT_M=dot_m, **(config or {}))
    return y


def bound_bytes(m: int, n: int, k: int, dtype: torch.dtype) -> int:
    """Bytes a decode GEMM must move at least: compressed weight, x in, y out (bias ignored)."""
    item = torch.empty((), dtype=dtype).element_size()
    return n * (k // 2) * item + n * (k // 32) * 4 + m * k * item + m * n * 2


__all__ = ["DTYPES", "K_MULTIPLE", "MAX_M", "WIDEN_BLOCK", "bound_bytes", "check_shape",
           "compress", "decompress", "kept", "launch", "m_bucket", "planes", "reference",
           "unplanes", "widen", "widen_grid"]
