// sparsekit's small-M 2:4 GEMM on the sparse tensor cores (mma.sp), for decode batches.
//
// y (M, N) = (x (M, K) @ W.T) * x_scale * w_scale + bias, W (N, K) 2:4 along K, stored in the
// fragment-ordered format of sparsekit/accel/sk24_mma.py: for every tile of 16 rows and 32
// columns ("step"), the 16 x 16 kept values in the order the 32 lanes of a warp hold them as
// the A operand of mma.sp.m16n8k32 (bf16: one 16-byte load a lane; fp8 e4m3: one 8-byte load,
// widened to bf16 in registers), and the 2-bit indices as its metadata. x is the B operand
// (M rows padded to 8, 16 or 32 with zeros), accumulated in float32.
//
// One block of WARPS warps per R tiles of 16 rows of W (each x fragment loaded feeds R
// products); warp w takes steps w*U .. w*U+U-1, then strides by WARPS*U; the warps' partial
// sums meet in shared memory. x reaches the B fragments one of two ways: straight from
// global memory (four 4-byte loads a lane, m-tile and step: 8 rows of 16 bytes each), or
// staged by each warp through its own slice of shared memory (16-byte coalesced loads of its
// U steps for all rows, stored with the 16-byte chunks XOR-swizzled by row, then one
// conflict-free ldmatrix.x4 a B fragment): for M > 1 the direct loads cost the L1 four to eight
// times the wavefronts. XM (the configuration's x mode): bit 0 stages x, bit 1 prefetches: a
// warp issues the loads of its next round (weight, metadata, scales, staged x) before the
// products of this one, so that each warp has two rounds of bytes in flight; bit 2 (with bits
// 0 and 1) launches the kernel as a programmatic dependent of the kernel before it in the
// stream (Hopper's PDL; CUDA graphs keep the edge): its blocks may start while that kernel's
// last blocks run, issue their first round's weight loads (the weights are constants of the
// model), then wait (griddepcontrol.wait: that kernel complete, its writes visible) before
// they read x or write y; each block also lets the next programmatic dependent start at once.
// Bit 3 (with bit 0): the weights reach the registers through a ring of NS rounds in shared
// memory that each warp fills with cp.async NS - 1 rounds ahead (each lane copies, and later
// reads, its own bytes only: no barrier), so that a warp has NS - 1 rounds of weight bytes in
// flight without holding them in registers (bit 1 then prefetches x alone).
// Plain C entry
// point (no torch headers): built by nvcc into a shared library and called through ctypes with
// the current stream, so the launch goes into CUDA graphs like any other kernel.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t ldg32(const uint32_t* p) {
  uint32_t v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ldg128_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ldg128(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// four 8 x 8 bf16 matrices from shared memory: lane l gives the row address of row l % 8 of
// matrix l / 8 and receives, of each matrix, row l / 4's elements 2 (l % 4) and 2 (l % 4) + 1
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ uint2 ldg64_stream(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// an asynchronous copy of B bytes (4, 8 or 16) from global to shared memory, in the current
// group (16 bytes past the L1, smaller ones through it: cp.async.cg takes 16 only)
template <int B>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (B == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(B)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// wait until at most N of this thread's groups are pending (its older copies have landed)
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t ldg32_stream(const uint32_t* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// two e4m3 bytes (the low two of w when hi == 0, else the high two) as bf16x2: the byte's
// exponent and mantissa bits moved into bf16's field give the value times 2^-120 exactly
// (subnormals included); one exact multiplication by 2^120 restores it
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t w, int hi) {
  uint32_t b = hi ? (w >> 16) : (w & 0xFFFFu);
  uint32_t t = (b | (b << 8)) & 0x00FF00FFu;
  uint32_t bits = ((t & 0x00800080u) << 8) | ((t & 0x007F007Fu) << 4);
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&bits);
  const uint32_t two120 = 0x7B807B80u;
  __nv_bfloat162 s = *reinterpret_cast<const __nv_bfloat162*>(&two120);
  __nv_bfloat162 r = __hmul2(v, s);
  return *reinterpret_cast<uint32_t*>(&r);
}

// register j of a step from w, a lane's 8 int4 values in offset binary (q + 8) with element 2j
// in nibble j and element 2j + 1 in nibble j + 4: shifted by 4j, one LOP3 puts the two nibbles
// into bf16x2 0x4300 | n (128 + n exactly), and 128 + n - 136 = q exactly
__device__ __forceinline__ uint32_t int4x2_to_bf16x2(uint32_t w, int j) {
  uint32_t bits = ((w >> (4 * j)) & 0x000F000Fu) | 0x43004300u;
  const uint32_t off = 0x43084308u;  // 136, 136
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&bits),
                             *reinterpret_cast<const __nv_bfloat162*>(&off));
  return *reinterpret_cast<uint32_t*>(&r);
}

// two e4m3 bytes (the low two of w when hi == 0, else the high two) as f16x2, exactly (one
// cvt.rn.f16x2.e4m3x2 on sm_89 and later; the low byte becomes the low half)
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t w, int hi) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(hi ? (w >> 16) : (w & 0xFFFFu)), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

template <int SEL, bool F16>
__device__ __forceinline__ void mma_sp(float (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[4], uint32_t e) {
#if defined(SK24_ORDERED)
  if constexpr (F16) {
    asm("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),
          "r"(b[3]), "r"(e), "n"(SEL));
  } else {
    asm("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),
          "r"(b[3]), "r"(e), "n"(SEL));
  }
#else
  if constexpr (F16) {
    asm("mma.sp.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),
          "r"(b[3]), "r"(e), "n"(SEL));
  } else {
    asm("mma.sp.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),
          "r"(b[3]), "r"(e), "n"(SEL));
  }
#endif
}

// Hopper's programmatic dependent launch: wait until the grids this one depends on are
// complete and their memory is visible (a no-op when the kernel was launched without the
// attribute); let the grids that depend on this one start launching
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// shared memory of the staged-x kernel: each warp's x slice (MT * 8 rows of U * 4 chunks of
// 16 bytes), reused for the warps' partial sums at the end
template <int MT, int WARPS, int U, int R>
__host__ __device__ constexpr int xs_smem_bytes() {
  return (WARPS * MT * 8 * U * 4 * 16 > WARPS * R * MT * 4 * 32 * 4)
             ? WARPS * MT * 8 * U * 4 * 16 : WARPS * R * MT * 4 * 32 * 4;
}

// int4: after the last step of a group, its sums times the scales of rows q (fragment
// elements 0, 1) and q + 8 (2, 3) go into the accumulator, and the sums start again
template <int R, int MT, int UG>
__device__ __forceinline__ void group_done(float (&acc)[R][MT][4], float (&tmp)[R][MT][4],
                                           const float (&sc)[UG][R][2], int u) {
  if ((u & 3) != 3) return;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[r][i][c] += sc[u >> 2][r][c >> 1] * tmp[r][i][c];
        tmp[r][i][c] = 0.f;
      }
}

// WT, the weight's kind: BF16, FP8 (e4m3, widened to bf16), FP8H (e4m3 converted to f16 by
// one cvt per two values, with x in f16: the f16 sparse tensor cores; e4m3 values are exact
// in f16, so the products are those of fp8 x fp8) or INT4 (offset-binary nibbles,
// one 16-byte load a lane per 4 steps, widened to bf16 q exactly; each group of 4 steps = 128
// columns sums into its own float32 fragment, which the group's scales of the lane's two rows
// multiply into the accumulator)
constexpr int BF16 = 0, FP8 = 1, INT4 = 2, FP8H = 3;

// a lane's kept values of one step as stored: 8 bf16 (16 bytes), 8 e4m3 (8 bytes) or 8 int4
// (4 bytes, a quarter of a 16-byte load)
template <int WT> struct RawOf { using T = uint4; };
template <> struct RawOf<FP8> { using T = uint2; };
template <> struct RawOf<FP8H> { using T = uint2; };
template <> struct RawOf<INT4> { using T = uint32_t; };

// one round of a warp's weight loads: U steps of R row tiles (values as stored, metadata) and,
// for int4, the scales of the lane's rows q and q + 8 per group of 4 steps
template <int WT, int U, int R, int UG>
struct Round {
  typename RawOf<WT>::T v[U][R];
  uint32_t e[U][R];
  float sc[UG][R][2];
};

// the loads of steps base .. base + U - 1 (those below S), streamed past the L1
template <int WT, bool PAIRED, int U, int R, int UG>
__device__ __forceinline__ void load_round(Round<WT, U, R, UG>& w, const void* vals,
                                           const uint32_t* meta, const float* gs, int rt0,
                                           int S, int base, int lane, int q) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int ks = base + u;
    if (ks < S) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const size_t tile = (size_t)(rt0 + r) * S;
        if constexpr (WT == INT4) {
          if ((u & 3) == 0) {
            const size_t g = (size_t)(rt0 + r) * (S >> 2) + (ks >> 2);
            uint4 v = ldg128_stream(reinterpret_cast<const uint4*>(vals) + g * 32 + lane);
            w.v[u][r] = v.x; w.v[u + 1][r] = v.y; w.v[u + 2][r] = v.z; w.v[u + 3][r] = v.w;
            w.sc[u >> 2][r][0] = gs[g * 16 + q];
            w.sc[u >> 2][r][1] = gs[g * 16 + q + 8];
          }
        } else if constexpr (WT == BF16) {
          w.v[u][r] = ldg128_stream(reinterpret_cast<const uint4*>(vals) + (tile + ks) * 32 + lane);
        } else {
          w.v[u][r] = ldg64_stream(reinterpret_cast<const uint2*>(vals) + (tile + ks) * 32 + lane);
        }
        if (PAIRED) {
          if ((u & 1) == 0)
            w.e[u][r] = ldg32_stream(meta + ((size_t)(rt0 + r) * (S >> 1) + (ks >> 1)) * 32 + lane);
          else
            w.e[u][r] = w.e[u - 1][r];
        } else {
          w.e[u][r] = ldg32_stream(meta + (tile + ks) * 32 + lane);
        }
      }
    }
  }
}

// x mode bit 3: a warp's round of weights in shared memory, lane-minor (each lane's words
// contiguous with its neighbours': conflict-free): int4 one 16-byte word a lane per group of 4
// steps, the other kinds one RawOf a step; metadata one word a step (paired: even steps only);
// int4 the scales of rows q and q + 8 per group
template <int WT> struct RingRawOf { using T = typename RawOf<WT>::T; };
template <> struct RingRawOf<INT4> { using T = uint4; };
constexpr int NS = 3;  // rounds in a warp's ring: NS - 1 in flight while one is computed

template <int WT, int U, int R, int UG>
struct RingStage {
  typename RingRawOf<WT>::T v[WT == INT4 ? UG : U][R][32];
  uint32_t e[U][R][32];
  float sc[UG][R][2][32];
};

// load_round's loads as cp.async copies into a ring stage (the current group)
template <int WT, bool PAIRED, int U, int R, int UG>
__device__ __forceinline__ void copy_round(RingStage<WT, U, R, UG>* st, const void* vals,
                                           const uint32_t* meta, const float* gs, int rt0,
                                           int S, int base, int lane, int q) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int ks = base + u;
    if (ks < S) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const size_t tile = (size_t)(rt0 + r) * S;
        if constexpr (WT == INT4) {
          if ((u & 3) == 0) {
            const size_t g = (size_t)(rt0 + r) * (S >> 2) + (ks >> 2);
            cp_async<16>(&st->v[u >> 2][r][lane], reinterpret_cast<const uint4*>(vals) + g * 32 + lane);
            cp_async<4>(&st->sc[u >> 2][r][0][lane], gs + g * 16 + q);
            cp_async<4>(&st->sc[u >> 2][r][1][lane], gs + g * 16 + q + 8);
          }
        } else if constexpr (WT == BF16) {
          cp_async<16>(&st->v[u][r][lane], reinterpret_cast<const uint4*>(vals) + (tile + ks) * 32 + lane);
        } else {
          cp_async<8>(&st->v[u][r][lane], reinterpret_cast<const uint2*>(vals) + (tile + ks) * 32 + lane);
        }
        if (PAIRED) {
          if ((u & 1) == 0)
            cp_async<4>(&st->e[u][r][lane],
                        meta + ((size_t)(rt0 + r) * (S >> 1) + (ks >> 1)) * 32 + lane);
        } else {
          cp_async<4>(&st->e[u][r][lane], meta + (tile + ks) * 32 + lane);
        }
      }
    }
  }
}

// a round's registers from its ring stage (the lane's own copies, landed)
template <int WT, bool PAIRED, int U, int R, int UG>
__device__ __forceinline__ void read_round(Round<WT, U, R, UG>& w,
                                           const RingStage<WT, U, R, UG>* st, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (WT == INT4) {
        if ((u & 3) == 0) {
          const uint4 v = st->v[u >> 2][r][lane];
          w.v[u][r] = v.x; w.v[u + 1][r] = v.y; w.v[u + 2][r] = v.z; w.v[u + 3][r] = v.w;
          w.sc[u >> 2][r][0] = st->sc[u >> 2][r][0][lane];
          w.sc[u >> 2][r][1] = st->sc[u >> 2][r][1][lane];
        }
      } else {
        w.v[u][r] = st->v[u][r][lane];
      }
      w.e[u][r] = (PAIRED && (u & 1)) ? w.e[u - 1][r] : st->e[u][r][lane];
    }
}

// a step's A registers from the lane's values as stored
template <int WT>
__device__ __forceinline__ void widen(uint32_t (&a)[4], const typename RawOf<WT>::T& v) {
  if constexpr (WT == INT4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[j] = int4x2_to_bf16x2(v, j);
  } else if constexpr (WT == FP8H) {
    a[0] = e4m3x2_to_f16x2(v.x, 0); a[1] = e4m3x2_to_f16x2(v.x, 1);
    a[2] = e4m3x2_to_f16x2(v.y, 0); a[3] = e4m3x2_to_f16x2(v.y, 1);
  } else if constexpr (WT == FP8) {
    a[0] = e4m3x2_to_bf16x2(v.x, 0); a[1] = e4m3x2_to_bf16x2(v.x, 1);
    a[2] = e4m3x2_to_bf16x2(v.y, 0); a[3] = e4m3x2_to_bf16x2(v.y, 1);
  } else {
    a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
  }
}

// staged x: a warp's U steps of x for all MT * 8 rows (rows past M repeat row M - 1: their
// products land in outputs that are not written), 16 bytes a load, coalesced ...
template <int MT, int U>
__device__ __forceinline__ void load_x(uint4 (&xv)[MT * U], const __nv_bfloat16* x, int sx,
                                       int M, int S, int base, int lane) {
  constexpr int CH = U * 4;  // 16-byte chunks a row
#pragma unroll
  for (int s = 0; s < MT * U; ++s) {
    const int idx = lane + 32 * s, row = idx / CH, c = idx % CH;
    if (base + c / 4 < S)
      xv[s] = ldg128(reinterpret_cast<const uint4*>(
                         x + (size_t)(row < M ? row : M - 1) * sx + (size_t)base * 32) + c);
  }
}

// ... stored into the warp's slice with the 16-byte chunks XOR-swizzled by row (ldmatrix then
// reads every B fragment without bank conflicts)
template <int MT, int U>
__device__ __forceinline__ void store_x(uint4* xw, const uint4 (&xv)[MT * U], int S, int base,
                                        int lane) {
  constexpr int CH = U * 4;
#pragma unroll
  for (int s = 0; s < MT * U; ++s) {
    const int idx = lane + 32 * s, row = idx / CH, c = idx % CH;
    if (base + c / 4 < S) xw[row * CH + (c ^ (row & 7))] = xv[s];
  }
}

// x mode bit 4 ("lean", with 3; 7 adds the programmatic launch): the staged, prefetching
// rounds with every load addressed by a per-lane 32-bit offset computed once and advanced by a
// constant each round (the other modes compute each address in 64 bits every round: at M = 1
// on int4 weights that arithmetic issued about as many instructions as the products), whole
// rounds loaded unguarded, and two sets of round registers taken in turn, so that no copies
// move the prefetched round into place. Every round is whole: the launch refuses a K whose
// steps of 32 columns are not a multiple of the steps a round.
template <int R>
struct Offsets {
  int v[R];  // per row tile, the lane's first value load of the round (RawOf / uint4 units)
  int e[R];  // its first metadata word
  int s[R];  // int4: its first group scale (row q)
};

template <int WT, bool PAIRED, int R>
__host__ __device__ __forceinline__ void offsets_at(Offsets<R>& o, int rt0, int S, int base,
                                                    int lane, int q) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int tile = rt0 + r;
    if constexpr (WT == INT4) {
      const int g = tile * (S >> 2) + (base >> 2);
      o.v[r] = g * 32 + lane;
      o.s[r] = g * 16 + q;
    } else {
      o.v[r] = (tile * S + base) * 32 + lane;
    }
    o.e[r] = PAIRED ? (tile * (S >> 1) + (base >> 1)) * 32 + lane : (tile * S + base) * 32 + lane;
  }
}

// the offsets of the round STEP steps on
template <int WT, bool PAIRED, int R, int STEP, int NL>
__host__ __device__ __forceinline__ void advance(Offsets<R>& o, int (&xo)[NL]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    o.v[r] += WT == INT4 ? STEP / 4 * 32 : STEP * 32;
    o.e[r] += PAIRED ? STEP / 2 * 32 : STEP * 32;
    if constexpr (WT == INT4) o.s[r] += STEP / 4 * 16;
  }
#pragma unroll
  for (int s = 0; s < NL; ++s) xo[s] += STEP * 32;
}

// load_round's loads for a whole round (every step below S), from the offsets
template <int WT, bool PAIRED, int U, int R, int UG>
__device__ __forceinline__ void load_round_at(Round<WT, U, R, UG>& w, const void* vals,
                                              const uint32_t* meta, const float* gs,
                                              const Offsets<R>& o) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (WT == INT4) {
        if ((u & 3) == 0) {
          const uint4 v =
              ldg128_stream(reinterpret_cast<const uint4*>(vals) + o.v[r] + (u >> 2) * 32);
          w.v[u][r] = v.x; w.v[u + 1][r] = v.y; w.v[u + 2][r] = v.z; w.v[u + 3][r] = v.w;
          w.sc[u >> 2][r][0] = gs[o.s[r] + (u >> 2) * 16];
          w.sc[u >> 2][r][1] = gs[o.s[r] + (u >> 2) * 16 + 8];
        }
      } else if constexpr (WT == BF16) {
        w.v[u][r] = ldg128_stream(reinterpret_cast<const uint4*>(vals) + o.v[r] + u * 32);
      } else {
        w.v[u][r] = ldg64_stream(reinterpret_cast<const uint2*>(vals) + o.v[r] + u * 32);
      }
      if (PAIRED) {
        if ((u & 1) == 0)
          w.e[u][r] = ldg32_stream(meta + o.e[r] + (u >> 1) * 32);
        else
          w.e[u][r] = w.e[u - 1][r];
      } else {
        w.e[u][r] = ldg32_stream(meta + o.e[r] + u * 32);
      }
    }
  }
}

// load_x's offsets (bf16 elements) for the round at base
template <int MT, int U>
__host__ __device__ __forceinline__ void x_offsets_at(int (&xo)[MT * U], int sx, int M,
                                                      int base, int lane) {
  constexpr int CH = U * 4;
#pragma unroll
  for (int s = 0; s < MT * U; ++s) {
    const int idx = lane + 32 * s, row = idx / CH, c = idx % CH;
    xo[s] = (row < M ? row : M - 1) * sx + base * 32 + c * 8;
  }
}

// the lean rounds' shared-memory addresses, computed once a lane: where it stores its x
// chunks (store_x's swizzle) and where ldmatrix reads the B fragments of step u, x tile i
template <int MT, int U>
struct SliceAddr {
  uint32_t st[MT * U];
  uint32_t ld[MT][U];
};

// their byte offsets from the warp's slice (store_x's and the ldmatrix reads' layout)
template <int MT, int U>
__host__ __device__ __forceinline__ void slice_offsets(SliceAddr<MT, U>& sa, int lane) {
  constexpr int CH = U * 4;
#pragma unroll
  for (int s = 0; s < MT * U; ++s) {
    const int idx = lane + 32 * s, row = idx / CH, c = idx % CH;
    sa.st[s] = 16 * (row * CH + (c ^ (row & 7)));
  }
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int u = 0; u < U; ++u)
      sa.ld[i][u] = 16 * ((8 * i + (lane & 7)) * CH + ((4 * u + (lane >> 3)) ^ (lane & 7)));
}

template <int MT, int U>
__device__ __forceinline__ void slice_addr(SliceAddr<MT, U>& sa, const uint4* xw, int lane) {
  slice_offsets<MT, U>(sa, lane);
  const uint32_t w0 = static_cast<uint32_t>(__cvta_generic_to_shared(xw));
#pragma unroll
  for (int s = 0; s < MT * U; ++s) sa.st[s] += w0;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int u = 0; u < U; ++u) sa.ld[i][u] += w0;
}

__device__ __forceinline__ void sts128(uint32_t a, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};"
               ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void ldsm_x4_at(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// int4 register j of a step as bf16x2 128 + n, n the nibbles (one LOP3 after the shift); the
// lean rounds take the 136 off with a second product whose A is -136 in every kept position
__device__ __forceinline__ uint32_t int4x2_to_biased_bf16x2(uint32_t w, int j) {
  uint32_t r;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(r) : "r"(w >> (4 * j)));
  return r;
}

// a round's products from its registers: x staged into the warp's slice, then each step's
// widened values times the B fragments ldmatrix reads (int4: each group's sums scaled in)
template <int MT, int WT, bool PAIRED, int U, int R, int UG>
__device__ __forceinline__ void staged_products(float (&acc)[R][MT][4], float (&tmp)[R][MT][4],
                                                const Round<WT, U, R, UG>& w,
                                                const uint4 (&xv)[MT * U],
                                                const SliceAddr<MT, U>& sa) {
  __syncwarp();  // every lane's ldmatrix of the last round has read the slice
#pragma unroll
  for (int s = 0; s < MT * U; ++s) sts128(sa.st[s], xv[s]);
  __syncwarp();
  constexpr uint32_t kNeg136[4] = {0xC308C308u, 0xC308C308u, 0xC308C308u, 0xC308C308u};
#pragma unroll
  for (int u = 0; u < U; ++u) {
    uint32_t a[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (WT == INT4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) a[r][j] = int4x2_to_biased_bf16x2(w.v[u][r], j);
      } else {
        widen<WT>(a[r], w.v[u][r]);
      }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      uint32_t b[4];
      ldsm_x4_at(b, sa.ld[i][u]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float (&d)[4] = WT == INT4 ? tmp[r][i] : acc[r][i];
        if (PAIRED && (u & 1)) mma_sp<1, WT == FP8H>(d, a[r], b, w.e[u][r]);
        else mma_sp<0, WT == FP8H>(d, a[r], b, w.e[u][r]);
        if constexpr (WT == INT4) {
          if (PAIRED && (u & 1)) mma_sp<1, false>(d, kNeg136, b, w.e[u][r]);
          else mma_sp<0, false>(d, kNeg136, b, w.e[u][r]);
        }
      }
    }
    if constexpr (WT == INT4) group_done<R, MT, UG>(acc, tmp, w.sc, u);
  }
}

// the lean rounds of a warp (steps warp * U + k * WARPS * U ..., U at a time)
template <int MT, int WT, bool PAIRED, int WARPS, int U, int R, bool PDL>
__device__ __forceinline__ void lean_rounds(float (&acc)[R][MT][4], float (&tmp)[R][MT][4],
                                            const __nv_bfloat16* x, int sx, const void* vals,
                                            const uint32_t* meta, const float* gs, uint4* xw,
                                            int rt0, int M, int S, int warp, int lane, int q) {
  constexpr int UG = WT == INT4 ? U / 4 : 1, NL = MT * U, STEP = WARPS * U;
  Offsets<R> o;
  int xo[NL];
  int base = warp * U;
  offsets_at<WT, PAIRED, R>(o, rt0, S, base, lane, q);
  x_offsets_at<MT, U>(xo, sx, M, base, lane);
  Round<WT, U, R, UG> wa, wb;
  uint4 xa[NL], xb[NL];
  SliceAddr<MT, U> sa;
  slice_addr<MT, U>(sa, xw, lane);
  auto weights = [&](Round<WT, U, R, UG>& w, int b) {
    if (b < S) load_round_at<WT, PAIRED>(w, vals, meta, gs, o);
  };
  auto xs = [&](uint4 (&xv)[NL], int b) {
    if (b < S) {
#pragma unroll
      for (int s = 0; s < NL; ++s) xv[s] = ldg128(reinterpret_cast<const uint4*>(x + xo[s]));
    }
  };
  weights(wa, base);
  if constexpr (PDL) {  // weights only above: x and y belong to the kernels around this one
    launch_dependents();
    grid_dependency_wait();
  }
  xs(xa, base);
  while (base < S) {
    advance<WT, PAIRED, R, STEP>(o, xo);
    weights(wb, base + STEP);
    xs(xb, base + STEP);
    staged_products<MT, WT, PAIRED>(acc, tmp, wa, xa, sa);
    base += STEP;
    if (base >= S) break;
    advance<WT, PAIRED, R, STEP>(o, xo);
    weights(wa, base + STEP);
    xs(xa, base + STEP);
    staged_products<MT, WT, PAIRED>(acc, tmp, wb, xb, sa);
    base += STEP;
  }
}

template <int MT, int WT, bool PAIRED, int WARPS, int U, int R, int XM>
__global__ void __launch_bounds__(WARPS * 32)
sk24_mma_kernel(const __nv_bfloat16* __restrict__ x, int sx, const void* __restrict__ vals,
                const uint32_t* __restrict__ meta, const float* __restrict__ xs, int xs_stride,
                const float* __restrict__ ws, const float* __restrict__ gs,
                const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ y, int M,
                int N, int K) {
  static_assert(!PAIRED || (U % 2 == 0), "paired metadata needs an even unroll");
  static_assert(!(XM & 1) || U >= 2, "the swizzle takes 8 chunks a row");
  static_assert(WT != INT4 || U % 4 == 0, "int4 takes whole groups of 4 steps");
  extern __shared__ __align__(16) unsigned char smem[];
  // R tiles of 16 rows a block: each x fragment loaded feeds R products
  const int rt0 = blockIdx.x * R;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q = lane >> 2, t = lane & 3;
  const int S = K >> 5;
  float acc[R][MT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[r][i][0] = acc[r][i][1] = acc[r][i][2] = acc[r][i][3] = 0.f;
  float tmp[R][MT][4];  // int4: the current group's sums
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i) tmp[r][i][0] = tmp[r][i][1] = tmp[r][i][2] = tmp[r][i][3] = 0.f;
  const uint32_t* xr[MT];
  bool ok[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    int m = i * 8 + q;
    ok[i] = m < M;
    xr[i] = reinterpret_cast<const uint32_t*>(x + (size_t)(ok[i] ? m : 0) * sx) + t;
  }
  constexpr bool XS = (XM & 1) != 0, PF = (XM & 2) != 0, PDL = (XM & 4) != 0;
  constexpr bool RING = (XM & 8) != 0, LEAN = (XM & 16) != 0;
  static_assert(!PDL || (XS && PF), "a programmatic launch prefetches its first round");
  static_assert(!RING || XS, "the weights' ring sits beside the staged x");
  static_assert(!LEAN || (XS && PF && !RING), "the lean rounds are staged and prefetched");
  if constexpr (LEAN) {
    lean_rounds<MT, WT, PAIRED, WARPS, U, R, PDL>(
        acc, tmp, x, sx, vals, meta, gs,
        reinterpret_cast<uint4*>(smem) + warp * (MT * 8 * U * 4), rt0, M, S, warp, lane, q);
  } else {
    constexpr int UG = WT == INT4 ? U / 4 : 1;  // int4: groups of 4 steps a round
    constexpr int NL = XS ? MT * U : 1;          // staged x: 16-byte loads a lane and round
    Round<WT, U, R, UG> w;                       // the round's weight, as loaded
    uint4 xv[NL];                                // staged x: the round's x, as loaded
    int base = warp * U;
    // the ring: this warp's NS stages, after every warp's x slice
    RingStage<WT, U, R, UG>* ring = reinterpret_cast<RingStage<WT, U, R, UG>*>(
                                        smem + xs_smem_bytes<MT, WARPS, U, R>()) + warp * NS;
    int round = 0;
    if constexpr (RING) {  // the first NS - 1 rounds' copies, one group each
#pragma unroll
      for (int p = 0; p < NS - 1; ++p) {
        copy_round<WT, PAIRED>(ring + p, vals, meta, gs, rt0, S, base + p * WARPS * U, lane, q);
        cp_async_commit();
      }
      if constexpr (PDL) {
        launch_dependents();
        grid_dependency_wait();
      }
      if constexpr (PF) load_x<MT, U>(xv, x, sx, M, S, base, lane);
    } else if constexpr (PF) {  // the first round's loads; each round then loads the next one's
      load_round<WT, PAIRED>(w, vals, meta, gs, rt0, S, base, lane, q);
      if constexpr (PDL) {  // weights only above: x and y belong to the kernels around this one
        launch_dependents();
        grid_dependency_wait();
      }
      if constexpr (XS) load_x<MT, U>(xv, x, sx, M, S, base, lane);
    }
    for (; base < S; base += WARPS * U) {
      Round<WT, U, R, UG> wn;
      uint4 xn[NL];
      if constexpr (RING) {  // round + NS - 1's copies; then this round's, landed, to registers
        copy_round<WT, PAIRED>(ring + (round + NS - 1) % NS, vals, meta, gs, rt0, S,
                               base + (NS - 1) * WARPS * U, lane, q);
        cp_async_commit();
        if constexpr (PF) load_x<MT, U>(xn, x, sx, M, S, base + WARPS * U, lane);
        else load_x<MT, U>(xv, x, sx, M, S, base, lane);
        cp_async_wait<NS - 1>();
        read_round<WT, PAIRED>(w, ring + round % NS, lane);
        ++round;
      } else if constexpr (PF) {
        load_round<WT, PAIRED>(wn, vals, meta, gs, rt0, S, base + WARPS * U, lane, q);
        if constexpr (XS) load_x<MT, U>(xn, x, sx, M, S, base + WARPS * U, lane);
      } else {
        load_round<WT, PAIRED>(w, vals, meta, gs, rt0, S, base, lane, q);
        if constexpr (XS) load_x<MT, U>(xv, x, sx, M, S, base, lane);
      }
      // this warp's slice of shared memory: its U steps of x, all MT * 8 rows
      uint4* xw = reinterpret_cast<uint4*>(smem) + warp * (MT * 8 * U * 4);
      if constexpr (XS) {
        __syncwarp();  // every lane's ldmatrix of the last round has read the slice
        store_x<MT, U>(xw, xv, S, base, lane);
        __syncwarp();
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int ks = base + u;
        if (ks < S) {
          uint32_t a[R][4];
#pragma unroll
          for (int r = 0; r < R; ++r) widen<WT>(a[r], w.v[u][r]);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            uint32_t b[4];
            if constexpr (XS) {
              // matrix j = chunk 4u + j of rows 8i .. 8i + 7: lane (q, t) gets x[8i + q][32 ks
              // + 8j + 2t ..], the B fragment's word j
              ldsm_x4(b, xw + (8 * i + (lane & 7)) * (U * 4) +
                             ((4 * u + (lane >> 3)) ^ (lane & 7)));
            } else {
              const uint32_t* p = xr[i] + ks * 16;  // 32 bf16 = 16 words a step
#pragma unroll
              for (int j = 0; j < 4; ++j) b[j] = ok[i] ? ldg32(p + 4 * j) : 0u;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
              float (&d)[4] = WT == INT4 ? tmp[r][i] : acc[r][i];
              if (PAIRED && (u & 1)) mma_sp<1, WT == FP8H>(d, a[r], b, w.e[u][r]);
              else mma_sp<0, WT == FP8H>(d, a[r], b, w.e[u][r]);
            }
          }
          if constexpr (WT == INT4) group_done<R, MT, UG>(acc, tmp, w.sc, u);
        }
      }
      if constexpr (PF) {
        if constexpr (!RING) w = wn;
#pragma unroll
        for (int s = 0; s < NL; ++s) xv[s] = xn[s];
      }
    }
    if constexpr (RING) cp_async_wait<0>();  // (the groups left are empty: rounds past S)
  }
  // the warps' partial sums: red[warp][(r*MT + i)*4 + c][lane]
  __syncthreads();  // (the staged kernel's x slices become the sums' space)
  float (*red)[R * MT * 4][32] = reinterpret_cast<float (*)[R * MT * 4][32]>(smem);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][(r * MT + i) * 4 + c][lane] = acc[r][i][c];
  __syncthreads();
  for (int idx = threadIdx.x; idx < R * MT * 4 * 32; idx += WARPS * 32) {
    const int ric = idx >> 5, l = idx & 31;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w][ric][l];
    const int r = ric / (MT * 4), ic = ric % (MT * 4);
    const int i = ic >> 2, c = ic & 3;
    const int row = (l >> 2) + ((c & 2) ? 8 : 0);
    const int m = i * 8 + 2 * (l & 3) + (c & 1);
    const int n = (rt0 + r) * 16 + row;
    if (m < M) {
      if (xs) s *= xs[m * xs_stride];
      if (ws) s *= ws[n];
      if (bias) s += __bfloat162float(bias[n]);
      y[(size_t)m * N + n] = __float2bfloat16(s);
    }
  }
}

// one launch of ``kern``: as a programmatic dependent of the kernel before it in the stream
// (``pdl``) or plainly; 0 or the CUDA error
template <typename... Params, typename... Args>
int go(void (*kern)(Params...), dim3 grid, int threads, int bytes, bool pdl, cudaStream_t st,
       Args... args) {
  if (!pdl) {
    kern<<<grid, threads, bytes, st>>>(args...);
    return 0;
  }
  cudaLaunchConfig_t lc = {};
  lc.gridDim = grid;
  lc.blockDim = dim3(threads);
  lc.dynamicSmemBytes = bytes;
  lc.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&lc, kern, static_cast<Params>(args)...);
}

template <int MT, int WT, bool PAIRED>
int launch_wu(int warps, int unroll, int rows, int xsm, int N, cudaStream_t st,
              const __nv_bfloat16* x, int sx, const void* vals, const uint32_t* meta,
              const float* xs, int xs_stride, const float* ws, const float* gs,
              const __nv_bfloat16* bias, __nv_bfloat16* y, int M, int K) {
  if ((N / 16) % rows) return -2;
  dim3 grid(N / 16 / rows);
  // (the attribute call is a host-side setting, made once an instantiation; no stream work)
#define SK24_GO(W, UU, RR, X)                                                                \
  if constexpr (WT != INT4 || UU % 4 == 0) {                                                 \
    if (warps == W && unroll == UU && rows == RR && xsm == X) {                              \
      if ((X & 16) && (K / 32) % UU) return -2;                                              \
      auto kern = sk24_mma_kernel<MT, WT, PAIRED, W, UU, RR, X>;                             \
      constexpr int bytes =                                                                  \
          ((X & 1) ? xs_smem_bytes<MT, W, UU, RR>() : W * RR * MT * 4 * 32 * 4) +            \
          ((X & 8) ? W * NS * (int)sizeof(RingStage<WT, UU, RR, WT == INT4 ? UU / 4 : 1>)    \
                   : 0);                                                                     \
      static bool attr = false;                                                              \
      if (!attr && bytes > 48 * 1024) {                                                      \
        cudaError_t err = cudaFuncSetAttribute(                                              \
            kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);                       \
        if (err != cudaSuccess) return (int)err;                                             \
      }                                                                                      \
      attr = true;                                                                           \
      return go(kern, grid, W * 32, bytes, (X & 4) != 0, st, x, sx, vals, meta, xs,          \
                xs_stride, ws, gs, bias, y, M, N, K);                                        \
    }                                                                                        \
  }
  SK24_GO(4, 4, 1, 0)
  SK24_GO(4, 8, 1, 0)
  SK24_GO(8, 4, 1, 0)
  SK24_GO(8, 8, 1, 0)
  SK24_GO(2, 8, 1, 0)
  SK24_GO(4, 4, 2, 0)
  SK24_GO(8, 4, 2, 0)
  SK24_GO(4, 4, 4, 0)
  SK24_GO(4, 4, 1, 1)
  SK24_GO(8, 4, 1, 1)
  SK24_GO(8, 2, 1, 1)
  SK24_GO(4, 4, 2, 1)
  SK24_GO(8, 4, 2, 1)
  SK24_GO(4, 4, 4, 1)
  SK24_GO(4, 4, 1, 3)
  SK24_GO(8, 4, 1, 3)
  SK24_GO(8, 2, 1, 3)
  SK24_GO(8, 8, 1, 3)
  SK24_GO(8, 4, 2, 3)
  SK24_GO(4, 4, 4, 3)
  SK24_GO(4, 4, 1, 7)
  SK24_GO(8, 4, 1, 7)
  SK24_GO(8, 2, 1, 7)
  SK24_GO(8, 4, 2, 7)
  SK24_GO(8, 4, 1, 9)
  SK24_GO(8, 4, 1, 11)
  SK24_GO(8, 4, 1, 15)
  SK24_GO(8, 4, 2, 15)
  SK24_GO(8, 4, 1, 19)
  SK24_GO(8, 4, 2, 19)
  SK24_GO(8, 4, 1, 23)
  SK24_GO(8, 4, 2, 23)
  SK24_GO(4, 4, 1, 23)
  SK24_GO(8, 2, 1, 23)
#undef SK24_GO
  return -1;
}

template <int MT>
int launch_mt(int wt, int paired, int warps, int unroll, int rows, int xsm, int N,
              cudaStream_t st, const __nv_bfloat16* x, int sx, const void* vals,
              const uint32_t* meta, const float* xs, int xs_stride, const float* ws,
              const float* gs, const __nv_bfloat16* bias, __nv_bfloat16* y, int M, int K) {
#define SK24_WT(T, P)                                                                        \
  if (wt == T && paired == P)                                                                \
    return launch_wu<MT, T, P>(warps, unroll, rows, xsm, N, st, x, sx, vals, meta, xs,       \
                               xs_stride, ws, gs, bias, y, M, K);
  SK24_WT(BF16, true)
  SK24_WT(BF16, false)
  SK24_WT(FP8, true)
  SK24_WT(FP8, false)
  SK24_WT(FP8H, true)
  SK24_WT(FP8H, false)
  SK24_WT(INT4, true)
#undef SK24_WT
  return -1;
}

// fp8 e4m3 x fp8 e4m3 on the fp8 sparse tensor cores (mma.sp.m16n8k64): the weight's kept
// values and x as the layer quantized them, 64 columns a step, no widening. A lane holds
// compressed columns 4t..4t+3 of rows q and q + 8, then 16 + 4t.. of both (16 bytes), and
// the 2-bit positions of row q + 8 (t & 1), compressed columns 16 (t >> 1) .. + 15 (every lane
// supplies metadata; sparsity selector 0).
__device__ __forceinline__ void mma_sp_e4m3(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[4], uint32_t e) {
  asm("mma.sp::ordered_metadata.sync.aligned.m16n8k64.row.col.f32.e4m3.e4m3.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]),
        "r"(e));
}

template <int MT, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32)
sk24_mma_e4m3_kernel(const uint8_t* __restrict__ x, int sx, const uint4* __restrict__ vals,
                     const uint32_t* __restrict__ meta, const float* __restrict__ xs,
                     int xs_stride, const float* __restrict__ ws,
                     const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ y,
                     int M, int N, int K) {
  const int rt = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q = lane >> 2, t = lane & 3;
  const int S = K >> 6;
  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const uint32_t* xr[MT];
  bool ok[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    int m = i * 8 + q;
    ok[i] = m < M;
    xr[i] = reinterpret_cast<const uint32_t*>(x + (size_t)(ok[i] ? m : 0) * sx) + t;
  }
  const size_t tile = (size_t)rt * S;
  for (int base = warp * U; base < S; base += WARPS * U) {
    uint32_t a[U][4];
    uint32_t e[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ks = base + u;
      if (ks < S) {
        uint4 v = ldg128_stream(vals + (tile + ks) * 32 + lane);
        a[u][0] = v.x; a[u][1] = v.y; a[u][2] = v.z; a[u][3] = v.w;
        e[u] = ldg32_stream(meta + (tile + ks) * 32 + lane);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ks = base + u;
      if (ks < S) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          uint32_t b[4];
          const uint32_t* p = xr[i] + ks * 16;  // 64 bytes = 16 words a step
#pragma unroll
          for (int j = 0; j < 4; ++j) b[j] = ok[i] ? ldg32(p + 4 * j) : 0u;
          mma_sp_e4m3(acc[i], a[u], b, e[u]);
        }
      }
    }
  }
  __shared__ float red[WARPS][MT * 4][32];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[warp][i * 4 + c][lane] = acc[i][c];
  __syncthreads();
  for (int idx = threadIdx.x; idx < MT * 4 * 32; idx += WARPS * 32) {
    const int ic = idx >> 5, l = idx & 31;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w][ic][l];
    const int i = ic >> 2, c = ic & 3;
    const int r = (l >> 2) + ((c & 2) ? 8 : 0);
    const int m = i * 8 + 2 * (l & 3) + (c & 1);
    const int n = rt * 16 + r;
    if (m < M) {
      if (xs) s *= xs[m * xs_stride];
      if (ws) s *= ws[n];
      if (bias) s += __bfloat162float(bias[n]);
      y[(size_t)m * N + n] = __float2bfloat16(s);
    }
  }
}

template <int MT>
int launch_e4m3(int warps, int unroll, cudaStream_t st, const uint8_t* x, int sx,
                const uint4* vals, const uint32_t* meta, const float* xs, int xs_stride,
                const float* ws, const __nv_bfloat16* bias, __nv_bfloat16* y, int M, int N,
                int K) {
  dim3 grid(N / 16);
#define SK24_GO8(W, UU)                                                                      \
  if (warps == W && unroll == UU) {                                                          \
    sk24_mma_e4m3_kernel<MT, W, UU><<<grid, W * 32, 0, st>>>(x, sx, vals, meta, xs,          \
                                                             xs_stride, ws, bias, y, M, N, K); \
    return 0;                                                                                \
  }
  SK24_GO8(4, 4)
  SK24_GO8(4, 8)
  SK24_GO8(8, 4)
  SK24_GO8(8, 8)
#undef SK24_GO8
  return -1;
}

}  // namespace

#ifndef SK24_INDEX_ONLY  // (tests/accel/sk24_mma_index_test.cu: the index helpers alone)
// 0 on success; -1 for a configuration not compiled, -2 for a shape the kernel does not take
// (rows: tiles of 16 rows a block must divide N / 16), else the CUDA error of the launch;
// wt: 0 bf16, 1 fp8 e4m3 (widened to bf16), 3 fp8 e4m3 as f16 with x f16, 2 int4 (paired
// metadata only, K a multiple of 128, gs the
// group scales (N / 16, K / 128, 16) float32); xsm: 0 loads x directly, 1 stages it through
// shared memory (x's rows 16-byte aligned), 3 stages it and prefetches each next round, 7 also
// launches as a programmatic dependent of the kernel before it; plus 8 (with 1): the weights
// through a cp.async ring in shared memory (2 then prefetches x alone); plus 16 (with 3 or
// 7): the lean rounds (32-bit offsets advanced per round, two register sets in turn; K / 32
// a multiple of the unroll)
extern "C" int sk24_mma_launch(const void* x, int sx, const void* vals, const void* meta,
                               const float* xs, int xs_stride, const float* ws, const float* gs,
                               const void* bias, void* y, int M, int N, int K, int wt,
                               int paired, int warps, int unroll, int rows, int xsm,
                               void* stream) {
  if (M < 1 || M > 32 || N % 16 || K % 64 || rows < 1) return -2;
  if (wt == INT4 && (K % 128 || !paired || gs == nullptr)) return -2;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const __nv_bfloat16* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const uint32_t* mb = reinterpret_cast<const uint32_t*>(meta);
  const __nv_bfloat16* bb = reinterpret_cast<const __nv_bfloat16*>(bias);
  __nv_bfloat16* yb = reinterpret_cast<__nv_bfloat16*>(y);
  int rc;
  if (M <= 8)
    rc = launch_mt<1>(wt, paired, warps, unroll, rows, xsm, N, st, xb, sx, vals, mb, xs,
                      xs_stride, ws, gs, bb, yb, M, K);
  else if (M <= 16)
    rc = launch_mt<2>(wt, paired, warps, unroll, rows, xsm, N, st, xb, sx, vals, mb, xs,
                      xs_stride, ws, gs, bb, yb, M, K);
  else
    rc = launch_mt<4>(wt, paired, warps, unroll, rows, xsm, N, st, xb, sx, vals, mb, xs,
                      xs_stride, ws, gs, bb, yb, M, K);
  if (rc) return rc;
  return (int)cudaGetLastError();
}

extern "C" int sk24_mma_version() { return 11; }

// the fp8 x fp8 kernel: x (M, K) e4m3, values/meta in the e4m3 layout (64 columns a step)
extern "C" int sk24_mma_e4m3_launch(const void* x, int sx, const void* vals, const void* meta,
                                    const float* xs, int xs_stride, const float* ws,
                                    const void* bias, void* y, int M, int N, int K, int warps,
                                    int unroll, void* stream) {
  if (M < 1 || M > 32 || N % 16 || K % 64) return -2;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x);
  const uint4* vb = reinterpret_cast<const uint4*>(vals);
  const uint32_t* mb = reinterpret_cast<const uint32_t*>(meta);
  const __nv_bfloat16* bb = reinterpret_cast<const __nv_bfloat16*>(bias);
  __nv_bfloat16* yb = reinterpret_cast<__nv_bfloat16*>(y);
  int rc;
  if (M <= 8)
    rc = launch_e4m3<1>(warps, unroll, st, xb, sx, vb, mb, xs, xs_stride, ws, bb, yb, M, N, K);
  else if (M <= 16)
    rc = launch_e4m3<2>(warps, unroll, st, xb, sx, vb, mb, xs, xs_stride, ws, bb, yb, M, N, K);
  else
    rc = launch_e4m3<4>(warps, unroll, st, xb, sx, vb, mb, xs, xs_stride, ws, bb, yb, M, N, K);
  if (rc) return rc;
  return (int)cudaGetLastError();
}
#endif  // SK24_INDEX_ONLY
