"""The Triton source of :mod:`sparsekit.accel.kernels.attention.decode`'s decode attention
(imported only when
the kernels run: on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``).

Split-KV ("flash-decoding"): the cache's positions are cut into ``SPLITS`` ranges, and program
(b * KVH + kv head, split) walks its range in blocks of ``BLOCK_N`` positions for all ``GROUP``
query heads that share the kv head, so every key and value is read once, not once per query
head. A block's keys and values are loaded only where the mask lets a position take part:
masked loads move no bytes, so the unfilled end of a static cache costs its mask bytes alone.
Scores and the running softmax are float32 (online softmax, as flash attention); each program
writes its unnormalized sums, running max and denominator, and :func:`combine` merges the
splits of each query head.
"""

import triton
import triton.language as tl


@triton.jit
def partial(q_ptr, k_ptr, v_ptr, m_ptr, acc_ptr, stat_ptr, L, KVH, scale,
            stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
            stride_vn, stride_mb, SPLIT: tl.constexpr, GROUP: tl.constexpr,
            G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
            HAS_MASK: tl.constexpr, DOT_F32: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    splits = tl.num_programs(1)
    b = bh // KVH
    kvh = bh % KVH
    rg = tl.arange(0, G_PAD)
    rd = tl.arange(0, D)
    g_ok = rg < GROUP
    q = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + rg)[:, None] * stride_qh + rd[None, :],
                mask=g_ok[:, None], other=0.0)
    if DOT_F32:  # Triton's CPU interpreter multiplies 16-bit floats wrongly
        q = q.to(tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    lo = s * SPLIT
    for start in range(lo, lo + SPLIT, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        valid = rn < L
        if HAS_MASK:
            valid = valid & (tl.load(m_ptr + b * stride_mb + rn, mask=valid, other=0) != 0)
        k = tl.load(k_base + rn[:, None] * stride_kn + rd[None, :], mask=valid[:, None],
                    other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # a row that has seen no position yet keeps max -inf: subtract 0 there, not -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_base + rn[:, None] * stride_vn + rd[None, :], mask=valid[:, None],
                    other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    row = (bh * GROUP + rg) * splits + s  # (b, h, split) with h = kvh * GROUP + g
    tl.store(acc_ptr + row[:, None] * D + rd[None, :], acc, mask=g_ok[:, None])
    tl.store(stat_ptr + 2 * row, m_i, mask=g_ok)
    tl.store(stat_ptr + 2 * row + 1, l_i, mask=g_ok)


@triton.jit
def combine(acc_ptr, stat_ptr, o_ptr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
            D: tl.constexpr):
    bh = tl.program_id(0)  # b * H + h: the output (B, 1, H, D) is contiguous in that order
    rs = tl.arange(0, S_PAD)
    rd = tl.arange(0, D)
    s_ok = rs < SPLITS
    row = bh * SPLITS + rs
    m = tl.load(stat_ptr + 2 * row, mask=s_ok, other=float("-inf"))
    l_ = tl.load(stat_ptr + 2 * row + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)  # 0 for a split that saw no position
    acc = tl.load(acc_ptr + row[:, None] * D + rd[None, :], mask=s_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_ * w, 0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(o_ptr + bh * D + rd, out.to(o_ptr.dtype.element_ty))
