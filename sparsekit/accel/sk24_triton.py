"""The Triton source of :mod:`sparsekit.accel.sk24`'s decode kernel (imported only when the
kernel runs: on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``).

The metadata is laid out in slabs so that no register tensor is ever reshaped: word ``w`` of a
row holds in its nibble ``s`` the code of group ``s * W + w`` (W = K / 32 words per row). One
step loads BLOCK_W words of a row block and walks the 8 slabs: slab ``s`` takes nibble ``s`` of
every loaded word, the values of groups ``s * W + w`` as a (BLOCK_N, BLOCK_W, 2) tile (split
into the first and second kept value), and x at the same groups' four columns as four tiles
(one per position in the group). Small M multiplies on CUDA cores, choosing each kept value's
x by its position; larger M builds each position's weight plane and runs four ``tl.dot``s.

A decode GEMM is bound by the bytes of the weight, and one row block alone cannot keep enough
loads in flight: the words of a row are split over ``SPLIT_K`` programs (grid axis 1). Each
writes its float32 partial sums to a workspace and counts itself in on a per-tile counter; the
last one to arrive adds the partials, applies scales and bias, stores the bfloat16 output and
sets the counter back to zero, so that the counters are zero between launches."""

import triton
import triton.language as tl


def configs() -> list:
    """The autotuner's space: (BLOCK_N, BLOCK_W, USE_DOT, SPLIT_K, warps, stages)."""
    out = []
    for bn, bw, dot, split, warps, stages in (
            (16, 16, False, 1, 4, 2), (16, 16, False, 2, 4, 2), (16, 16, False, 4, 4, 2),
            (32, 16, False, 2, 4, 2), (32, 16, False, 4, 4, 2), (16, 32, False, 2, 4, 2),
            (64, 16, False, 1, 4, 2), (64, 16, False, 2, 8, 2),
            (16, 16, True, 1, 4, 2), (16, 16, True, 2, 4, 2), (16, 16, True, 4, 4, 2),
            (32, 16, True, 2, 4, 2), (32, 32, True, 2, 4, 2), (16, 32, True, 2, 4, 2),
            (32, 32, True, 1, 4, 2), (64, 32, True, 1, 4, 2), (64, 32, True, 2, 8, 2),
            (32, 32, True, 4, 4, 2)):
        out.append(triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "USE_DOT": dot,
                                  "SPLIT_K": split}, num_warps=warps, num_stages=stages))
    return out


def fits(config_kwargs: dict, m: int, k: int, fp8: bool) -> bool:
    """Whether a config suits (M, K, dtype) on the GPU: whole word blocks per split, CUDA cores
    only up to M = 4, fp8 tensor-core steps at least 32 columns deep."""
    words = k // 32
    bw, split, dot = (config_kwargs["BLOCK_W"], config_kwargs.get("SPLIT_K", 1),
                      config_kwargs["USE_DOT"])
    return (words % (bw * split) == 0 and (dot or m <= 4)
            and not (fp8 and dot and bw < 32))


def _prune(configs_, named_args, **kwargs):
    fp8 = kwargs.get("X_FP8", named_args.get("X_FP8", False))
    kept = [c for c in configs_
            if fits(c.kwargs, named_args["M"], named_args["K"], fp8)]
    return kept or [c for c in configs_ if c.kwargs.get("SPLIT_K", 1) == 1][:1]


@triton.jit
def _x_at(x_ptr, rm, m_ok, stride_xm, col, p: tl.constexpr, F32: tl.constexpr):
    """x[rm, 4 * group + p] for the groups' first columns ``col`` (BLOCK_W,)."""
    x = tl.load(x_ptr + rm[:, None] * stride_xm + col[None, :] + p, mask=m_ok[:, None],
                other=0.0)
    return x.to(tl.float32) if F32 else x


@triton.jit
def _dot_step(acc, v0, v1, i0, i1, x_ptr, rm, m_ok, stride_xm, col, DOT_F32: tl.constexpr):
    """acc + x @ W.T over one slab step on tensor cores: each position's weight plane."""
    zero = tl.zeros(v0.shape, dtype=v0.dtype)
    for p in tl.static_range(4):
        if p == 0:
            wp = tl.where(i0 == 0, v0, zero)
        elif p == 3:
            wp = tl.where(i1 == 3, v1, zero)
        else:
            wp = tl.where(i0 == p, v0, tl.where(i1 == p, v1, zero))
        xp = _x_at(x_ptr, rm, m_ok, stride_xm, col, p, DOT_F32)
        if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly
            acc += tl.dot(xp, tl.trans(wp.to(tl.float32)))
        else:
            acc += tl.dot(xp, tl.trans(wp))
    return acc


@triton.jit
def _core_step(acc, v0, v1, i0, i1, x_ptr, rm, m_ok, stride_xm, col):
    """acc + x @ W.T over one slab step on CUDA cores: each kept value times its x."""
    x0 = _x_at(x_ptr, rm, m_ok, stride_xm, col, 0, True)
    x1 = _x_at(x_ptr, rm, m_ok, stride_xm, col, 1, True)
    x2 = _x_at(x_ptr, rm, m_ok, stride_xm, col, 2, True)
    x3 = _x_at(x_ptr, rm, m_ok, stride_xm, col, 3, True)
    # (BLOCK_M, BLOCK_N, BLOCK_W): the x each kept value multiplies
    a0 = i0[None, :, :]
    a1 = i1[None, :, :]
    xa = tl.where(a0 == 0, x0[:, None, :], tl.where(a0 == 1, x1[:, None, :], x2[:, None, :]))
    xb = tl.where(a1 == 3, x3[:, None, :], tl.where(a1 == 2, x2[:, None, :], x1[:, None, :]))
    prod = v0.to(tl.float32)[None, :, :] * xa + v1.to(tl.float32)[None, :, :] * xb
    return acc + tl.sum(prod, axis=2)


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
def sk24_kernel(x_ptr, v_ptr, m_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
                M, N, K, stride_xm, stride_xs, M_BUCKET, X_FP8: tl.constexpr,
                HAS_XS: tl.constexpr, HAS_WS: tl.constexpr, HAS_BIAS: tl.constexpr,
                DOT_F32: tl.constexpr, SMALL_M: tl.constexpr, DOT_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, USE_DOT: tl.constexpr,
                SPLIT_K: tl.constexpr):
    BLOCK_M: tl.constexpr = DOT_M if USE_DOT else SMALL_M
    rn, n_ok = tile(0, BLOCK_N, N)
    rm, m_ok = tile(2, BLOCK_M, M)
    W = K // 32
    per_split = W // SPLIT_K  # whole BLOCK_W blocks (the config is pruned otherwise)
    w_lo = tl.program_id(1) * per_split
    rw = tl.arange(0, BLOCK_W)
    two = tl.arange(0, 2)
    row_v = v_ptr + rn[:, None, None].to(tl.int64) * (K // 2)
    row_m = m_ptr + rn[:, None].to(tl.int64) * W
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for w0 in range(w_lo, w_lo + per_split, BLOCK_W):
        mw = tl.load(row_m + w0 + rw[None, :], mask=n_ok[:, None], other=0)
        for s in tl.static_range(8):
            code = (mw >> (4 * s)) & 0xF
            i0 = code & 3
            i1 = code >> 2
            g = s * W + w0 + rw  # the groups of this slab step
            v = tl.load(row_v + 2 * g[None, :, None] + two[None, None, :],
                        mask=n_ok[:, None, None], other=0.0)
            v0, v1 = tl.split(v)
            col = 4 * g
            if USE_DOT:
                acc = _dot_step(acc, v0, v1, i0, i1, x_ptr, rm, m_ok, stride_xm, col, DOT_F32)
            else:
                acc = _core_step(acc, v0, v1, i0, i1, x_ptr, rm, m_ok, stride_xm, col)
    if SPLIT_K == 1:
        _epilogue(acc, xs_ptr, ws_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_xs,
                  HAS_XS, HAS_WS, HAS_BIAS)
    else:
        ok = m_ok[:, None] & n_ok[None, :]
        tl.store(part_ptr + (tl.program_id(1) * M + rm[:, None]) * N + rn[None, :], acc,
                 mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the count
        tile_id = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of the tile's splits: reduce and store
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + (j * M + rm[:, None]) * N + rn[None, :], mask=ok,
                                 other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")
            _epilogue(total, xs_ptr, ws_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_xs,
                      HAS_XS, HAS_WS, HAS_BIAS)


tuned = triton.autotune(configs=configs(), key=["M_BUCKET", "N", "K", "X_FP8"],
                        prune_configs_by={"early_config_prune": _prune})(sk24_kernel)
