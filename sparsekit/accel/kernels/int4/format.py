"""int4 weights with bf16 activations (W4A16): sparsekit's packed formats, dense and 2:4, and
their small-M (decode) GEMM kernels, written in Triton.

A decode step's GEMMs read every weight once: 4-bit weights move a quarter of bf16's bytes,
and 2:4 halves that again. The kernels stream the packed weight once and dequantize it in
registers; they are built for M = 1..32 (CUDA cores up to M = 4, ``tl.dot`` beyond) and take
any M.

Quantization (what :mod:`sparsekit.quant`'s ``int4_weight`` scheme stores): symmetric int4
values ``q`` in [-8, 7], one float32 scale per ``group_size`` consecutive input columns of each
output row; the weight is ``q * scale``.

The formats, for a weight W (N, K) with int values ``q`` and ``scales`` (N, K / group_size):
- dense: ``values`` (N, K/2) uint8, columns 2j and 2j+1 in byte j's low and high nibble;
- 2:4 (at most 2 nonzeros in every group of 4 along K): ``values`` (N, K/4) uint8, the two kept
  entries of group j (in increasing column order) in byte j's low and high nibble, and
  ``meta`` (N, K/32) int32, a 4-bit code per group, group g in bits ``4*(g % 8)`` of word
  ``g // 8``: for kept positions i0 < i1 in the group, ``P | Q << 1 | R << 2`` with
  ``P = (i0 == 0)``, ``R = (i1 == 3)`` and ``Q = (i1 == 2)`` when P else ``(i0 == 1)``. The
  kernels pick each kept value's activation with these three bits and two selects:
  ``x[i0] = x0 if P else (x1 if Q else x2)``, ``x[i1] = x3 if R else (x2 if Q else x1)``
  (:func:`positions` decodes them);
- a nibble holds ``q + 8`` (offset binary, 0..15);
- ``scales`` (N, K / group_size) float32 (the quantizer's own values, so the kernels compute
  exactly the weight quant/ dequantizes; bfloat16 scales are taken too and save 1/64 byte per
  weight at group 128).
Bytes per dense weight at group 128 with float32 scales: dense 0.53 (values 0.5), 2:4 0.41
(values 0.25, metadata 0.125); bf16 dense is 2, bf16 2:4 1.125.

Shapes: K a multiple of 64 and of ``group_size``; ``group_size`` a multiple of 64 (128 is the
default, K is per-channel) or 16 or 32. A kernel's K tile (``BLOCK_K``) either lies inside one
group (the group's scale multiplies the tile's partial product, ``M x BLOCK_N`` multiplies) or
covers whole groups (the scales multiply the weight tile); the autotuner keeps the tiles that
do one or the other.

``matmul_24(x, values, meta, scales, bias)`` and ``matmul(x, values, scales, bias)`` compute, in
float32, ``x @ (q * scale).T + bias`` in bfloat16 for bf16 x (M, K) and bf16 bias (N,) or
None; :func:`reference_24` and :func:`reference` are the same products in plain torch.
"""

from __future__ import annotations

import functools

import torch

from sparsekit.accel.kernels.triton24 import format as sk24

K_MULTIPLE = 64    # the smallest K tile
MAX_M = 32         # the M range the kernels are tuned for (decode batches)
GROUP_SIZE = 128   # the default quantization group
QMIN, QMAX = -8, 7
SCALE_DTYPES = (torch.float32, torch.bfloat16)
_SMALL_GROUPS = (16, 32)  # groups below one K tile: a tile covers several


def check_shape(out_features: int, in_features: int, group_size: int) -> str | None:
    """None when a weight (out_features, in_features) with ``group_size`` can take the W4A16
    formats, else why not (naming the shape)."""
    shape = f"weight {out_features}x{in_features} (out x in), group_size {group_size}"
    if out_features < 1:
        return f"{shape}: out_features must be at least 1"
    if in_features % K_MULTIPLE:
        return (f"{shape}: in_features is not a multiple of {K_MULTIPLE} (the int4 kernels "
                f"take whole {K_MULTIPLE}-column tiles)")
    if group_size < 1 or (group_size % K_MULTIPLE and group_size not in _SMALL_GROUPS):
        return (f"{shape}: group_size must be a multiple of {K_MULTIPLE} or one of "
                f"{_SMALL_GROUPS}")
    if in_features % group_size:
        return f"{shape}: in_features is not a multiple of group_size"
    return None


def _require(out_features: int, in_features: int, group_size: int) -> None:
    reason = check_shape(out_features, in_features, group_size)
    if reason:
        raise ValueError(f"int4 format: {reason}")


def _check_q(q: torch.Tensor, scales: torch.Tensor) -> int:
    """The group size of int values ``q`` (N, K) and ``scales`` (N, groups); ValueError else."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"int4 format: the int values must be a 2-D torch.int8 tensor, got "
                         f"{tuple(q.shape)} {q.dtype}")
    n, k = q.shape
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] < 1 or k % scales.shape[1]:
        raise ValueError(f"int4 format: scales {tuple(scales.shape)} do not fit the weight "
                         f"{n}x{k}: expected (N, K / group_size)")
    if scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"int4 format: scales must be one of {SCALE_DTYPES}, got {scales.dtype}")
    group = k // scales.shape[1]
    _require(n, k, group)
    if bool(((q < QMIN) | (q > QMAX)).any()):
        raise ValueError(f"int4 format: values must lie in [{QMIN}, {QMAX}]")
    return group


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int values (N, C) int8 in [-8, 7], C even -> (N, C/2) uint8: column 2j in byte j's low
    nibble, 2j+1 in its high nibble, each as ``q + 8``."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(q.shape[0], -1, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: (N, C/2) uint8 -> (N, C) int8."""
    lo = (packed & 0xF).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def pack(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense format of int values ``q`` (N, K) int8 and ``scales`` (N, K / group_size):
    (values (N, K/2) uint8, scales contiguous). ValueError on a shape the kernel cannot take."""
    _check_q(q, scales)
    if q.is_cuda:
        sk24.counters(q.device)  # the split-K counters, before any graph capture
    return pack_nibbles(q), scales.contiguous()


def _nibble_codes(meta: torch.Tensor) -> torch.Tensor:
    """(N, W) int32 words of 8 4-bit codes -> (N, 8W) int32, group g = nibble g % 8 of word
    g // 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=meta.device)
    return ((meta[..., None] >> shifts) & 0xF).reshape(meta.shape[0], -1)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_nibble_codes` (codes 0..15; a code of 8 or more in a word's top
    nibble wraps to a negative word, as int32 bits)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    w = (codes.reshape(codes.shape[0], -1, 8).long() << shifts).sum(-1)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def positions(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept positions (i0, i1), i0 < i1, (N, K/4) int32 of every group of the int4 2:4
    metadata ``meta`` (N, K/32) (codes P | Q << 1 | R << 2, the module docstring's)."""
    code = _nibble_codes(meta)
    p, q, r = code & 1, (code >> 1) & 1, (code >> 2) & 1
    i0 = torch.where(p == 1, 0, torch.where(q == 1, 1, 2))
    i1 = torch.where(r == 1, 3, torch.where(q == 1, 2, 1))
    return i0.int(), i1.int()


def pack_24(q: torch.Tensor, scales: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 2:4 format of int values ``q`` (N, K) int8 with at most 2 nonzeros in every group of
    4 along K: (values (N, K/4) uint8, meta (N, K/32) int32, scales). ValueError when a group
    holds more than two nonzeros or on a shape the kernel cannot take."""
    _check_q(q, scales)
    try:  # int4 values are exact in bfloat16: sk24's compression picks the kept positions
        kept, meta = sk24.compress(q.to(torch.bfloat16), layout="interleaved")
    except ValueError as e:
        raise ValueError(f"int4 2:4 format: {e}") from None
    code = _nibble_codes(meta)  # sk24's i0 | i1 << 2 -> P | Q << 1 | R << 2
    i0, i1 = code & 3, code >> 2
    p, r = i0 == 0, i1 == 3
    qbit = torch.where(p, i1 == 2, i0 == 1)
    meta = _words(p.int() | (qbit.int() << 1) | (r.int() << 2))
    if q.is_cuda:
        sk24.counters(q.device)  # the split-K counters, before any graph capture
    return pack_nibbles(kept.to(torch.int8)), meta, scales.contiguous()


def unpack(values: torch.Tensor) -> torch.Tensor:
    """The int values (N, K) int8 of the dense format."""
    return unpack_nibbles(values)


def unpack_24(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The int values (N, K) int8 of the 2:4 format, its zeros in place."""
    kept = unpack_nibbles(values).to(torch.bfloat16)
    i0, i1 = positions(meta)
    return sk24.decompress(kept, _words(i0 | (i1 << 2)), layout="interleaved").to(torch.int8)


def dequantize(q: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` (N, K), each scale repeated over its group, computed in float32."""
    group = q.shape[1] // scales.shape[1]
    return (q.float() * scales.float().repeat_interleave(group, dim=1)).to(dtype)


def _scaled(w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = w.shape
    groups = scales.shape[1]
    w = w.reshape(n, groups, k // groups) * scales.float()[:, :, None]
    return w.reshape(n, k).to(dtype)


def _nibble_floats(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (values & 0xF).float() - 8, (values >> 4).float() - 8


def dequantize_packed(values: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense format's weight ``q * scale`` (N, K) in ``dtype`` (float32 products), in
    elementwise torch ops that a compiler fuses into one pass (prefill dequantizes this way)."""
    lo, hi = _nibble_floats(values)
    return _scaled(torch.stack([lo, hi], dim=-1).reshape(values.shape[0], -1), scales, dtype)


def dequantize_packed_24(values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2:4 format's weight ``q * scale`` (N, K), zeros in place, as
    :func:`dequantize_packed` (the kept values placed by where-selects, no scatter)."""
    v0, v1 = _nibble_floats(values)  # (N, K/4): the kept entries of each group of 4
    i0, i1 = positions(meta)
    cols = [torch.where(i0 == j, v0, torch.where(i1 == j, v1, 0.0)) for j in range(4)]
    return _scaled(torch.stack(cols, dim=-1).reshape(values.shape[0], -1), scales, dtype)


def widen_24(values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize_packed_24` to bfloat16, as one Triton kernel (on CUDA, or on CPU
    tensors under ``TRITON_INTERPRET=1``; the op
    :func:`sparsekit.accel.kernels.int4.op.int4_24_widen`
    runs the elementwise ops on CPU). An int4 2:4 layer's prefill dequantizes its weight
    through that op on each call: a compiler traces one call, not the elementwise ops."""
    _, w4a16_triton = _kernels()
    n, k = values.shape[0], 4 * values.shape[1]
    out = torch.empty((n, k), dtype=torch.bfloat16, device=values.device)
    bn, bg = sk24.WIDEN_BLOCK
    w4a16_triton.widen_24_kernel[sk24.widen_grid(n, k)](
        values.contiguous(), meta.contiguous(), scales.contiguous(), out, n, k,
        scales.shape[1], BLOCK_N=bn, BLOCK_G=bg)
    return out


def _check_call(name: str, x: torch.Tensor, n: int, k: int, scales: torch.Tensor,
                bias: torch.Tensor | None) -> None:
    """Shape and dtype checks of one product (no tensor data is read)."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be (M, {k}), got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: x must be bfloat16, got {x.dtype}")
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] < 1 or k % scales.shape[1]:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} do not fit the weight {n}x{k}")
    if scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name}: scales must be one of {SCALE_DTYPES}, got {scales.dtype}")
    _require(n, k, k // scales.shape[1])
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{name}: bias must be ({n},), got {tuple(bias.shape)}")


def _dense_product(x, w, bias):
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


def reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """What the dense kernel computes, in plain torch (float32 products)."""
    n, k = values.shape[0], 2 * values.shape[1]
    _check_call("int4 GEMM", x, n, k, scales, bias)
    return _dense_product(x, dequantize_packed(values, scales), bias)


def reference_24(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                 scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the 2:4 kernel computes, in plain torch (float32 products)."""
    n, k = values.shape[0], 4 * values.shape[1]
    _check_call("int4 2:4 GEMM", x, n, k, scales, bias)
    return _dense_product(x, dequantize_packed_24(values, meta, scales), bias)


@functools.cache
def _kernels():
    """(triton, the Triton source module), imported on first use."""
    import triton

    from sparsekit.accel.kernels.int4 import kernel as w4a16_triton
    return triton, w4a16_triton


def _block_m(m: int) -> int:
    return 1 if m == 1 else (4 if m <= 4 else (16 if m <= 16 else 32))


def _launch(kernel, raw, x, weight_args, n, k, scales, bias, config):
    triton, _ = _kernels()
    if config is None and not x.is_cuda:
        config = {"BLOCK_N": 16, "BLOCK_K": K_MULTIPLE}
    kernel = kernel if config is None else raw
    m = x.shape[0]
    x = x.contiguous()
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    block_m = _block_m(m)
    grid = lambda meta_: (triton.cdiv(n, meta_["BLOCK_N"]), triton.cdiv(m, block_m))  # noqa: E731
    weight_args = tuple(t.contiguous() for t in weight_args)  # values (and 2:4 metadata)
    stride_meta = weight_args[1].stride(0) if len(weight_args) == 2 else 0
    scales = scales.contiguous()
    kernel[grid](x, *weight_args, scales, y if bias is None else bias, y,
                 m, n, k, x.stride(0), weight_args[0].stride(0), stride_meta, scales.stride(0),
                 sk24.m_bucket(m), k // scales.shape[1],
                 HAS_BIAS=bias is not None, BLOCK_M=block_m, USE_DOT=m > 4,
                 DOT_F32=not x.is_cuda, **(config or {}))
    return y


ROWS_MAX_M = 4  # the M up to which the word-tile kernels run (CUDA cores)


_FACTORS: dict = {}


def _factors(sparse: bool, device: torch.device) -> torch.Tensor:
    """The eight float32 factors ``16**-j`` of :func:`x_planes_24` (``sparse``) or
    :func:`x_planes` on ``device``: made once per device and kept, so that a call launches one
    kernel (the planes); inside a CUDA graph capture that finds none yet, made on the device
    and not kept (a tensor made during a capture holds its value only when the graph runs)."""
    f = _FACTORS.get((sparse, device))
    if f is not None:
        return f
    j = torch.arange(8, device=device)  # made on the device: no copy, capturable
    if sparse:
        t = j % 4
        f = torch.exp2(-4.0 * (2 * t - 3 * (t // 2)))
    else:
        f = torch.exp2(-4.0 * torch.where(j < 4, j, j - 3))
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _FACTORS[(sparse, device)] = f
    return f


def x_planes_24(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the 2:4 word-tile kernel reads it: (M, K/64, 8, 2, 4) float32,
    ``[:, b, s, i, p]`` holding ``x[:, 32w + 4s + p]`` for word ``w = 2b + i`` (position p of
    group s of metadata word w) times ``16**-j``, j = 0, 2, 1, 3 for s % 4 = 0..3 (the kernel
    reads group s's first kept nibble 16**j times too large): one step's x is one contiguous
    block, a group's positions in both words one 32-byte vector. One kernel a call."""
    m, k = x.shape
    out = torch.empty((m, k // 64, 8, 2, 4), dtype=torch.float32, device=x.device)
    f = _factors(True, x.device)[:, None, None]
    return torch.mul(x.reshape(m, k // 64, 2, 8, 4).transpose(2, 3), f, out=out)


def x_planes(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the dense word-tile kernel reads it: (M, K/32, 8, 4) float32, [:, b, j, i]
    holding ``x[:, 8w + j]`` times ``16**-j`` (j < 4) or ``16**-(j - 3)`` for word
    ``w = 4b + i`` (the kernel reads nibble j of a word that many times too large). One kernel
    a call."""
    m, k = x.shape
    out = torch.empty((m, k // 32, 8, 4), dtype=torch.float32, device=x.device)
    f = _factors(False, x.device)[:, None]
    return torch.mul(x.reshape(m, k // 32, 4, 8).transpose(2, 3), f, out=out)


def rows_fit(k: int, group: int, sparse: bool) -> bool:
    """Whether the word-tile kernels (M <= 4) take K and ``group``: a 16-byte vector of a row
    (64 columns of 2:4, 32 dense) must lie inside one quantization group (K, a multiple of
    64 and of the group, then holds whole vectors)."""
    return k % K_MULTIPLE == 0 and group % (64 if sparse else 32) == 0


def _launch_rows(sparse, x, values, meta, n, k, scales, bias, config):
    """The word-tile kernels (M <= 4): values as words, x as float32 planes, split-K partials
    summed by the last program of each output tile (:func:`sk24.counters`)."""
    triton, src = _kernels()
    m = x.shape[0]
    block_m = 1 if m == 1 else (2 if m == 2 else 4)
    if config is None and not x.is_cuda:
        config = {"BLOCK_N": 32, "U": 1, "SPLIT_K": 2 if k >= 256 else 1, "num_warps": 1}
    if config is not None and not src.row_fits(k, k // scales.shape[1], sparse, config["U"],
                                               config["SPLIT_K"]):
        raise ValueError(f"int4 kernel: config {config} does not fit K {k}, group "
                         f"{k // scales.shape[1]}")
    xpad = x if m % block_m == 0 else torch.cat([x, x.new_zeros(block_m - m % block_m, k)])
    if sparse:  # x's rows padded to a whole BLOCK_M: the kernel loads them unmasked
        kernel = src.tuned_24_rows if config is None else src.int4_24_rows_kernel
        xp, words = x_planes_24(xpad), values.contiguous().view(torch.int64)
    else:
        kernel = src.tuned_rows if config is None else src.int4_rows_kernel
        xp, words = x_planes(xpad), values.contiguous().view(torch.int32)
    meta = words if meta is None else meta.contiguous()
    scales = scales.contiguous()
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    split = max(c.kwargs["SPLIT_K"] for c in src.row_configs()) if config is None \
        else config["SPLIT_K"]
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    cnt = sk24.counters(x.device)

    def grid(meta_):
        tiles = triton.cdiv(n, meta_["BLOCK_N"]) * triton.cdiv(m, block_m)
        if tiles > cnt.numel():
            raise ValueError(f"int4 kernel: {tiles} output tiles, at most {cnt.numel()}")
        return (triton.cdiv(n, meta_["BLOCK_N"]), meta_["SPLIT_K"], triton.cdiv(m, block_m))
    kernel[grid](xp, words, meta, scales, y if bias is None else bias, y, part, cnt, m, n, k,
                 scales.stride(0), sk24.m_bucket(m), 0x4B000000, k // scales.shape[1],
                 HAS_BIAS=bias is not None, BLOCK_M=block_m, SPARSE=sparse, **(config or {}))
    return y


def _use_rows(m: int, k: int, group: int, sparse: bool, config: dict | None) -> bool:
    if config is not None:
        return "U" in config
    return m <= ROWS_MAX_M and rows_fit(k, group, sparse)


def launch(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """Run the dense Triton kernel: autotuned per (M bucket, N, K, group) on CUDA, the
    word-tile kernel for M <= 4 where :func:`rows_fit`, else the tile kernel; with ``config``
    fixed, as on CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter cannot time): the
    word-tile kernel's (``BLOCK_N``, ``U``, ``SPLIT_K``, optionally ``num_warps``) or the tile
    kernel's (``BLOCK_N``, ``BLOCK_K``, optionally ``num_warps``, ``num_stages``), the keys
    pick the kernel."""
    n, k = values.shape[0], 2 * values.shape[1]
    _check_call("int4 GEMM", x, n, k, scales, bias)
    if _use_rows(x.shape[0], k, k // scales.shape[1], False, config):
        return _launch_rows(False, x.contiguous(), values, None, n, k, scales, bias, config)
    _, src = _kernels()
    return _launch(src.tuned_dense, src.int4_kernel, x, (values,), n, k, scales, bias, config)


def launch_24(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """Run the 2:4 Triton kernel (autotuned on CUDA, ``config`` as in :func:`launch`)."""
    n, k = values.shape[0], 4 * values.shape[1]
    _check_call("int4 2:4 GEMM", x, n, k, scales, bias)
    if _use_rows(x.shape[0], k, k // scales.shape[1], True, config):
        return _launch_rows(True, x.contiguous(), values, meta, n, k, scales, bias, config)
    _, src = _kernels()
    return _launch(src.tuned_24, src.int4_24_kernel, x, (values, meta), n, k, scales, bias,
                   config)


def bound_bytes(m: int, n: int, k: int, group_size: int, sparse: bool,
                scale_bytes: int = 4) -> int:
    """Bytes a decode GEMM must move at least: the packed weight (values, 2:4 metadata, scales),
    bf16 x in and y out (bias ignored)."""
    weight = n * k // 4 + n * k // 8 if sparse else n * k // 2
    return weight + n * (k // group_size) * scale_bytes + m * k * 2 + m * n * 2


__all__ = ["GROUP_SIZE", "K_MULTIPLE", "MAX_M", "QMAX", "QMIN", "ROWS_MAX_M", "SCALE_DTYPES",
           "bound_bytes", "check_shape", "dequantize", "dequantize_packed",
           "dequantize_packed_24", "launch", "launch_24", "pack", "pack_24", "pack_nibbles",
           "positions", "reference", "reference_24", "rows_fit", "unpack", "unpack_24",
           "unpack_nibbles", "widen_24", "x_planes", "x_planes_24"]
