"""The Triton source of :mod:`sparsekit.accel.kernels.int4.format`'s kernels (imported only
when a kernel
runs: on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``).

Two families: the word-tile kernels of M <= 4 (``int4_24_rows_kernel``, ``int4_rows_kernel``,
at the end of this file and described there) and the tile kernels (``int4_24_kernel``,
``int4_kernel``) for M > 4 and for quantization groups smaller than one 16-byte vector of a row.

Tile kernels: row strides are arguments (not derived from K in the kernel) so that Triton sees
them divisible by 16 and loads the packed bytes in wide vectors rather than one byte at a time.
Both walk K in tiles of ``BLOCK_K`` columns for a ``BLOCK_M x BLOCK_N`` output tile.
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

from sparsekit.accel.kernels.triton24.kernel import store_bf16, store_groups, tile

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
def _positions(code):
    """The kept positions (i0, i1) of codes ``P | Q << 1 | R << 2`` (the format's)."""
    q = (code & 2) != 0
    i0 = tl.where((code & 1) != 0, 0, tl.where(q, 1, 2))
    i1 = tl.where((code & 4) != 0, 3, tl.where(q, 2, 1))
    return i0, i1


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
        i0, i1 = _positions(code)
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


# --- M <= 4 on CUDA cores: 2-D word tiles, split-K ---------------------------------------------
# (docs/int4-kernels.md; tools/probe_int4_sass.py counts their instructions per byte.) A row is
# read as whole words, (BLOCK_N, SW) tiles of 16-byte vectors (8-byte words of a 2:4 row: one
# metadata word's 8 groups; 4-byte words of a dense row), never reshaped. A nibble at bits
# 4j..4j+3 (j <= 4) of a word becomes ``q * 16**j`` with one AND-OR and one add
# (``n << 4j | 0x4B000000`` is the float ``2**23 + n * 16**j``, exact); x comes in as float32
# planes (made by torch ops before the launch: w4a16.x_planes_24, w4a16.x_planes) that carry
# the matching ``16**-j``, so the products need no rescaling. An iteration (U vectors) lies
# inside one quantization group: its products are scaled once. K is split over SPLIT_K
# programs, summed by the last to arrive (as sk24_triton's kernel).
SW_24, SW_DENSE = 2, 4  # words per row in one 16-byte vector: int64 (2:4), int32 (dense)


def row_configs() -> list:
    """The autotuner's space of the M <= 4 kernels: (BLOCK_N, U, SPLIT_K, warps), rows per
    thread ``BLOCK_N / (32 * warps)`` 1, 2 or 4 (more share x's loads and selects' tests, but
    take registers). A decode GEMM keeps the GPU busy by splitting K: per thread a few vectors
    per row, many programs."""
    out = []
    for bn, u, split, warps in ((128, 1, 8, 1), (128, 1, 16, 1), (128, 2, 4, 1), (128, 2, 8, 1),
                                (256, 1, 8, 2), (256, 2, 4, 2), (64, 1, 8, 1), (64, 1, 16, 1),
                                (64, 2, 8, 1), (128, 1, 8, 2), (128, 2, 4, 2), (256, 1, 4, 4),
                                (32, 1, 16, 1), (32, 2, 8, 1), (32, 4, 4, 1), (32, 4, 8, 1),
                                (64, 1, 4, 2), (128, 1, 2, 4)):
        out.append(triton.Config({"BLOCK_N": bn, "U": u, "SPLIT_K": split}, num_warps=warps,
                                 num_stages=2))
    return out


def row_fits(k: int, group: int, sparse: bool, u: int, split: int) -> bool:
    """Whether an iteration of ``u`` vectors (``u * SW`` words) lies inside one quantization
    group and K has at least ``split`` such iterations."""
    span = u * (SW_24 * 32 if sparse else SW_DENSE * 8)
    return group % span == 0 and k // span >= split


def _row_prune(sparse: bool):
    def prune(configs_, named_args, **kwargs):
        k, group = named_args["K"], named_args["GROUP"]
        kept = [c for c in configs_
                if row_fits(k, group, sparse, c.kwargs["U"], c.kwargs["SPLIT_K"])]
        return kept or [triton.Config({"BLOCK_N": 32, "U": 1, "SPLIT_K": 1}, num_warps=1)]
    return prune


@triton.jit
def _q(w, j: tl.constexpr, magic):
    """Nibble j (0..4) of w's low 20 bits as the float ``(n - 8) * 16**j`` (exact); ``magic``
    is 0x4B000000, an argument so that it sits in a register and the AND and the OR are one
    instruction (LOP3 takes one immediate)."""
    f = ((w & (0xF << (4 * j))) | magic).to(tl.float32, bitcast=True)
    if j == 0:
        return f - 8388616.0
    elif j == 1:
        return f - 8388736.0
    elif j == 2:
        return f - 8390656.0
    elif j == 3:
        return f - 8421376.0
    else:
        return f - 8912896.0


@triton.jit
def _sel_fma(pa, pb, v0, v1, cp, cq, cr, xw, s: tl.constexpr, rw):
    """pa + v0 * x[i0], pb + v1 * x[i1] for group ``s`` of this step's words, one x row
    (``xw``: its block of planes), from the code's bits P, Q, R. x's four positions of the
    group in both words are one 32-byte load, split in registers (no layout conversion)."""
    rp = tl.arange(0, 4)
    xs = tl.load(xw + s * 8 + rw[:, None] * 4 + rp[None, :])  # (word, position)
    xe, xo = tl.split(tl.reshape(xs, (2, 2, 2)))  # positions 0, 2 and 1, 3
    x0, x2 = tl.split(xe)
    x1, x3 = tl.split(xo)
    x0 = x0[None, :]
    x1 = x1[None, :]
    x2 = x2[None, :]
    x3 = x3[None, :]
    pa += v0 * tl.where(cp, x0, tl.where(cq, x1, x2))
    pb += v1 * tl.where(cr, x3, tl.where(cq, x2, x1))
    return pa, pb


@triton.jit
def _row_part(part_ptr, out, j, M, N, rm, rn, n_ok):
    tl.store(part_ptr + (j * M + rm) * N + rn, out, mask=n_ok & (rm < M))


@triton.jit
def _row_out(acc, part_ptr, b_ptr, y_ptr, M, N, rm, rn, n_ok, HAS_BIAS: tl.constexpr,
             SPLIT_K: tl.constexpr, FROM_PARTS: tl.constexpr):
    """Store y[rm, rn]: ``acc`` (SPLIT_K 1) or the sum of the split partials (+ bias)."""
    if FROM_PARTS:
        acc = tl.zeros_like(acc)
        for j in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + (j * M + rm) * N + rn, mask=n_ok, other=0.0,
                           cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm * N + rn, acc.to(tl.bfloat16), mask=n_ok & (rm < M))


@triton.jit
def _finish(o0, o1, o2, o3, part_ptr, cnt_ptr, b_ptr, y_ptr, M, N, rm0, rn, n_ok,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """The outputs of rows rm0 .. rm0 + BLOCK_M - 1 (o0..o3, each (BLOCK_N,)): stored, or with
    SPLIT_K > 1 written as partials and summed by the last program of the tile to arrive (it
    sets the tile's counter back to zero)."""
    if SPLIT_K == 1:
        _row_out(o0, part_ptr, b_ptr, y_ptr, M, N, rm0, rn, n_ok, HAS_BIAS, 1, False)
        if BLOCK_M > 1:
            _row_out(o1, part_ptr, b_ptr, y_ptr, M, N, rm0 + 1, rn, n_ok, HAS_BIAS, 1, False)
        if BLOCK_M > 2:
            _row_out(o2, part_ptr, b_ptr, y_ptr, M, N, rm0 + 2, rn, n_ok, HAS_BIAS, 1, False)
            _row_out(o3, part_ptr, b_ptr, y_ptr, M, N, rm0 + 3, rn, n_ok, HAS_BIAS, 1, False)
    else:
        j = tl.program_id(1)
        _row_part(part_ptr, o0, j, M, N, rm0, rn, n_ok)
        if BLOCK_M > 1:
            _row_part(part_ptr, o1, j, M, N, rm0 + 1, rn, n_ok)
        if BLOCK_M > 2:
            _row_part(part_ptr, o2, j, M, N, rm0 + 2, rn, n_ok)
            _row_part(part_ptr, o3, j, M, N, rm0 + 3, rn, n_ok)
        tl.debug_barrier()  # every thread's partial is written before the count
        tile_id = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            _row_out(o0, part_ptr, b_ptr, y_ptr, M, N, rm0, rn, n_ok, HAS_BIAS, SPLIT_K, True)
            if BLOCK_M > 1:
                _row_out(o1, part_ptr, b_ptr, y_ptr, M, N, rm0 + 1, rn, n_ok, HAS_BIAS,
                         SPLIT_K, True)
            if BLOCK_M > 2:
                _row_out(o2, part_ptr, b_ptr, y_ptr, M, N, rm0 + 2, rn, n_ok, HAS_BIAS,
                         SPLIT_K, True)
                _row_out(o3, part_ptr, b_ptr, y_ptr, M, N, rm0 + 3, rn, n_ok, HAS_BIAS,
                         SPLIT_K, True)
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def _split_range(n_words, SPAN: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's words [lo, hi) of a row: whole iterations of SPAN words."""
    per_split = tl.cdiv(n_words // SPAN, SPLIT_K) * SPAN
    lo = tl.program_id(1) * per_split
    return lo, tl.minimum(lo + per_split, n_words)


@triton.jit
def _word24(a0, b0, a1, b1, a2, b2, a3, b3, vw, mw, xw, x_row, rw, MAGIC,
            BLOCK_M: tl.constexpr):
    """The products of one step's words: values ``vw`` (int64), metadata ``mw``, x rows at
    ``xw + m * x_row`` (a_m, b_m: the first and second kept values' sums of row m)."""
    for h in tl.static_range(2):  # the word's 32-bit halves: groups 4h .. 4h + 3
        half = (vw >> (32 * h)).to(tl.int32) if h == 1 else vw.to(tl.int32)
        for t in tl.static_range(4):
            # group 4h + t's kept values at nibbles 2t, 2t + 1; bits 16.. shifted to 4..
            # (nibble j at bits 4j .. 4j + 3, j <= 4), x carries 16**-j of v0's j
            src = half >> 12 if t >= 2 else half
            v0 = _q(src, 2 * t - 3 * (t // 2), MAGIC)  # j = 0, 2, 1, 3
            v1 = _q(src, 2 * t - 3 * (t // 2) + 1, MAGIC)
            cp = (mw & (1 << (16 * h + 4 * t))) != 0  # group 4h + t's P, Q, R
            cq = (mw & (2 << (16 * h + 4 * t))) != 0
            cr = (mw & (4 << (16 * h + 4 * t))) != 0
            a0, b0 = _sel_fma(a0, b0, v0, v1, cp, cq, cr, xw, 4 * h + t, rw)
            if BLOCK_M > 1:
                a1, b1 = _sel_fma(a1, b1, v0, v1, cp, cq, cr, xw + x_row, 4 * h + t, rw)
            if BLOCK_M > 2:
                a2, b2 = _sel_fma(a2, b2, v0, v1, cp, cq, cr, xw + 2 * x_row, 4 * h + t, rw)
                a3, b3 = _sel_fma(a3, b3, v0, v1, cp, cq, cr, xw + 3 * x_row, 4 * h + t, rw)
    return a0, b0, a1, b1, a2, b2, a3, b3


@triton.jit
def int4_24_rows_kernel(x_ptr, v_ptr, m_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K,
                        stride_s, M_BUCKET, MAGIC, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, SPARSE: tl.constexpr, BLOCK_N: tl.constexpr,
                        U: tl.constexpr, SPLIT_K: tl.constexpr):
    """2:4, M <= 4: ``v_ptr`` the values as int64 words (N, K/32) (word w: groups 8w..8w+7,
    one byte each, as the metadata word w), x as
    :func:`~sparsekit.accel.kernels.int4.format.x_planes_24`
    (M, K/64, 8, 2, 4) float32; ``MAGIC`` 0x4B000000."""
    rn, n_ok = tile(0, BLOCK_N, N)
    rm0 = tl.program_id(2) * BLOCK_M
    W = tl.multiple_of(K // 32, 2)  # K is a multiple of 64
    SPAN: tl.constexpr = U * 2
    lo, hi = _split_range(W, SPAN, SPLIT_K)
    rw = tl.arange(0, 2)
    row_v = v_ptr + rn[:, None].to(tl.int64) * W
    row_m = m_ptr + rn[:, None].to(tl.int64) * W
    row_s = s_ptr + rn.to(tl.int64) * stride_s
    xr0 = x_ptr + rm0 * 32 * W  # x's planes (rows padded to BLOCK_M: no masks)
    acc0 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
    for w0 in range(lo, hi, SPAN):
        w0 = tl.multiple_of(w0, SPAN)
        a0 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)  # products of first kept values
        b0 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)  # of second ones (times 1/16)
        a1 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
        b1 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
        b2 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
        b3 = tl.zeros((BLOCK_N, 2), dtype=tl.float32)
        for i in tl.static_range(U):
            u = w0 + 2 * i + rw
            xo = (w0 + 2 * i) * 32  # the step's block of x's planes
            vw = tl.load(row_v + u[None, :], mask=n_ok[:, None], other=0)
            mw = tl.load(row_m + u[None, :], mask=n_ok[:, None], other=0)
            a0, b0, a1, b1, a2, b2, a3, b3 = _word24(a0, b0, a1, b1, a2, b2, a3, b3, vw, mw,
                                                     xr0 + xo, 32 * W, rw, MAGIC, BLOCK_M)
        sc = tl.load(row_s + (w0 * 32) // GROUP, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        acc0 += (a0 + b0 * 0.0625) * sc
        if BLOCK_M > 1:
            acc1 += (a1 + b1 * 0.0625) * sc
        if BLOCK_M > 2:
            acc2 += (a2 + b2 * 0.0625) * sc
            acc3 += (a3 + b3 * 0.0625) * sc
    _finish(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1),
            tl.sum(acc3, axis=1), part_ptr, cnt_ptr, b_ptr, y_ptr, M, N, rm0, rn, n_ok,
            HAS_BIAS, BLOCK_M, SPLIT_K)


@triton.jit
def _dense_fma(p, w, xw, rw, magic):
    """p + the products of the int32 words ``w`` (8 nibbles: columns 8u .. 8u + 7) with x's
    planes (``xw``: this step's block; plane j carries 16**-j, 16**-(j - 3) from j = 4)."""
    hi = w >> 12  # nibbles 4..7 at bits 4..19
    for j in tl.static_range(8):
        xj = tl.load(xw + j * 4 + rw)[None, :]
        if j < 4:
            p += _q(w, j, magic) * xj
        else:
            p += _q(hi, j - 3, magic) * xj
    return p


@triton.jit
def int4_rows_kernel(x_ptr, v_ptr, m_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K,
                     stride_s, M_BUCKET, MAGIC, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, SPARSE: tl.constexpr, BLOCK_N: tl.constexpr,
                     U: tl.constexpr, SPLIT_K: tl.constexpr):
    """Dense, M <= 4: ``v_ptr`` the values as int32 words (N, K/8), x as
    :func:`~sparsekit.accel.kernels.int4.format.x_planes` (M, K/32, 8, 4) float32; ``m_ptr`` unused;
    ``MAGIC`` 0x4B000000."""
    rn, n_ok = tile(0, BLOCK_N, N)
    rm0 = tl.program_id(2) * BLOCK_M
    WD = tl.multiple_of(K // 8, 8)  # K is a multiple of 64
    SPAN: tl.constexpr = U * 4
    lo, hi = _split_range(WD, SPAN, SPLIT_K)
    rw = tl.arange(0, 4)
    row_v = v_ptr + rn[:, None].to(tl.int64) * WD
    row_s = s_ptr + rn.to(tl.int64) * stride_s
    xr0 = x_ptr + rm0 * 8 * WD
    acc0 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
    for w0 in range(lo, hi, SPAN):
        w0 = tl.multiple_of(w0, SPAN)
        p0 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
        p1 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
        p3 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
        for i in tl.static_range(U):
            u = w0 + 4 * i + rw
            w = tl.load(row_v + u[None, :], mask=n_ok[:, None], other=0)
            xw = xr0 + (w0 + 4 * i) * 8  # the step's block of x's planes
            p0 = _dense_fma(p0, w, xw, rw, MAGIC)  # x's rows padded to BLOCK_M: no masks
            if BLOCK_M > 1:
                p1 = _dense_fma(p1, w, xw + 8 * WD, rw, MAGIC)
            if BLOCK_M > 2:
                p2 = _dense_fma(p2, w, xw + 16 * WD, rw, MAGIC)
                p3 = _dense_fma(p3, w, xw + 24 * WD, rw, MAGIC)
        sc = tl.load(row_s + (w0 * 8) // GROUP, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        acc0 += p0 * sc
        if BLOCK_M > 1:
            acc1 += p1 * sc
        if BLOCK_M > 2:
            acc2 += p2 * sc
            acc3 += p3 * sc
    _finish(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1),
            tl.sum(acc3, axis=1), part_ptr, cnt_ptr, b_ptr, y_ptr, M, N, rm0, rn, n_ok,
            HAS_BIAS, BLOCK_M, SPLIT_K)


_ROW_KEY = ["M_BUCKET", "N", "K", "GROUP"]
tuned_24_rows = triton.autotune(configs=row_configs(), key=_ROW_KEY,
                                prune_configs_by={"early_config_prune": _row_prune(True)}
                                )(int4_24_rows_kernel)
tuned_rows = triton.autotune(configs=row_configs(), key=_ROW_KEY,
                             prune_configs_by={"early_config_prune": _row_prune(False)}
                             )(int4_rows_kernel)


@triton.jit
def _bf16_rne(v):
    """float32 (finite) to bfloat16, rounded to nearest even by integer ops: as torch's
    ``.to(torch.bfloat16)`` on every backend (Triton's interpreter truncates a plain cast)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def widen_24_kernel(v_ptr, m_ptr, s_ptr, w_ptr, N, K, GROUPS, BLOCK_N: tl.constexpr,
                    BLOCK_G: tl.constexpr):
    """The 2:4 format's weight ``q * scale`` (N, K) in bfloat16 (float32 products, as
    :func:`sparsekit.accel.kernels.int4.format.dequantize_packed_24`) in one pass: program (i, j)
    takes rows
    ``i * BLOCK_N ..`` and groups of 4 ``j * BLOCK_G ..``; each group's kept positions from
    the metadata's P, Q, R bits."""
    G = K // 4
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)[None, :]
    ok = (rows < N) & (g < G)
    byte = tl.load(v_ptr + rows * G + g, mask=ok, other=0).to(tl.int32)
    word = tl.load(m_ptr + rows * (K // 32) + g // 8, mask=ok, other=0)
    code = (word >> (4 * (g % 8))) & 0xF
    p, q, r = code & 1, (code >> 1) & 1, (code >> 2) & 1
    i0 = tl.where(p == 1, 0, tl.where(q == 1, 1, 2))
    i1 = tl.where(r == 1, 3, tl.where(q == 1, 2, 1))
    scale = tl.load(s_ptr + rows * GROUPS + (4 * g) // (K // GROUPS), mask=ok,
                    other=0).to(tl.float32)
    v0 = ((byte & 0xF) - 8).to(tl.float32) * scale
    v1 = ((byte >> 4) - 8).to(tl.float32) * scale
    # rounded first: the zeros the selection puts between them round to themselves
    store_groups(w_ptr, rows, N, K, _bf16_rne(v0), _bf16_rne(v1), i0, i1, BLOCK_N, BLOCK_G)
