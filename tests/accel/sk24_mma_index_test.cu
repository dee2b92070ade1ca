// The lean rounds' load offsets (sparsekit/accel/kernels/mma_sp/csrc/sk24_mma.cu: offsets_at, advance,
// x_offsets_at, run on the host) against the addresses the library's other rounds compute
// for the same loads (load_round's and load_x's expressions, copied here), for every warp,
// round, row tile, step and lane of a few configurations and weight kinds; and the staged x
// slice's offsets (slice_offsets): each ldmatrix row address holds the chunk it must. Built
// and run by tests/accel/test_sk24_mma_cpu.py with nvcc; prints "ok" or the first mismatch.
#define SK24_INDEX_ONLY
#include "../../sparsekit/accel/kernels/mma_sp/csrc/sk24_mma.cu"

#include <cstdio>

namespace {

// load_round's offsets of step ks of row tile rt (uint4 / RawOf units for values, words for
// metadata, floats for int4 scales): -1 where that step loads nothing
struct Want {
  long v, e, s;
};

Want original(int wt, bool paired, int rt, int S, int ks, int u, int lane, int q) {
  Want w{-1, -1, -1};
  const long tile = (long)rt * S;
  if (wt == INT4) {
    if ((u & 3) == 0) {
      const long g = (long)rt * (S >> 2) + (ks >> 2);
      w.v = g * 32 + lane;
      w.s = g * 16 + q;
    }
  } else {
    w.v = (tile + ks) * 32 + lane;
  }
  if (paired) {
    if ((u & 1) == 0) w.e = ((long)rt * (S >> 1) + (ks >> 1)) * 32 + lane;
  } else {
    w.e = (tile + ks) * 32 + lane;
  }
  return w;
}

template <int WT, bool PAIRED, int WARPS, int U, int R, int MT>
int check(int S, int rt0, int M, int sx) {
  constexpr int STEP = WARPS * U, NL = MT * U, CH = U * 4;
  for (int warp = 0; warp < WARPS; ++warp) {
    for (int lane = 0; lane < 32; ++lane) {
      const int q = lane >> 2;
      int base = warp * U;
      Offsets<R> o;
      int xo[NL];
      offsets_at<WT, PAIRED, R>(o, rt0, S, base, lane, q);
      x_offsets_at<MT, U>(xo, sx, M, base, lane);
      for (; base < S; base += STEP) {
        for (int r = 0; r < R; ++r) {
          for (int u = 0; u < U; ++u) {
            const Want w = original(WT, PAIRED, rt0 + r, S, base + u, u, lane, q);
            // load_round_at's loads of step u: the round's offset plus the step's
            const long v = WT == INT4 ? o.v[r] + (u >> 2) * 32 : o.v[r] + u * 32;
            const long e = PAIRED ? o.e[r] + (u >> 1) * 32 : o.e[r] + u * 32;
            const long s = o.s[r] + (u >> 2) * 16;
            if ((w.v >= 0 && w.v != v) || (w.e >= 0 && w.e != e) ||
                (WT == INT4 && w.s >= 0 && w.s != s)) {
              std::printf("mismatch wt=%d paired=%d W=%d U=%d R=%d warp=%d lane=%d base=%d r=%d "
                          "u=%d: values %ld/%ld meta %ld/%ld scales %ld/%ld\n",
                          WT, PAIRED, WARPS, U, R, warp, lane, base, r, u, w.v, v, w.e, e, w.s,
                          s);
              return 1;
            }
          }
        }
        for (int c = 0; c < NL; ++c) {  // load_x: row (clamped to M - 1) and 16-byte chunk
          const int idx = lane + 32 * c, row = idx / CH, ch = idx % CH;
          const long want = (long)(row < M ? row : M - 1) * sx + (long)base * 32 + ch * 8;
          if (xo[c] != want) {
            std::printf("x mismatch MT=%d U=%d warp=%d lane=%d base=%d chunk=%d: %ld/%d\n", MT,
                        U, warp, lane, base, c, want, xo[c]);
            return 1;
          }
        }
        advance<WT, PAIRED, R, STEP>(o, xo);
      }
    }
  }
  return 0;
}

// the staged x slice: every ldmatrix row address (lane l: row l % 8 of matrix l / 8 = chunk
// 4u + l / 8 of row 8i + l % 8) is where store_x's lanes put that chunk, and the lanes' stores
// cover the slice once
template <int MT, int U>
int check_slice() {
  constexpr int CH = U * 4, NL = MT * U;
  long where[MT * 8][CH];
  int seen[MT * 8 * CH] = {0};
  for (int lane = 0; lane < 32; ++lane) {
    SliceAddr<MT, U> sa;
    slice_offsets<MT, U>(sa, lane);
    for (int s = 0; s < NL; ++s) {
      const int idx = lane + 32 * s;
      where[idx / CH][idx % CH] = sa.st[s];
      if (sa.st[s] % 16 || sa.st[s] / 16 >= MT * 8 * CH || seen[sa.st[s] / 16]++) {
        std::printf("slice store MT=%d U=%d lane=%d chunk=%d at %u\n", MT, U, lane, s, sa.st[s]);
        return 1;
      }
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    SliceAddr<MT, U> sa;
    slice_offsets<MT, U>(sa, lane);
    for (int i = 0; i < MT; ++i)
      for (int u = 0; u < U; ++u)
        if (sa.ld[i][u] != where[8 * i + (lane & 7)][4 * u + (lane >> 3)]) {
          std::printf("slice read MT=%d U=%d lane=%d i=%d u=%d\n", MT, U, lane, i, u);
          return 1;
        }
  }
  return 0;
}

}  // namespace

int main() {
  int bad = 0;
  // K = 4096 (S = 128) and 14336 (448), a block's first tile past zero, M = 1, 5 and 16
  for (int S : {128, 448}) {
    for (int M : {1, 5, 16}) {
      bad |= check<INT4, true, 8, 4, 2, 1>(S, 6, M, S * 32);
      bad |= check<INT4, true, 8, 4, 1, 2>(S, 3, M, S * 32 + 8);
      bad |= check<INT4, true, 4, 4, 1, 4>(S, 5, M, S * 32);
      bad |= check<BF16, true, 8, 4, 2, 1>(S, 6, M, S * 32);
      bad |= check<BF16, false, 8, 2, 1, 2>(S, 7, M, S * 32);
      bad |= check<FP8, true, 8, 4, 1, 1>(S, 9, M, S * 32);
      bad |= check<FP8H, false, 4, 4, 1, 2>(S, 2, M, S * 32);
    }
  }
  bad |= check_slice<1, 4>() | check_slice<2, 4>() | check_slice<4, 4>() | check_slice<1, 2>() |
         check_slice<2, 2>();
  std::printf(bad ? "mismatch\n" : "ok\n");
  return bad;
}
