// The matrix products of the TT CPU kernels (tt_embedding_cpu.h),
// on matrices given as arrays of row pointers, so that the rows of a prefix
// tree's nodes are used where they lie, never gathered into a copy first.
// Plain C++ (no TensorFlow headers).
//
// Every product has one generic version (any element type and size: loops over
// contiguous rows that the compiler vectorises) and, for float (the library is
// built for AVX2 + FMA, cpu_isa.h), register-blocked versions used when the
// vectorised width is a multiple of 8 (every rank that is a multiple of 8):
//   RowsTimes                  the forward's P_k = P_{k-1} G_k and the
//                              backward's dP_{k-1} = dP_k G_k^T: a tile of
//                              MR rows x NV vectors of columns of C in
//                              registers, the contraction (k) innermost;
//   TransposedRowsTimesRows    the core gradients dG_k = P_{k-1}^T dP_k: a tile
//                              of C in registers, the summed rows innermost;
//   RowDots                    the last core's products, whose output is only
//                              q_{T-1} columns wide: dot products of length k;
//   LeafGradients              the backward's two products at a leaf, dP_m's
//                              part G_{T-1}^T dP_leaf and core T-1's block
//                              P_m^T dP_leaf, from one broadcast of dP_leaf;
//   Transpose                  8 x 8 blocks.
// The tiles of RowsTimes, TransposedRowsTimesRows and LeafGradients are written
// once over a vector type: AVX2's 8 lanes (16 registers), and AVX-512's 16
// lanes (32 registers, twice the tile), which run where the CPU has AVX-512
// (CpuHasAvx512); RowDots has its own AVX-512 tile, with the AVX2 one's bits.
// Each output element is one chain of fused multiply-adds over the contracted
// index in ascending order, started from 0 or from the element's old value;
// which tile or vector width computed it does not change its bits, so a
// product is bitwise the same whatever rows it was batched with and on either
// instruction set. RowDots sums 8 lanes, then the lanes, in one fixed order on
// both instruction sets.

#ifndef TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_MATH_H_
#define TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_MATH_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "cc/kernels/cpu_isa.h"
#define TF_TTEMB_TT_AVX2 1
// Fully unrolls a loop over a tile's registers. Without it GCC keeps a tile's
// accumulators in memory and stores them on every iteration of the loop
// around it.
#define TF_TTEMB_UNROLL _Pragma("GCC unroll 16")
#endif

namespace tensorflow {
namespace tf_ttemb {
namespace tt_math {

// dst [n, m] = src [m, n]^T.
template <typename Acc>
void TransposeGeneric(const Acc* src, int64_t m, int64_t n, Acc* dst) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) dst[j * m + i] = src[i * n + j];
  }
}

// ---------------------------------------------------------------------------
// Generic versions.

// c[i][0, n) (+)= sum_{x < k} a[i][x] * b[x * n, (x + 1) * n) for i < m.
template <bool kAccumulate, typename Acc>
void RowsTimesGeneric(const Acc* const* a, int64_t m, int64_t k, const Acc* b, int64_t n,
                      Acc* const* c) {
  for (int64_t i = 0; i < m; ++i) {
    Acc* ci = c[i];
    if (!kAccumulate) std::fill_n(ci, n, Acc(0));
    for (int64_t x = 0; x < k; ++x) {
      const Acc ax = a[i][x];
      const Acc* bx = b + x * n;
      for (int64_t j = 0; j < n; ++j) ci[j] += ax * bx[j];
    }
  }
}

// c[x * n, (x + 1) * n) (+)= sum_{i < m} a[i][x] * d[i][0, n) for x < ka.
template <bool kAccumulate, typename Acc>
void TransposedRowsTimesRowsGeneric(const Acc* const* a, int64_t ka, const Acc* const* d, int64_t n,
                                    int64_t m, Acc* c) {
  if (!kAccumulate) std::fill_n(c, ka * n, Acc(0));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t x = 0; x < ka; ++x) {
      const Acc ax = a[i][x];
      Acc* cx = c + x * n;
      for (int64_t j = 0; j < n; ++j) cx[j] += ax * d[i][j];
    }
  }
}

// c[i * q + j] = sum_{x < k} a[i * k + x] * bt[j * k + x] for i < m, j < q.
template <typename Acc>
void RowDotsGeneric(const Acc* a, int64_t m, int64_t k, const Acc* bt, int64_t q, Acc* c) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < q; ++j) {
      Acc sum = 0;
      for (int64_t x = 0; x < k; ++x) sum += a[i * k + x] * bt[j * k + x];
      c[i * q + j] = sum;
    }
  }
}

// The backward's step at a leaf, both products of one dP:
//   d [m, n] (+)= dp [m, q] * bt [q, n]     (bt = G_{T-1}^T)
//   l [q, n]   = dp^T * p [m, n]
// d's elements sum over j, l's over i, in ascending order.
template <typename Acc>
void LeafGradientsGeneric(const Acc* dp, int64_t m, int64_t q, const Acc* bt, const Acc* p,
                          int64_t n, bool accumulate, Acc* d, Acc* l) {
  std::fill_n(l, q * n, Acc(0));
  for (int64_t i = 0; i < m; ++i) {
    Acc* di = d + i * n;
    if (!accumulate) std::fill_n(di, n, Acc(0));
    for (int64_t j = 0; j < q; ++j) {
      const Acc g = dp[i * q + j];
      const Acc* bj = bt + j * n;
      const Acc* pi = p + i * n;
      Acc* lj = l + j * n;
      for (int64_t x = 0; x < n; ++x) {
        di[x] += g * bj[x];
        lj[x] += g * pi[x];
      }
    }
  }
}

#ifdef TF_TTEMB_TT_AVX2
// ---------------------------------------------------------------------------
// float32, register tiles over a vector type V: F32x8 (AVX2) or F32x16
// (AVX-512, whose functions carry TF_TTEMB_AVX512; the tiles instantiated with
// it are inlined into TF_TTEMB_AVX512_FLATTEN entry points, never called
// from AVX2 code).

struct F32x8 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
};

// The tiles' __m512 arguments and results never cross a call (every use is
// inlined into an AVX-512 function), so GCC's note that passing them without
// AVX-512 enabled would change the ABI does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

struct F32x16 {
  using V = __m512;
  static constexpr int kLanes = 16;
  TF_TTEMB_AVX512 static V Zero() { return _mm512_setzero_ps(); }
  TF_TTEMB_AVX512 static V Load(const float* p) { return _mm512_loadu_ps(p); }
  TF_TTEMB_AVX512 static V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  TF_TTEMB_AVX512 static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  TF_TTEMB_AVX512 static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
};

// Calls columns(mr, nv, col), mr and nv std::integral_constant<int, ...>, for the
// column blocks [col, col + nv lanes of F) that cover [col0, n): blocks of 4, then 2,
// then 1 vectors, with MR4, MR2 and MR1 rows per tile. Returns the first column not
// covered (n % F::kLanes columns are left).
template <typename F, int MR4, int MR2, int MR1, typename Columns>
inline int64_t ForColumnBlocks(int64_t n, int64_t col0, Columns columns) {
  constexpr int L = F::kLanes;
  int64_t col = col0;
  for (; col + 4 * L <= n; col += 4 * L) {
    columns(std::integral_constant<int, MR4>(), std::integral_constant<int, 4>(), col);
  }
  for (; col + 2 * L <= n; col += 2 * L) {
    columns(std::integral_constant<int, MR2>(), std::integral_constant<int, 2>(), col);
  }
  for (; col + L <= n; col += L) {
    columns(std::integral_constant<int, MR1>(), std::integral_constant<int, 1>(), col);
  }
  return col;
}

// Rows [row, row + MR) x columns [col, col + NV lanes) of RowsTimes.
template <typename F, int MR, int NV, bool kAccumulate>
inline void RowsTimesTile(const float* const* a, int64_t k, const float* b, int64_t n,
                          float* const* c, int64_t col) {
  using V = typename F::V;
  constexpr int L = F::kLanes;
  V acc[MR][NV];
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) acc[r][v] = kAccumulate ? F::Load(c[r] + col + L * v) : F::Zero();
  }
  const float* bx = b + col;
  for (int64_t x = 0; x < k; ++x, bx += n) {
    V bv[NV];
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) bv[v] = F::Load(bx + L * v);
    TF_TTEMB_UNROLL
    for (int r = 0; r < MR; ++r) {
      const V ar = F::Broadcast(a[r] + x);
      TF_TTEMB_UNROLL
      for (int v = 0; v < NV; ++v) acc[r][v] = F::Fma(ar, bv[v], acc[r][v]);
    }
  }
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) F::Store(c[r] + col + L * v, acc[r][v]);
  }
}

// All m rows for columns [col, col + NV lanes): tiles of MR rows, then the
// rest.
template <typename F, int MR, int NV, bool kAccumulate>
inline void RowsTimesColumns(const float* const* a, int64_t m, int64_t k, const float* b, int64_t n,
                             float* const* c, int64_t col) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) RowsTimesTile<F, MR, NV, kAccumulate>(a + i, k, b, n, c + i, col);
  if constexpr (MR > 1) {
    const int64_t rest = m - i;
    if (rest > 0) {
      // A tile of `rest` < MR rows: the largest power of two first.
      if constexpr (MR > 4) {
        if (rest >= 4) {
          RowsTimesTile<F, 4, NV, kAccumulate>(a + i, k, b, n, c + i, col);
          RowsTimesColumns<F, 4, NV, kAccumulate>(a + i + 4, rest - 4, k, b, n, c + i + 4, col);
          return;
        }
      }
      if constexpr (MR > 2) {
        if (rest >= 2) {
          RowsTimesTile<F, 2, NV, kAccumulate>(a + i, k, b, n, c + i, col);
          RowsTimesColumns<F, 2, NV, kAccumulate>(a + i + 2, rest - 2, k, b, n, c + i + 2, col);
          return;
        }
      }
      RowsTimesTile<F, 1, NV, kAccumulate>(a + i, k, b, n, c + i, col);
    }
  }
}

// n % 8 == 0, from column col0. Column blocks of 32 (3 rows per tile), then 16
// (6 rows), then 8 (8 rows): 8 to 12 accumulators per tile.
template <bool kAccumulate>
void RowsTimesAvx2(const float* const* a, int64_t m, int64_t k, const float* b, int64_t n,
                   float* const* c, int64_t col0 = 0) {
  ForColumnBlocks<F32x8, 3, 6, 8>(n, col0, [&](auto mr, auto nv, int64_t col) {
    RowsTimesColumns<F32x8, decltype(mr)::value, decltype(nv)::value, kAccumulate>(a, m, k, b, n, c,
                                                                                   col);
  });
}

// n % 8 == 0, AVX-512. Column blocks of 64 (6 rows per tile), 32 (8 rows),
// 16 (8 rows): 8 to 24 accumulators, and at most 8 row pointers (more do not
// fit the general registers); the last 8 columns as RowsTimesAvx2.
template <bool kAccumulate>
TF_TTEMB_AVX512_FLATTEN void RowsTimesAvx512(const float* const* a, int64_t m, int64_t k,
                                             const float* b, int64_t n, float* const* c) {
  const int64_t done = ForColumnBlocks<F32x16, 6, 8, 8>(n, 0, [&](auto mr, auto nv, int64_t col) {
    RowsTimesColumns<F32x16, decltype(mr)::value, decltype(nv)::value, kAccumulate>(a, m, k, b, n,
                                                                                    c, col);
  });
  RowsTimesAvx2<kAccumulate>(a, m, k, b, n, c, done);
}

// Rows [x0, x0 + MR) x columns [col, col + NV lanes) of TransposedRowsTimesRows.
template <typename F, int MR, int NV, bool kAccumulate>
inline void TransposedTile(const float* const* a, int64_t x0, const float* const* d, int64_t n,
                           int64_t m, float* c, int64_t col) {
  using V = typename F::V;
  constexpr int L = F::kLanes;
  V acc[MR][NV];
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = kAccumulate ? F::Load(c + (x0 + r) * n + col + L * v) : F::Zero();
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    const float* di = d[i] + col;
    const float* ai = a[i] + x0;
    // The MR broadcasts stay in registers and each vector of d is loaded
    // once: MR NV accumulators + MR + 1 fit the registers.
    V ar[MR];
    TF_TTEMB_UNROLL
    for (int r = 0; r < MR; ++r) ar[r] = F::Broadcast(ai + r);
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) {
      const V dv = F::Load(di + L * v);
      TF_TTEMB_UNROLL
      for (int r = 0; r < MR; ++r) acc[r][v] = F::Fma(ar[r], dv, acc[r][v]);
    }
  }
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) F::Store(c + (x0 + r) * n + col + L * v, acc[r][v]);
  }
}

template <typename F, int MR, int NV, bool kAccumulate>
inline void TransposedColumns(const float* const* a, int64_t ka, const float* const* d, int64_t n,
                              int64_t m, float* c, int64_t col) {
  int64_t x = 0;
  for (; x + MR <= ka; x += MR) TransposedTile<F, MR, NV, kAccumulate>(a, x, d, n, m, c, col);
  if constexpr (MR > 1) {
    for (; x + 2 <= ka; x += 2) TransposedTile<F, 2, NV, kAccumulate>(a, x, d, n, m, c, col);
    if (x < ka) TransposedTile<F, 1, NV, kAccumulate>(a, x, d, n, m, c, col);
  }
}

// n % 8 == 0, from column col0: the RowsTimesAvx2 blocks.
template <bool kAccumulate>
void TransposedBlockAvx2(const float* const* a, int64_t ka, const float* const* d, int64_t n,
                         int64_t m, float* c, int64_t col0 = 0) {
  ForColumnBlocks<F32x8, 3, 6, 8>(n, col0, [&](auto mr, auto nv, int64_t col) {
    TransposedColumns<F32x8, decltype(mr)::value, decltype(nv)::value, kAccumulate>(a, ka, d, n, m,
                                                                                    c, col);
  });
}

// AVX-512: 12 to 16 accumulators, MR broadcasts and one vector of d per tile;
// the last 8 columns as TransposedBlockAvx2.
template <bool kAccumulate>
TF_TTEMB_AVX512_FLATTEN void TransposedBlockAvx512(const float* const* a, int64_t ka,
                                                   const float* const* d, int64_t n, int64_t m,
                                                   float* c) {
  const int64_t done = ForColumnBlocks<F32x16, 4, 8, 12>(n, 0, [&](auto mr, auto nv, int64_t col) {
    TransposedColumns<F32x16, decltype(mr)::value, decltype(nv)::value, kAccumulate>(a, ka, d, n, m,
                                                                                     c, col);
  });
  TransposedBlockAvx2<kAccumulate>(a, ka, d, n, m, c, done);
}

// n % 8 == 0. The summed rows go in blocks of kTransposedBlock, so that the
// rows of d that every tile of c reads again stay in the L1 cache.
constexpr int64_t kTransposedBlock = 32;

template <bool kAccumulate>
void TransposedRowsTimesRowsBlocked(const float* const* a, int64_t ka, const float* const* d,
                                    int64_t n, int64_t m, float* c) {
  const bool avx512 = CpuHasAvx512();
  for (int64_t i = 0; i < m; i += kTransposedBlock) {
    const int64_t rows = std::min(kTransposedBlock, m - i);
    const bool add = kAccumulate || i > 0;
    if (avx512) {
      add ? TransposedBlockAvx512<true>(a + i, ka, d + i, n, rows, c)
          : TransposedBlockAvx512<false>(a + i, ka, d + i, n, rows, c);
    } else {
      add ? TransposedBlockAvx2<true>(a + i, ka, d + i, n, rows, c)
          : TransposedBlockAvx2<false>(a + i, ka, d + i, n, rows, c);
    }
  }
}

// The sum of a vector's 8 lanes, in the order RowDots uses for every output.
inline float LaneSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Rows [i, i + R) x outputs [j, j + J) of RowDots (k % 8 == 0).
template <int R, int J>
inline void DotsTile(const float* a, int64_t k, const float* bt, int64_t q, float* c) {
  __m256 acc[R][J];
  TF_TTEMB_UNROLL
  for (int r = 0; r < R; ++r) {
    TF_TTEMB_UNROLL
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  for (int64_t x = 0; x < k; x += 8) {
    __m256 av[R];
    TF_TTEMB_UNROLL
    for (int r = 0; r < R; ++r) av[r] = _mm256_loadu_ps(a + r * k + x);
    TF_TTEMB_UNROLL
    for (int j = 0; j < J; ++j) {
      const __m256 bv = _mm256_loadu_ps(bt + j * k + x);
      TF_TTEMB_UNROLL
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(av[r], bv, acc[r][j]);
    }
  }
  TF_TTEMB_UNROLL
  for (int r = 0; r < R; ++r) {
    if constexpr (J == 4) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                      _mm256_hadd_ps(acc[r][2], acc[r][3]));
      _mm_storeu_ps(c + r * q, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    } else {
      TF_TTEMB_UNROLL
      for (int j = 0; j < J; ++j) c[r * q + j] = LaneSum(acc[r][j]);
    }
  }
}

template <int J>
inline void DotsColumns(const float* a, int64_t m, int64_t k, const float* bt, int64_t q,
                        float* c) {
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) DotsTile<2, J>(a + i * k, k, bt, q, c + i * q);
  if (i < m) DotsTile<1, J>(a + i * k, k, bt, q, c + i * q);
}

// k % 8 == 0; outputs [j0, q).
inline void RowDotsAvx2(const float* a, int64_t m, int64_t k, const float* bt, int64_t q, float* c,
                        int64_t j0 = 0) {
  int64_t j = j0;
  for (; j + 4 <= q; j += 4) DotsColumns<4>(a, m, k, bt + j * k, q, c + j);
  switch (q - j) {
    case 3:
      DotsColumns<3>(a, m, k, bt + j * k, q, c + j);
      break;
    case 2:
      DotsColumns<2>(a, m, k, bt + j * k, q, c + j);
      break;
    case 1:
      DotsColumns<1>(a, m, k, bt + j * k, q, c + j);
      break;
    default:
      break;
  }
}

// Rows [i, i + 2P) x outputs [j, j + 4) of RowDots on AVX-512, with DotsTile's
// bits: each vector holds a pair of rows' 8-lane sums (rows 2p and 2p + 1 in
// its low and high 256 bits), which take the same fma chains as DotsTile's;
// the lane sums repeat _mm256_hadd_ps's additions (a shuffle of the even and
// of the odd lanes, added) and DotsTile's final sum of the two 128-bit halves.
template <int P>
TF_TTEMB_AVX512 inline void DotsPairs512(const float* a, int64_t k, const float* bt, int64_t q,
                                         float* c) {
  __m512 acc[P][4];
  TF_TTEMB_UNROLL
  for (int p = 0; p < P; ++p) {
    TF_TTEMB_UNROLL
    for (int j = 0; j < 4; ++j) acc[p][j] = _mm512_setzero_ps();
  }
  for (int64_t x = 0; x < k; x += 8) {
    __m512 av[P];
    TF_TTEMB_UNROLL
    for (int p = 0; p < P; ++p) {
      const __m256d low = _mm256_castps_pd(_mm256_loadu_ps(a + 2 * p * k + x));
      const __m256d high = _mm256_castps_pd(_mm256_loadu_ps(a + (2 * p + 1) * k + x));
      av[p] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(low), high, 1));
    }
    TF_TTEMB_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m512 bv = _mm512_castpd_ps(
          _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(bt + j * k + x))));
      TF_TTEMB_UNROLL
      for (int p = 0; p < P; ++p) acc[p][j] = _mm512_fmadd_ps(av[p], bv, acc[p][j]);
    }
  }
  const auto hadd = [](__m512 u, __m512 v) TF_TTEMB_AVX512 {
    return _mm512_add_ps(_mm512_shuffle_ps(u, v, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(u, v, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  TF_TTEMB_UNROLL
  for (int p = 0; p < P; ++p) {
    const __m512 h = hadd(hadd(acc[p][0], acc[p][1]), hadd(acc[p][2], acc[p][3]));
    // Lanes [0, 4) and [8, 12): each row's two 128-bit halves added.
    const __m512 sum = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm_storeu_ps(c + 2 * p * q, _mm512_castps512_ps128(sum));
    _mm_storeu_ps(c + (2 * p + 1) * q, _mm512_extractf32x4_ps(sum, 2));
  }
}

// k % 8 == 0, AVX-512: outputs 4 at a time by pairs of rows (8 rows a tile),
// an odd last row and the last q % 4 outputs as RowDotsAvx2.
TF_TTEMB_AVX512_FLATTEN inline void RowDotsAvx512(const float* a, int64_t m, int64_t k,
                                                  const float* bt, int64_t q, float* c) {
  int64_t j = 0;
  for (; j + 4 <= q; j += 4) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) DotsPairs512<4>(a + i * k, k, bt + j * k, q, c + i * q + j);
    for (; i + 2 <= m; i += 2) DotsPairs512<1>(a + i * k, k, bt + j * k, q, c + i * q + j);
    if (i < m) DotsTile<1, 4>(a + i * k, k, bt + j * k, q, c + i * q + j);
  }
  RowDotsAvx2(a, m, k, bt, q, c, j);
}

// dst [n, m] = src [m, n]^T for m % 8 == 0 and n % 8 == 0, by 8 x 8 blocks.
inline void TransposeAvx2(const float* src, int64_t m, int64_t n, float* dst) {
  for (int64_t i = 0; i < m; i += 8) {
    for (int64_t j = 0; j < n; j += 8) {
      __m256 r[8];
      TF_TTEMB_UNROLL
      for (int t = 0; t < 8; ++t) r[t] = _mm256_loadu_ps(src + (i + t) * n + j);
      __m256 u[8];
      TF_TTEMB_UNROLL
      for (int t = 0; t < 4; ++t) {
        u[2 * t] = _mm256_unpacklo_ps(r[2 * t], r[2 * t + 1]);
        u[2 * t + 1] = _mm256_unpackhi_ps(r[2 * t], r[2 * t + 1]);
      }
      __m256 v[8];
      TF_TTEMB_UNROLL
      for (int t = 0; t < 2; ++t) {
        v[4 * t] = _mm256_shuffle_ps(u[4 * t], u[4 * t + 2], 0x44);
        v[4 * t + 1] = _mm256_shuffle_ps(u[4 * t], u[4 * t + 2], 0xEE);
        v[4 * t + 2] = _mm256_shuffle_ps(u[4 * t + 1], u[4 * t + 3], 0x44);
        v[4 * t + 3] = _mm256_shuffle_ps(u[4 * t + 1], u[4 * t + 3], 0xEE);
      }
      TF_TTEMB_UNROLL
      for (int t = 0; t < 4; ++t) {
        _mm256_storeu_ps(dst + (j + t) * m + i, _mm256_permute2f128_ps(v[t], v[t + 4], 0x20));
        _mm256_storeu_ps(dst + (j + t + 4) * m + i, _mm256_permute2f128_ps(v[t], v[t + 4], 0x31));
      }
    }
  }
}

// LeafGradients for Q = q (<= 4) columns of dp at a time, columns
// [col, col + Q) of dp (and rows of bt and l), and the columns [x0, x1) of d,
// l and p, (x1 - x0) % (NV lanes) == 0: per NV vectors of columns, bt's Q NV
// vectors and l's Q NV accumulators stay in registers, and every broadcast of
// dp feeds both products.
template <typename F, int Q, int NV>
inline void LeafGradientsTile(const float* dp, int64_t m, int64_t q, int64_t col, const float* bt,
                              const float* p, int64_t n, bool accumulate, float* d, float* l,
                              int64_t x0, int64_t x1) {
  using V = typename F::V;
  constexpr int L = F::kLanes;
  for (int64_t x = x0; x < x1; x += L * NV) {
    V g[Q][NV];
    V acc[Q][NV];
    TF_TTEMB_UNROLL
    for (int j = 0; j < Q; ++j) {
      TF_TTEMB_UNROLL
      for (int v = 0; v < NV; ++v) {
        g[j][v] = F::Load(bt + (col + j) * n + x + L * v);
        acc[j][v] = F::Zero();
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* dpi = dp + i * q + col;
      V pv[NV], dv[NV];
      TF_TTEMB_UNROLL
      for (int v = 0; v < NV; ++v) {
        pv[v] = F::Load(p + i * n + x + L * v);
        dv[v] = accumulate ? F::Load(d + i * n + x + L * v) : F::Zero();
      }
      TF_TTEMB_UNROLL
      for (int j = 0; j < Q; ++j) {
        const V b = F::Broadcast(dpi + j);
        TF_TTEMB_UNROLL
        for (int v = 0; v < NV; ++v) {
          acc[j][v] = F::Fma(b, pv[v], acc[j][v]);
          dv[v] = F::Fma(b, g[j][v], dv[v]);
        }
      }
      TF_TTEMB_UNROLL
      for (int v = 0; v < NV; ++v) F::Store(d + i * n + x + L * v, dv[v]);
    }
    TF_TTEMB_UNROLL
    for (int j = 0; j < Q; ++j) {
      TF_TTEMB_UNROLL
      for (int v = 0; v < NV; ++v) F::Store(l + (col + j) * n + x + L * v, acc[j][v]);
    }
  }
}

// n % 8 == 0: all of d's and l's columns, 8 at a time.
template <int Q>
void LeafGradientsAvx2(const float* dp, int64_t m, int64_t q, int64_t col, const float* bt,
                       const float* p, int64_t n, bool accumulate, float* d, float* l) {
  LeafGradientsTile<F32x8, Q, 1>(dp, m, q, col, bt, p, n, accumulate, d, l, 0, n);
}

// n % 8 == 0, AVX-512: 32 columns at a time, then 16, then 8.
template <int Q>
TF_TTEMB_AVX512_FLATTEN void LeafGradientsAvx512(const float* dp, int64_t m, int64_t q, int64_t col,
                                                 const float* bt, const float* p, int64_t n,
                                                 bool accumulate, float* d, float* l) {
  const int64_t x32 = n / 32 * 32, x16 = n / 16 * 16;
  LeafGradientsTile<F32x16, Q, 2>(dp, m, q, col, bt, p, n, accumulate, d, l, 0, x32);
  LeafGradientsTile<F32x16, Q, 1>(dp, m, q, col, bt, p, n, accumulate, d, l, x32, x16);
  LeafGradientsTile<F32x8, Q, 1>(dp, m, q, col, bt, p, n, accumulate, d, l, x16, n);
}

#pragma GCC diagnostic pop

template <int Q>
void LeafGradientsColumns(bool avx512, const float* dp, int64_t m, int64_t q, int64_t col,
                          const float* bt, const float* p, int64_t n, bool accumulate, float* d,
                          float* l) {
  if (avx512) {
    LeafGradientsAvx512<Q>(dp, m, q, col, bt, p, n, accumulate, d, l);
  } else {
    LeafGradientsAvx2<Q>(dp, m, q, col, bt, p, n, accumulate, d, l);
  }
}
#endif  // TF_TTEMB_TT_AVX2

// ---------------------------------------------------------------------------
// The products the kernels call: the register-blocked float versions where
// they apply, else the generic ones.

// Whether the float32 register-blocked products handle a vectorised width n
// (RowsTimes, TransposedRowsTimesRows) or a contracted length k (RowDots).
template <typename Acc>
constexpr bool Blocked(int64_t width) {
#ifdef TF_TTEMB_TT_AVX2
  return std::is_same<Acc, float>::value && width % 8 == 0;
#else
  return false;
#endif
}

// c[i][0, n) (+)= a[i][0, k) * b for i < m, b [k, n] row-major.
template <bool kAccumulate, typename Acc>
void RowsTimes(const Acc* const* a, int64_t m, int64_t k, const Acc* b, int64_t n, Acc* const* c) {
#ifdef TF_TTEMB_TT_AVX2
  if constexpr (std::is_same<Acc, float>::value) {
    if (Blocked<Acc>(n)) {
      if (CpuHasAvx512()) return RowsTimesAvx512<kAccumulate>(a, m, k, b, n, c);
      return RowsTimesAvx2<kAccumulate>(a, m, k, b, n, c);
    }
  }
#endif
  RowsTimesGeneric<kAccumulate>(a, m, k, b, n, c);
}

// c [ka, n] (+)= sum_{i < m} a[i][0, ka)^T d[i][0, n).
template <bool kAccumulate, typename Acc>
void TransposedRowsTimesRows(const Acc* const* a, int64_t ka, const Acc* const* d, int64_t n,
                             int64_t m, Acc* c) {
#ifdef TF_TTEMB_TT_AVX2
  if constexpr (std::is_same<Acc, float>::value) {
    if (Blocked<Acc>(n)) return TransposedRowsTimesRowsBlocked<kAccumulate>(a, ka, d, n, m, c);
  }
#endif
  TransposedRowsTimesRowsGeneric<kAccumulate>(a, ka, d, n, m, c);
}

// c [m, q] = a [m, k] * bt^T, bt [q, k] row-major (a and c contiguous).
template <typename Acc>
void RowDots(const Acc* a, int64_t m, int64_t k, const Acc* bt, int64_t q, Acc* c) {
#ifdef TF_TTEMB_TT_AVX2
  if constexpr (std::is_same<Acc, float>::value) {
    if (Blocked<Acc>(k)) {
      return CpuHasAvx512() ? RowDotsAvx512(a, m, k, bt, q, c) : RowDotsAvx2(a, m, k, bt, q, c);
    }
  }
#endif
  RowDotsGeneric(a, m, k, bt, q, c);
}

// dst [n, m] = src [m, n]^T.
template <typename Acc>
void Transpose(const Acc* src, int64_t m, int64_t n, Acc* dst) {
#ifdef TF_TTEMB_TT_AVX2
  if constexpr (std::is_same<Acc, float>::value) {
    if (m % 8 == 0 && n % 8 == 0) return TransposeAvx2(src, m, n, dst);
  }
#endif
  TransposeGeneric(src, m, n, dst);
}

// d [m, n] (+)= dp [m, q] * bt [q, n] and l [q, n] = dp^T * p [m, n]
// (dp, d, p, l contiguous).
template <typename Acc>
void LeafGradients(const Acc* dp, int64_t m, int64_t q, const Acc* bt, const Acc* p, int64_t n,
                   bool accumulate, Acc* d, Acc* l) {
#ifdef TF_TTEMB_TT_AVX2
  if constexpr (std::is_same<Acc, float>::value) {
    if (Blocked<Acc>(n)) {
      const bool avx512 = CpuHasAvx512();
      for (int64_t col = 0; col < q; col += 4) {
        const bool add = accumulate || col > 0;
        switch (std::min<int64_t>(4, q - col)) {
          case 4:
            LeafGradientsColumns<4>(avx512, dp, m, q, col, bt, p, n, add, d, l);
            break;
          case 3:
            LeafGradientsColumns<3>(avx512, dp, m, q, col, bt, p, n, add, d, l);
            break;
          case 2:
            LeafGradientsColumns<2>(avx512, dp, m, q, col, bt, p, n, add, d, l);
            break;
          default:
            LeafGradientsColumns<1>(avx512, dp, m, q, col, bt, p, n, add, d, l);
            break;
        }
      }
      return;
    }
  }
#endif
  LeafGradientsGeneric(dp, m, q, bt, p, n, accumulate, d, l);
}

}  // namespace tt_math
}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_MATH_H_
