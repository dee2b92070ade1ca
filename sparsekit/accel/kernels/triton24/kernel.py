"""The Triton source of :mod:`sparsekit.accel.kernels.triton24.format`'s decode kernel
(imported only when the
kernel runs: on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``).

Every tile is loaded as contiguous vectors and never reshaped: a row's first kept values, its
second kept values and x's four position planes (x[:, 4g + p] for p = 0..3) are each contiguous
along the group index g, and the metadata is laid out in slabs: word ``w`` of a row holds in
its nibble ``s`` the code of group ``s * W + w`` (W = K / 32 words per row). One step loads
BLOCK_W words of a row block and walks the 8 slabs: slab ``s`` takes nibble ``s`` of every
loaded word and the (BLOCK_N, BLOCK_W) tiles of the two kept values of groups ``s * W + w``.

Three ways to multiply (``MODE``): 0, on CUDA cores, each kept value times the x it selects by
its position (M <= 2); 1, on CUDA cores, each position's weight plane times x's plane
(2 <= M <= 8); 2, on tensor cores, W's position planes times x's (``tl.dot``, weights as the
left operand: y.T = W @ x.T, M >= 2 padded to 16 or 32; fp8 planes and x natively when a step
is 32 groups deep). The products accumulate in float32, element-wise
across the steps and summed once at the end on CUDA cores.

A decode GEMM is bound by the bytes of the weight, and one row block alone cannot keep enough
loads in flight: the words of a row are split over ``SPLIT_K`` programs (grid axis 1). Each
writes its float32 partial sums to a workspace and counts itself in on a per-tile counter; the
last one to arrive adds the partials, applies scales and bias, stores the bfloat16 output and
sets the counter back to zero, so that the counters are zero between launches."""

import triton
import triton.language as tl

SELECT, PLANES, DOT = 0, 1, 2


def configs() -> list:
    """The autotuner's space: (MODE, BLOCK_N, BLOCK_W, SPLIT_K, warps, stages). Kept: the
    configs that came in the first three of a shape in ``tools/bench_generate.py --sections
    configs --explore`` (Llama-3-8B shapes, M = 1, 4, 16, 32, H100): one row on CUDA cores
    (SELECT), and from two rows the tensor cores with two stages (Triton copies each step's
    values, metadata and x into shared memory asynchronously while the previous step
    multiplies). PLANES, unstaged, three-stage and eight-warp tensor-core configs never did;
    each config costs a compile per M bucket on a layer's first call. The PLANES mode stays
    for CPU reference runs and fixed configs."""
    out = []
    for mode, bn, bw, split, warps, stages in (
            (SELECT, 16, 32, 4, 4, 1), (SELECT, 16, 64, 2, 4, 1), (SELECT, 32, 32, 4, 4, 1),
            (SELECT, 32, 64, 1, 4, 1), (SELECT, 32, 64, 2, 8, 1), (SELECT, 8, 64, 4, 4, 1),
            (DOT, 64, 32, 1, 4, 2), (DOT, 64, 32, 2, 4, 2), (DOT, 64, 32, 4, 4, 2),
            (DOT, 64, 16, 2, 4, 2), (DOT, 64, 16, 4, 4, 2),
            # K = 512 (16 words a row) takes only these
            (SELECT, 16, 16, 1, 4, 1), (PLANES, 16, 16, 1, 4, 1), (DOT, 32, 16, 1, 4, 1)):
        out.append(triton.Config({"MODE": mode, "BLOCK_N": bn, "BLOCK_W": bw,
                                  "SPLIT_K": split}, num_warps=warps, num_stages=stages))
    return out


SHARED_BYTES = 160 * 1024  # the staged weight tiles a config may keep in shared memory


def fits(config_kwargs: dict, m: int, k: int, fp8: bool = False, stages: int = 1) -> bool:
    """Whether a config suits (M, K): whole BLOCK_W word blocks, at least one per split, its
    MODE for M (SELECT up to 2 rows, PLANES 2 to 8, DOT from 2, x padded to 16 rows;
    tensor-core steps at least 16 columns deep), and with ``stages`` > 1 its staged values and
    metadata within SHARED_BYTES."""
    words = k // 32
    bn, bw = config_kwargs["BLOCK_N"], config_kwargs["BLOCK_W"]
    split, mode = config_kwargs.get("SPLIT_K", 1), config_kwargs.get("MODE", DOT)
    if words % bw or words // bw < split:
        return False
    if stages > 1 and (16 * bn * bw * (1 if fp8 else 2) + 4 * bn * bw) * stages > SHARED_BYTES:
        return False
    return {SELECT: m <= 2, PLANES: 2 <= m <= 8, DOT: m >= 2 and bw >= 16}[mode]


def _prune(configs_, named_args, **kwargs):
    fp8 = named_args["v_ptr"].element_size() == 1
    return [c for c in configs_
            if fits(c.kwargs, named_args["M"], named_args["K"], fp8, c.num_stages)]


@triton.jit
def tile(axis: tl.constexpr, BLOCK: tl.constexpr, limit):
    """This program's indices along grid ``axis`` (BLOCK of them) and which are < ``limit``."""
    r = tl.program_id(axis) * BLOCK + tl.arange(0, BLOCK)
    return r, r < limit


@triton.jit
def store_bf16(acc, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, HAS_BIAS: tl.constexpr):
    """y[rm, rn] = acc (+ bias[rn]) in bfloat16, y (M, N) row-major."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _epilogue(acc, xs_ptr, ws_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_xs,
              HAS_XS: tl.constexpr, HAS_WS: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_XS:
        acc *= tl.load(xs_ptr + rm * stride_xs, mask=m_ok, other=0.0)[:, None]
    if HAS_WS:
        acc *= tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    store_bf16(acc, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, HAS_BIAS)


@triton.jit
def _plane(v0, v1, code, p: tl.constexpr):
    """The weight at position ``p`` of each group: v0 where the first kept position is p, v1
    where the second is, else 0 (code = i0 | i1 << 2, i0 < i1)."""
    zero = tl.zeros(v0.shape, dtype=v0.dtype)
    if p == 0:
        return tl.where((code & 3) == 0, v0, zero)
    elif p == 3:
        return tl.where((code >> 2) == 3, v1, zero)
    else:
        return tl.where((code & 3) == p, v0, tl.where((code >> 2) == p, v1, zero))


@triton.jit
def _x_plane(x_ptr, rm, m_ok, stride_xm, Q, g, p: tl.constexpr):
    """x's position plane ``p`` at groups ``g``: (BLOCK_M, BLOCK_W)."""
    return tl.load(x_ptr + rm[:, None] * stride_xm + p * Q + g[None, :], mask=m_ok[:, None],
                   other=0.0)


@triton.jit
def _x_plane_t(x_ptr, rm, m_ok, stride_xm, Q, g, p: tl.constexpr):
    """x's position plane ``p`` at groups ``g``, transposed: (BLOCK_W, BLOCK_M)."""
    return tl.load(x_ptr + rm[None, :] * stride_xm + p * Q + g[:, None], mask=m_ok[None, :],
                   other=0.0)


@triton.jit
def _step(acc, v0, v1, code, x_ptr, rm, m_ok, stride_xm, Q, g, MODE: tl.constexpr,
          DOT_F32: tl.constexpr):
    """acc + the products of one slab step."""
    if MODE == 2:  # tensor cores: acc (BLOCK_N, BLOCK_M) += plane_p @ x_p.T
        # fp8 planes and x go to the tensor cores as they are (e4m3 x e4m3, float32 sums) in
        # steps 32 deep; a shallower step takes them as float16 (exact); fp8 planes with bf16
        # x (a weight-only layer) are widened to bf16 (exact)
        XT: tl.constexpr = x_ptr.dtype.element_ty
        DT: tl.constexpr = tl.float32 if DOT_F32 else (XT if XT != v0.dtype else (
            tl.float16 if v0.dtype == tl.float8e4nv and v0.shape[1] < 32 else v0.dtype))
        v0 = v0.to(DT)
        v1 = v1.to(DT)
        for p in tl.static_range(4):
            xp = _x_plane_t(x_ptr, rm, m_ok, stride_xm, Q, g, p).to(DT)
            acc += tl.dot(_plane(v0, v1, code, p), xp)
    elif MODE == 1:  # CUDA cores, planes: acc (BLOCK_M, BLOCK_N, BLOCK_W)
        for p in tl.static_range(4):
            xp = _x_plane(x_ptr, rm, m_ok, stride_xm, Q, g, p).to(tl.float32)
            wp = _plane(v0, v1, code, p).to(tl.float32)
            acc += wp[None, :, :] * xp[:, None, :]
    elif MODE == 3:  # SELECT for one row: acc (BLOCK_N, BLOCK_W), x's planes as vectors
        row = x_ptr + tl.program_id(2) * stride_xm
        x0 = tl.load(row + g).to(tl.float32)[None, :]
        x1 = tl.load(row + Q + g).to(tl.float32)[None, :]
        x2 = tl.load(row + 2 * Q + g).to(tl.float32)[None, :]
        x3 = tl.load(row + 3 * Q + g).to(tl.float32)[None, :]
        xa = tl.where((code & 2) != 0, x2, tl.where((code & 1) != 0, x1, x0))
        xb = tl.where((code & 8) != 0, tl.where((code & 4) != 0, x3, x2), x1)
        acc += v0.to(tl.float32) * xa + v1.to(tl.float32) * xb
    else:  # CUDA cores, each kept value times its x: acc (BLOCK_M, BLOCK_N, BLOCK_W)
        x0 = _x_plane(x_ptr, rm, m_ok, stride_xm, Q, g, 0).to(tl.float32)[:, None, :]
        x1 = _x_plane(x_ptr, rm, m_ok, stride_xm, Q, g, 1).to(tl.float32)[:, None, :]
        x2 = _x_plane(x_ptr, rm, m_ok, stride_xm, Q, g, 2).to(tl.float32)[:, None, :]
        x3 = _x_plane(x_ptr, rm, m_ok, stride_xm, Q, g, 3).to(tl.float32)[:, None, :]
        c = code[None, :, :]
        # i0 in {0, 1, 2} (bits 0-1), i1 in {1, 2, 3} (bits 2-3)
        xa = tl.where((c & 2) != 0, x2, tl.where((c & 1) != 0, x1, x0))
        xb = tl.where((c & 8) != 0, tl.where((c & 4) != 0, x3, x2), x1)
        acc += v0.to(tl.float32)[None, :, :] * xa + v1.to(tl.float32)[None, :, :] * xb
    return acc


@triton.jit
def _reduce_splits(out, part_ptr, cnt_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, M,
                   N, stride_xs, HAS_XS: tl.constexpr, HAS_WS: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Write this split's partial sums; the tile's last split to arrive adds them all, stores
    the output and sets the tile's counter back to zero."""
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(part_ptr + (tl.program_id(1) * M + rm[:, None]) * N + rn[None, :], out, mask=ok)
    tl.debug_barrier()  # every thread's partial is written before the count
    tile_id = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        tl.debug_barrier()
        total = tl.zeros(out.shape, dtype=tl.float32)
        for j in tl.static_range(SPLIT_K):
            total += tl.load(part_ptr + (j * M + rm[:, None]) * N + rn[None, :], mask=ok,
                             other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")
        _epilogue(total, xs_ptr, ws_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_xs,
                  HAS_XS, HAS_WS, HAS_BIAS)


@triton.jit
def sk24_kernel(x_ptr, v_ptr, m_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
                M, N, K, stride_xm, stride_xs, M_BUCKET,
                HAS_XS: tl.constexpr, HAS_WS: tl.constexpr, HAS_BIAS: tl.constexpr,
                DOT_F32: tl.constexpr, SMALL_M: tl.constexpr, DOT_M: tl.constexpr,
                MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                SPLIT_K: tl.constexpr):
    BLOCK_M: tl.constexpr = DOT_M if MODE == 2 else SMALL_M
    HOW: tl.constexpr = 3 if (MODE == 0 and SMALL_M == 1) else MODE  # 3: SELECT, one row
    rn, n_ok = tile(0, BLOCK_N, N)
    rm, m_ok = tile(2, BLOCK_M, M)
    # K is a multiple of 512 (sk24.K_MULTIPLE): said so, every tile's address is 16-byte
    # aligned and its loads are vectors (Triton knows only that K is a multiple of 16)
    W = tl.multiple_of(K // 32, 16)
    Q = tl.multiple_of(K // 4, 128)
    blocks = W // BLOCK_W
    per_split = tl.cdiv(blocks, SPLIT_K) * BLOCK_W
    w_lo = tl.program_id(1) * per_split
    w_hi = tl.minimum(w_lo + per_split, W)
    rw = tl.arange(0, BLOCK_W)
    row_v = v_ptr + rn[:, None].to(tl.int64) * tl.multiple_of(K // 2, 256)
    row_m = m_ptr + rn[:, None].to(tl.int64) * W
    if HOW == 2:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif HOW == 3:
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        w0 = tl.multiple_of(w0, BLOCK_W)
        mw = tl.load(row_m + w0 + rw[None, :], mask=n_ok[:, None], other=0)
        for s in tl.static_range(8):
            g = s * W + w0 + rw  # the groups of this slab step
            v0 = tl.load(row_v + g[None, :], mask=n_ok[:, None], other=0.0)
            v1 = tl.load(row_v + Q + g[None, :], mask=n_ok[:, None], other=0.0)
            code = (mw >> (4 * s)) & 0xF
            acc = _step(acc, v0, v1, code, x_ptr, rm, m_ok, stride_xm, Q, g, HOW, DOT_F32)
    if HOW == 2:
        out = tl.trans(acc)
    elif HOW == 3:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    if SPLIT_K == 1:
        _epilogue(out, xs_ptr, ws_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_xs,
                  HAS_XS, HAS_WS, HAS_BIAS)
    else:
        _reduce_splits(out, part_ptr, cnt_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok,
                       M, N, stride_xs, HAS_XS, HAS_WS, HAS_BIAS, SPLIT_K)

tuned = triton.autotune(configs=configs(), key=["M_BUCKET", "N", "K", "HAS_XS"],
                        prune_configs_by={"early_config_prune": _prune})(sk24_kernel)


@triton.jit
def store_groups(w_ptr, rows, N, K, v0, v1, i0, i1, BLOCK_N: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """Store (BLOCK_N, BLOCK_G) groups of 4 columns of a dense (N, K) weight, the program's
    (axis 1) block of groups: each group's columns from its two kept values ``v0``, ``v1``
    (the weight's dtype) at positions ``i0`` < ``i1``, zeros elsewhere, the four columns
    joined along a last axis so that the stores are contiguous."""
    zero = tl.zeros_like(v0)
    c0 = tl.where(i0 == 0, v0, zero)  # i0 < i1: position 0 can only be the first kept one
    c1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, zero))
    c2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
    c3 = tl.where(i1 == 3, v1, zero)  # ... and position 3 only the second
    # join's new axis is the last: [a, b] of join(join(c0, c2), join(c1, c3)) is c_(2a + b)
    cols = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_N, 4 * BLOCK_G))
    c = tl.program_id(1) * 4 * BLOCK_G + tl.arange(0, 4 * BLOCK_G)[None, :]
    tl.store(w_ptr + rows * K + c, cols, mask=(rows < N) & (c < K))


@triton.jit
def widen_kernel(v_ptr, m_ptr, w_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """The dense bf16 weight (N, K) from the format in one pass
    (:func:`sparsekit.accel.kernels.triton24.format.
    widen`): program (i, j) takes rows ``i * BLOCK_N ..`` and groups ``j * BLOCK_G ..``."""
    G = K // 4
    W = K // 32
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)[None, :]
    ok = (rows < N) & (g < G)
    word = tl.load(m_ptr + rows * W + g % W, mask=ok, other=0)
    code = (word >> (4 * (g // W))) & 0xF
    v0 = tl.load(v_ptr + rows * (K // 2) + g, mask=ok).to(tl.bfloat16)  # (masked: unstored)
    v1 = tl.load(v_ptr + rows * (K // 2) + G + g, mask=ok).to(tl.bfloat16)
    store_groups(w_ptr, rows, N, K, v0, v1, code & 3, code >> 2, BLOCK_N, BLOCK_G)
