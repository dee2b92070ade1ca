"""The Triton source of :mod:`sparsekit.accel.sk24`'s decode kernel (imported only when the
kernel runs: on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``)."""

import triton
import triton.language as tl

K_MULTIPLE = 64


def _configs() -> list:
    out = []
    for bn, bk, warps, stages in ((16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 5),
                                  (64, 128, 4, 4), (64, 256, 8, 3), (16, 512, 4, 3),
                                  (32, 512, 8, 3), (128, 128, 8, 3), (16, 128, 2, 6)):
        out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                                 num_stages=stages))
    return out


def _prune(configs, named_args, **kwargs):
    k = named_args["K"]
    kept = [c for c in configs if k % c.kwargs["BLOCK_K"] == 0]
    return kept or [c for c in configs if c.kwargs["BLOCK_K"] == K_MULTIPLE] or configs


@triton.jit
def expand(v, mw, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Values (BLOCK_N, BLOCK_K/2) and metadata words (BLOCK_N, BLOCK_K/32) -> the dense
    weight tile (BLOCK_N, BLOCK_K) in v's dtype."""
    G: tl.constexpr = BLOCK_K // 4
    shifts = tl.arange(0, 8) * 4
    code = (mw[:, :, None] >> shifts[None, None, :]) & 0xF
    code = tl.reshape(code, (BLOCK_N, G))
    i0 = code & 3
    i1 = code >> 2
    v0, v1 = tl.split(tl.reshape(v, (BLOCK_N, G, 2)))
    zero = tl.zeros((BLOCK_N, G), dtype=v.dtype)
    w0 = tl.where(i0 == 0, v0, zero)
    w1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, zero))
    w2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
    w3 = tl.where(i1 == 3, v1, zero)
    # join(join(w0, w2), join(w1, w3)) flattens as w0, w1, w2, w3 per group
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, BLOCK_K))


@triton.jit
def sk24_kernel(x_ptr, v_ptr, m_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, M, N, K,
                stride_xm, stride_xs, M_BUCKET, X_FP8: tl.constexpr,
                HAS_XS: tl.constexpr, HAS_WS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    half = K // 2
    words = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rv = tl.arange(0, BLOCK_K // 2)
    rw = tl.arange(0, BLOCK_K // 32)
    rk = tl.arange(0, BLOCK_K)
    v_ptrs = v_ptr + rn[:, None].to(tl.int64) * half + rv[None, :]
    m_ptrs = m_ptr + rn[:, None].to(tl.int64) * words + rw[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    for _ in range(0, K, BLOCK_K):
        v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        mw = tl.load(m_ptrs, mask=n_ok[:, None], other=0)
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = expand(v, mw, BLOCK_N, BLOCK_K)
        if USE_DOT and DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        elif USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        v_ptrs += BLOCK_K // 2
        m_ptrs += BLOCK_K // 32
        x_ptrs += BLOCK_K
    if HAS_XS:
        acc *= tl.load(xs_ptr + rm * stride_xs, mask=m_ok, other=0.0)[:, None]
    if HAS_WS:
        acc *= tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None] * N + rn[None, :]
    tl.store(y_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


tuned = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "X_FP8"],
                        prune_configs_by={"early_config_prune": _prune})(sk24_kernel)
