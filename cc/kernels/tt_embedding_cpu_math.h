// The matrix products of the TT CPU kernels (tt_embedding_cpu.h),
// on matrices given as arrays of row pointers, so that the rows of a prefix
// tree's nodes are used where they lie, never gathered into a copy first.
// Plain C++ (no TensorFlow headers).
//
// Every product has one generic version (any element type and size: loops over
// contiguous rows that the compiler vectorises) and, for float with AVX2+FMA
// (configure.sh compiles for the build machine's CPU), register-blocked
// versions used when the vectorised width is a multiple of 8 (every rank that
// is a multiple of 8):
//   RowsTimes                  the forward's P_k = P_{k-1} G_k and the
//                              backward's dP_{k-1} = dP_k G_k^T: a tile of
//                              MR rows x 8 NV columns of C in registers, the
//                              contraction (k) innermost;
//   TransposedRowsTimesRows    the core gradients dG_k = P_{k-1}^T dP_k: a tile
//                              of C in registers, the summed rows innermost;
//   RowDots                    the last core's products, whose output is only
//                              q_{T-1} columns wide: dot products of length k;
//   LeafGradients              the backward's two products at a leaf, dP_m's
//                              part G_{T-1}^T dP_leaf and core T-1's block
//                              P_m^T dP_leaf, from one broadcast of dP_leaf;
//   Transpose                  8 x 8 blocks.
// Each output element is one chain of fused multiply-adds over the contracted
// index in ascending order, started from 0 or from the element's old value;
// which tile computed it does not change its bits, so a product is bitwise the
// same whatever rows it was batched with.

#ifndef TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_MATH_H_
#define TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_MATH_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
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
// float32, AVX2 + FMA.

// Rows [row, row + MR) x columns [col, col + 8 NV) of RowsTimes.
template <int MR, int NV, bool kAccumulate>
inline void RowsTimesTile(const float* const* a, int64_t k, const float* b, int64_t n,
                          float* const* c, int64_t col) {
  __m256 acc[MR][NV];
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = kAccumulate ? _mm256_loadu_ps(c[r] + col + 8 * v) : _mm256_setzero_ps();
    }
  }
  const float* bx = b + col;
  for (int64_t x = 0; x < k; ++x, bx += n) {
    __m256 bv[NV];
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(bx + 8 * v);
    TF_TTEMB_UNROLL
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a[r] + x);
      TF_TTEMB_UNROLL
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c[r] + col + 8 * v, acc[r][v]);
  }
}

// All m rows for columns [col, col + 8 NV): tiles of MR rows, then the rest.
template <int MR, int NV, bool kAccumulate>
inline void RowsTimesColumns(const float* const* a, int64_t m, int64_t k, const float* b, int64_t n,
                             float* const* c, int64_t col) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) RowsTimesTile<MR, NV, kAccumulate>(a + i, k, b, n, c + i, col);
  if constexpr (MR > 1) {
    const int64_t rest = m - i;
    if (rest > 0) {
      // A tile of `rest` < MR rows: the largest power of two first.
      if constexpr (MR > 4) {
        if (rest >= 4) {
          RowsTimesTile<4, NV, kAccumulate>(a + i, k, b, n, c + i, col);
          RowsTimesColumns<4, NV, kAccumulate>(a + i + 4, rest - 4, k, b, n, c + i + 4, col);
          return;
        }
      }
      if constexpr (MR > 2) {
        if (rest >= 2) {
          RowsTimesTile<2, NV, kAccumulate>(a + i, k, b, n, c + i, col);
          RowsTimesColumns<2, NV, kAccumulate>(a + i + 2, rest - 2, k, b, n, c + i + 2, col);
          return;
        }
      }
      RowsTimesTile<1, NV, kAccumulate>(a + i, k, b, n, c + i, col);
    }
  }
}

// n % 8 == 0. Column blocks of 32 (3 rows per tile), then 16 (6 rows), then 8
// (8 rows): 8 to 12 accumulators per tile.
template <bool kAccumulate>
void RowsTimesAvx2(const float* const* a, int64_t m, int64_t k, const float* b, int64_t n,
                   float* const* c) {
  int64_t col = 0;
  for (; col + 32 <= n; col += 32) RowsTimesColumns<3, 4, kAccumulate>(a, m, k, b, n, c, col);
  for (; col + 16 <= n; col += 16) RowsTimesColumns<6, 2, kAccumulate>(a, m, k, b, n, c, col);
  for (; col + 8 <= n; col += 8) RowsTimesColumns<8, 1, kAccumulate>(a, m, k, b, n, c, col);
}

// Rows [x0, x0 + MR) x columns [col, col + 8 NV) of TransposedRowsTimesRows.
template <int MR, int NV, bool kAccumulate>
inline void TransposedTile(const float* const* a, int64_t x0, const float* const* d, int64_t n,
                           int64_t m, float* c, int64_t col) {
  __m256 acc[MR][NV];
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) {
      acc[r][v] =
          kAccumulate ? _mm256_loadu_ps(c + (x0 + r) * n + col + 8 * v) : _mm256_setzero_ps();
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    const float* di = d[i] + col;
    const float* ai = a[i] + x0;
    // The MR broadcasts stay in registers and each vector of d is loaded
    // once: 12 accumulators + 3 + 1 fit the 16 registers.
    __m256 ar[MR];
    TF_TTEMB_UNROLL
    for (int r = 0; r < MR; ++r) ar[r] = _mm256_broadcast_ss(ai + r);
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) {
      const __m256 dv = _mm256_loadu_ps(di + 8 * v);
      TF_TTEMB_UNROLL
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_fmadd_ps(ar[r], dv, acc[r][v]);
    }
  }
  TF_TTEMB_UNROLL
  for (int r = 0; r < MR; ++r) {
    TF_TTEMB_UNROLL
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + (x0 + r) * n + col + 8 * v, acc[r][v]);
  }
}

template <int MR, int NV, bool kAccumulate>
inline void TransposedColumns(const float* const* a, int64_t ka, const float* const* d, int64_t n,
                              int64_t m, float* c, int64_t col) {
  int64_t x = 0;
  for (; x + MR <= ka; x += MR) TransposedTile<MR, NV, kAccumulate>(a, x, d, n, m, c, col);
  if constexpr (MR > 1) {
    for (; x + 2 <= ka; x += 2) TransposedTile<2, NV, kAccumulate>(a, x, d, n, m, c, col);
    if (x < ka) TransposedTile<1, NV, kAccumulate>(a, x, d, n, m, c, col);
  }
}

template <bool kAccumulate>
void TransposedBlock(const float* const* a, int64_t ka, const float* const* d, int64_t n, int64_t m,
                     float* c) {
  int64_t col = 0;
  for (; col + 32 <= n; col += 32) TransposedColumns<3, 4, kAccumulate>(a, ka, d, n, m, c, col);
  for (; col + 16 <= n; col += 16) TransposedColumns<6, 2, kAccumulate>(a, ka, d, n, m, c, col);
  for (; col + 8 <= n; col += 8) TransposedColumns<8, 1, kAccumulate>(a, ka, d, n, m, c, col);
}

// n % 8 == 0. The summed rows go in blocks of kTransposedBlock, so that the
// rows of d that every tile of c reads again stay in the L1 cache.
constexpr int64_t kTransposedBlock = 32;

template <bool kAccumulate>
void TransposedRowsTimesRowsAvx2(const float* const* a, int64_t ka, const float* const* d,
                                 int64_t n, int64_t m, float* c) {
  for (int64_t i = 0; i < m; i += kTransposedBlock) {
    const int64_t rows = std::min(kTransposedBlock, m - i);
    if (kAccumulate || i > 0) {
      TransposedBlock<true>(a + i, ka, d + i, n, rows, c);
    } else {
      TransposedBlock<false>(a + i, ka, d + i, n, rows, c);
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

// k % 8 == 0.
inline void RowDotsAvx2(const float* a, int64_t m, int64_t k, const float* bt, int64_t q,
                        float* c) {
  int64_t j = 0;
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
// [col, col + Q) of dp (and rows of bt and l), n % 8 == 0: per 8 columns of
// d, l and p, bt's Q vectors and l's Q accumulators stay in registers, and
// every broadcast of dp feeds both products.
template <int Q>
inline void LeafGradientsAvx2(const float* dp, int64_t m, int64_t q, int64_t col, const float* bt,
                              const float* p, int64_t n, bool accumulate, float* d, float* l) {
  for (int64_t x = 0; x < n; x += 8) {
    __m256 g[Q];
    __m256 acc[Q];
    TF_TTEMB_UNROLL
    for (int j = 0; j < Q; ++j) {
      g[j] = _mm256_loadu_ps(bt + (col + j) * n + x);
      acc[j] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* dpi = dp + i * q + col;
      const __m256 pv = _mm256_loadu_ps(p + i * n + x);
      __m256 dv = accumulate ? _mm256_loadu_ps(d + i * n + x) : _mm256_setzero_ps();
      TF_TTEMB_UNROLL
      for (int j = 0; j < Q; ++j) {
        const __m256 b = _mm256_broadcast_ss(dpi + j);
        acc[j] = _mm256_fmadd_ps(b, pv, acc[j]);
        dv = _mm256_fmadd_ps(b, g[j], dv);
      }
      _mm256_storeu_ps(d + i * n + x, dv);
    }
    TF_TTEMB_UNROLL
    for (int j = 0; j < Q; ++j) _mm256_storeu_ps(l + (col + j) * n + x, acc[j]);
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
    if (Blocked<Acc>(n)) return RowsTimesAvx2<kAccumulate>(a, m, k, b, n, c);
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
    if (Blocked<Acc>(n)) return TransposedRowsTimesRowsAvx2<kAccumulate>(a, ka, d, n, m, c);
  }
#endif
  TransposedRowsTimesRowsGeneric<kAccumulate>(a, ka, d, n, m, c);
}

// c [m, q] = a [m, k] * bt^T, bt [q, k] row-major (a and c contiguous).
template <typename Acc>
void RowDots(const Acc* a, int64_t m, int64_t k, const Acc* bt, int64_t q, Acc* c) {
#ifdef TF_TTEMB_TT_AVX2
  if constexpr (std::is_same<Acc, float>::value) {
    if (Blocked<Acc>(k)) return RowDotsAvx2(a, m, k, bt, q, c);
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
      for (int64_t col = 0; col < q; col += 4) {
        const bool add = accumulate || col > 0;
        switch (std::min<int64_t>(4, q - col)) {
          case 4:
            LeafGradientsAvx2<4>(dp, m, q, col, bt, p, n, add, d, l);
            break;
          case 3:
            LeafGradientsAvx2<3>(dp, m, q, col, bt, p, n, add, d, l);
            break;
          case 2:
            LeafGradientsAvx2<2>(dp, m, q, col, bt, p, n, add, d, l);
            break;
          default:
            LeafGradientsAvx2<1>(dp, m, q, col, bt, p, n, add, d, l);
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
