"""The Triton source of :mod:`sparsekit.accel.w4a16`'s kernels (imported only when a kernel
runs: on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``).

Row strides are arguments (not derived from K in the kernel) so that Triton sees them divisible
by 16 and loads the packed bytes in wide vectors rather than one byte at a time. Both kernels
walk K in tiles of ``BLOCK_K`` columns for a ``BLOCK_M x BLOCK_N`` output tile.
Per tile they load the packed bytes (and the 2:4 metadata words), turn nibbles into int
values, and multiply:
- ``USE_DOT`` false (M <= 4, CUDA cores): the 2:4 kernel never builds the dense tile; it picks
  each kept value's activation (``x[4g + i]``) by the position code and does two multiply-adds
  per group of 4; the dense kernel multiplies even and odd columns by the low and high nibbles.
  Products accumulate elementwise over the K loop and are summed across threads once, at the
  end (a sum per tile cost a quarter of the loop's instructions in shuffles and adds).
- ``USE_DOT`` true: the int values (exact in bf16) are expanded into the dense weight tile and
  multiplied on tensor cores (``tl.dot``, float32 accumulation).
Group scales: on tensor cores a tile inside one group (``BLOCK_K <= GROUP``) multiplies its
partial product by the group's scale per output column; on CUDA cores, and for a tile covering
``BLOCK_K / GROUP`` whole groups, the scales multiply the values before the product.
"""

import triton
import triton.language as tl

from sparsekit.accel.sk24_triton import store_bf16, tile

K_MULTIPLE = 64


def _configs() -> list:
    out = []
    for bn, bk, warps, stages in ((16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 5),
                                  (64, 128, 4, 4), (64, 256, 8, 3), (16, 512, 4, 3),
                                  (32, 512, 8, 3), (16, 1024, 8, 3), (128, 128, 8, 3),
                                  (16, 128, 2, 6)):
        out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                                 num_stages=stages))
    return out


def fits(k: int, group: int, block_k: int) -> bool:
    """Whether a K tile of ``block_k`` columns suits K and the group size: it divides K and
    lies inside one group or covers whole groups."""
    return k % block_k == 0 and (group % block_k == 0 or block_k % group == 0)


def _prune(configs, named_args, **kwargs):
    k, group = named_args["K"], named_args["GROUP"]
    kept = [c for c in configs if fits(k, group, c.kwargs["BLOCK_K"])]
    return kept or [triton.Config({"BLOCK_N": 16, "BLOCK_K": K_MULTIPLE}, num_warps=2)]


@triton.jit
def _nibbles(b):
    """Packed bytes -> (low, high) values q in [-8, 7] as float32, with no int-to-float
    conversion (a slow instruction on GPUs): ``n | 0x4B000000`` is the float ``2**23 + n``."""
    b = b.to(tl.int32)
    lo = ((b & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return lo, hi


@triton.jit
def _group_scale(v, s, BLOCK_N: tl.constexpr, COLS: tl.constexpr, TG: tl.constexpr):
    """Values (BLOCK_N, COLS) float32 times the scales (BLOCK_N, TG) of TG equal groups."""
    v = tl.reshape(v, (BLOCK_N, TG, COLS // TG)) * s[:, :, None]
    return tl.reshape(v, (BLOCK_N, COLS))


@triton.jit
def _load_scales(s_ptr, rn, n_ok, k0, stride_s, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's scales: (BLOCK_N,) when the tile lies in one group, else (BLOCK_N, TG)."""
    if BLOCK_K <= GROUP:
        s = tl.load(s_ptr + rn.to(tl.int64) * stride_s + k0 // GROUP, mask=n_ok, other=0.0)
    else:
        rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(s_ptr + rn[:, None].to(tl.int64) * stride_s + rg[None, :],
                    mask=n_ok[:, None], other=0.0)
    return s.to(tl.float32)


@triton.jit
def _expand24(v0, v1, i0, i1, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Kept values (BLOCK_N, BLOCK_K/4) x 2 at positions i0 < i1 of each group of 4 -> the
    dense tile (BLOCK_N, BLOCK_K) in the values' dtype."""
    zero = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=v0.dtype)
    w0 = tl.where(i0 == 0, v0, zero)
    w1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, zero))
    w2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
    w3 = tl.where(i1 == 3, v1, zero)
    # join(join(w0, w2), join(w1, w3)) flattens as w0, w1, w2, w3 per group
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, BLOCK_K))


@triton.jit
def _core24(acc3, x, v0, v1, i0, i1, s, BLOCK_M: tl.constexpr, G: tl.constexpr,
            SCALE: tl.constexpr):
    """acc3 + the CUDA-core products of one tile: each kept value times its activation,
    x[4g + i0] (i0 in 0..2) and x[4g + i1] (i1 in 1..3); SCALE: the tile's one group scale."""
    xe, xo = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_M, G, 2, 2)))
    x0, x2 = tl.split(xe)
    x1, x3 = tl.split(xo)
    a0 = tl.where(i0[None, :, :] == 0, x0[:, None, :],
                  tl.where(i0[None, :, :] == 1, x1[:, None, :], x2[:, None, :]))
    a1 = tl.where(i1[None, :, :] == 3, x3[:, None, :],
                  tl.where(i1[None, :, :] == 2, x2[:, None, :], x1[:, None, :]))
    if SCALE:
        v0 = v0 * s[:, None]
        v1 = v1 * s[:, None]
    acc3 += a0 * v0[None, :, :]  # two statements: two fused multiply-adds
    acc3 += a1 * v1[None, :, :]
    return acc3


@triton.jit
def int4_24_kernel(x_ptr, v_ptr, m_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_v,
                   stride_m, stride_s, M_BUCKET,
                   GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rn, n_ok = tile(0, BLOCK_N, N)
    rm, m_ok = tile(1, BLOCK_M, M)
    G: tl.constexpr = BLOCK_K // 4  # groups of 4 per tile = packed bytes per row
    TG: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP  # groups per tile (1: inside one)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # tensor cores
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, G), dtype=tl.float32)  # CUDA cores: summed at the end
    rv = tl.arange(0, G)
    rw = tl.arange(0, BLOCK_K // 32)
    rk = tl.arange(0, BLOCK_K)
    v_ptrs = v_ptr + rn[:, None].to(tl.int64) * stride_v + rv[None, :]
    m_ptrs = m_ptr + rn[:, None].to(tl.int64) * stride_m + rw[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    shifts = tl.arange(0, 8) * 4
    for k0 in range(0, K, BLOCK_K):
        b = tl.load(v_ptrs, mask=n_ok[:, None], other=0x88)
        mw = tl.load(m_ptrs, mask=n_ok[:, None], other=0)
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        s = _load_scales(s_ptr, rn, n_ok, k0, stride_s, GROUP, BLOCK_K)
        code = tl.reshape((mw[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, G))
        i0 = code & 3
        i1 = code >> 2
        v0, v1 = _nibbles(b)
        if BLOCK_K > GROUP:
            v0 = _group_scale(v0, s, BLOCK_N, G, TG)
            v1 = _group_scale(v1, s, BLOCK_N, G, TG)
        if USE_DOT and DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly
            w = _expand24(v0, v1, i0, i1, BLOCK_N, BLOCK_K)
            part = tl.dot(x.to(tl.float32), tl.trans(w))
        elif USE_DOT:  # int values (and scaled ones, rounded) in bf16 on tensor cores
            w = _expand24(v0.to(tl.bfloat16), v1.to(tl.bfloat16), i0, i1, BLOCK_N, BLOCK_K)
            part = tl.dot(x, tl.trans(w))
        else:
            acc3 = _core24(acc3, x, v0, v1, i0, i1, s, BLOCK_M, G, BLOCK_K <= GROUP)
        if USE_DOT and BLOCK_K <= GROUP:
            acc += part * s[None, :]
        elif USE_DOT:
            acc += part
        v_ptrs += G
        m_ptrs += BLOCK_K // 32
        x_ptrs += BLOCK_K
    if not USE_DOT:  # one cross-thread reduction, after the loop
        acc = tl.sum(acc3, axis=2)
    store_bf16(acc, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, HAS_BIAS)


@triton.jit
def int4_kernel(x_ptr, v_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_v, stride_m,
                stride_s, M_BUCKET,
                GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    rn, n_ok = tile(0, BLOCK_N, N)
    rm, m_ok = tile(1, BLOCK_M, M)
    H: tl.constexpr = BLOCK_K // 2  # packed bytes per row per tile
    TG: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP  # groups per tile (1: inside one)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # tensor cores
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, H), dtype=tl.float32)  # CUDA cores: summed at the end
    rv = tl.arange(0, H)
    rk = tl.arange(0, BLOCK_K)
    v_ptrs = v_ptr + rn[:, None].to(tl.int64) * stride_v + rv[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    for k0 in range(0, K, BLOCK_K):
        b = tl.load(v_ptrs, mask=n_ok[:, None], other=0x88)
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        s = _load_scales(s_ptr, rn, n_ok, k0, stride_s, GROUP, BLOCK_K)
        lo, hi = _nibbles(b)  # columns 2j and 2j + 1
        if BLOCK_K > GROUP:
            lo = _group_scale(lo, s, BLOCK_N, H, TG)
            hi = _group_scale(hi, s, BLOCK_N, H, TG)
        if USE_DOT and DOT_F32:
            part = tl.dot(x.to(tl.float32), tl.trans(tl.reshape(tl.join(lo, hi),
                                                                (BLOCK_N, BLOCK_K))))
        elif USE_DOT:
            w = tl.reshape(tl.join(lo.to(tl.bfloat16), hi.to(tl.bfloat16)), (BLOCK_N, BLOCK_K))
            part = tl.dot(x, tl.trans(w))
        else:
            xe, xo = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_M, H, 2)))
            if BLOCK_K <= GROUP:
                lo = lo * s[:, None]
                hi = hi * s[:, None]
            acc3 += xe[:, None, :] * lo[None, :, :]  # two statements: two fused multiply-adds
            acc3 += xo[:, None, :] * hi[None, :, :]
        if USE_DOT and BLOCK_K <= GROUP:
            acc += part * s[None, :]
        elif USE_DOT:
            acc += part
        v_ptrs += H
        x_ptrs += BLOCK_K
    if not USE_DOT:  # one cross-thread reduction, after the loop
        acc = tl.sum(acc3, axis=2)
    store_bf16(acc, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, HAS_BIAS)


_KEY = ["M_BUCKET", "N", "K", "GROUP"]
tuned_24 = triton.autotune(configs=_configs(), key=_KEY,
                           prune_configs_by={"early_config_prune": _prune})(int4_24_kernel)
tuned_dense = triton.autotune(configs=_configs(), key=_KEY,
                              prune_configs_by={"early_config_prune": _prune})(int4_kernel)
