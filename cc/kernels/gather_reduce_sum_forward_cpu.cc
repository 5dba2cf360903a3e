// CPU kernels of the gather_reduce_sum forward (GatherReduceSum and
// ResourceGatherReduceSum, through ForwardLaunch<CpuDevice>; the OpKernel is
// gather_reduce_sum_forward_op.h's) and CheckBagReport: bags are split into blocks of about equal
// entry count; each block runs on one thread of TF's CPU pool and accumulates one bag at a time
// into a [D] float (double for float64) buffer, so no [nnz, D] tensor is ever built.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cc/kernels/check_report_op.h"
#include "cc/kernels/cpu_isa.h"
#include "cc/kernels/gather_reduce_sum_cpu.h"
#include "cc/kernels/gather_reduce_sum_forward_op.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace tf_ttemb {
namespace {

// ---------------------------------------------------------------------------
// Forward.
//
// Threads take blocks of whole bags (ForBalancedBlocks). Within a bag, the
// sum/mean/sqrtn path keeps the sums of up to kMaxVecs vectors of columns in
// registers while it walks the bag's entries once, then stores them: the
// columns of a bag are covered by chunks of kMaxVecs vectors, each chunk a
// pass over the entries (BagChunkSum). Every column is still the sequential
// sum over the entries of its block, with the same fused multiply-adds, so
// the result is bitwise the one of the one-column-at-a-time loop. The
// denominators of mean and sqrtn come from ComputeBagScale (the backward's),
// and a bag of scale 0 is never gathered. The max path walks the same chunks
// with a running max and its position per column in registers (BagChunkMax:
// half as many vectors per pass, two registers each), bitwise the scalar
// rule's result.

#if defined(__AVX2__) && defined(__FMA__)
#define TF_TTEMB_CPU_AVX2 1
#endif

#ifdef TF_TTEMB_CPU_AVX2

// Prefetches the row (or slice) of entry `ahead` as `pf` says, unless pf
// prefetches nothing, ahead >= prefetch_end or the entry is padding.
template <typename T, typename Tindex>
inline void PrefetchAhead(const T* params,    // [N, D]
                          const Tindex* ids,  // [nnz]
                          int64_t ahead, int64_t prefetch_end, const RowPrefetch& pf, int64_t dim,
                          const BagAttrs& attrs) {
  if (pf.bytes <= 0 || ahead >= prefetch_end) return;
  const int64_t id = static_cast<int64_t>(ids[ahead]);
  if (attrs.has_padding_id && id == attrs.padding_id) return;
  PrefetchBytes(params + id * dim + pf.col, pf.bytes, pf.level);
}

// A vector of 8 float or 4 double accumulators and the loads that widen a
// table's values into one, exactly (half and bfloat16 widen without rounding).
template <typename Acc>
struct Vec;

template <>
struct Vec<float> {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Set(float w) { return _mm256_set1_ps(w); }
  static V Fma(V w, V x, V acc) { return _mm256_fmadd_ps(w, x, acc); }
  static V Add(V acc, V x) { return _mm256_add_ps(acc, x); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static V Load(const Eigen::half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V Load(const bfloat16* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static __m256i Mask(int n) {  // the first n lanes
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // The first n < kLanes values; the other lanes are 0 and never read.
  static V LoadPartial(const float* p, int n) { return _mm256_maskload_ps(p, Mask(n)); }
  template <typename T>
  static V LoadPartial(const T* p, int n) {
    T tmp[kLanes] = {};
    std::memcpy(tmp, p, n * sizeof(T));
    return Load(tmp);
  }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void StorePartial(float* p, V v, int n) { _mm256_maskstore_ps(p, Mask(n), v); }
  // Where the max rule takes x over acc: x > acc (false for NaN), or x is NaN
  // and acc is not. Both are "not x <= acc" (true when either is NaN) while acc
  // is not NaN: two compares.
  static V Takes(V x, V acc) {
    return _mm256_and_ps(_mm256_cmp_ps(x, acc, _CMP_NLE_UQ), _mm256_cmp_ps(acc, acc, _CMP_ORD_Q));
  }
  static V Select(V mask, V a, V b) { return _mm256_blendv_ps(a, b, mask); }  // b where mask
  // Positions inside a bag, one int32 per lane.
  using P = __m256i;
  static P PosSet(int32 p) { return _mm256_set1_epi32(p); }
  static P PosSelect(V mask, P a, P b) {
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), mask));
  }
  static void PosStore(int32* p, P v, int n) {
    if (n == kLanes) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
    } else {
      _mm256_maskstore_epi32(p, Mask(n), v);
    }
  }
};

template <>
struct Vec<double> {
  using V = __m256d;
  static constexpr int kLanes = 4;
  static V Zero() { return _mm256_setzero_pd(); }
  static V Set(double w) { return _mm256_set1_pd(w); }
  static V Fma(V w, V x, V acc) { return _mm256_fmadd_pd(w, x, acc); }
  static V Add(V acc, V x) { return _mm256_add_pd(acc, x); }
  static V Load(const double* p) { return _mm256_loadu_pd(p); }
  static __m256i Mask(int n) {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
  }
  static V LoadPartial(const double* p, int n) { return _mm256_maskload_pd(p, Mask(n)); }
  static void Store(double* p, V v) { _mm256_storeu_pd(p, v); }
  static void StorePartial(double* p, V v, int n) { _mm256_maskstore_pd(p, Mask(n), v); }
  static V Takes(V x, V acc) {
    return _mm256_and_pd(_mm256_cmp_pd(x, acc, _CMP_NLE_UQ), _mm256_cmp_pd(acc, acc, _CMP_ORD_Q));
  }
  static V Select(V mask, V a, V b) { return _mm256_blendv_pd(a, b, mask); }
  // Positions held as doubles (exact below 2^53), converted to int32 on store.
  using P = __m256d;
  static P PosSet(int32 p) { return _mm256_set1_pd(static_cast<double>(p)); }
  static P PosSelect(V mask, P a, P b) { return _mm256_blendv_pd(a, b, mask); }
  static void PosStore(int32* p, P v, int n) {
    int32 tmp[kLanes];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), _mm256_cvttpd_epi32(v));
    std::memcpy(p, tmp, n * sizeof(int32));
  }
};

// Vectors of columns one pass over a bag's entries keeps in registers.
constexpr int kMaxVecs = 8;

// sums[0, kVecs * kLanes) (the last vector `tail` lanes when kTail) = the
// sequential sum over entries [begin, end) of w_j * params[ids_j][col, ...):
// fma(w, x, acc) weighted, acc + x unweighted, as the scalar loop compiles.
// Padding entries are skipped. With `prefetch_bytes` (the slice's size) > 0 it
// prefetches this pass's slice of the row of the entry kSliceRowsAhead entries
// ahead (SlicePrefetchFor; up to entry `prefetch_end`, which may lie in later
// bags) while it adds entry j.
template <int kVecs, bool kTail, bool kWeighted, typename T, typename Tindex,
          typename Acc>
inline void BagChunkSum(const T* params,    // [N, D]
                        const Tindex* ids,  // [nnz]
                        const T* weights,   // [nnz] when kWeighted
                        int64_t begin, int64_t end, int64_t prefetch_end, int64_t prefetch_bytes,
                        int64_t dim, int64_t col, int tail, const BagAttrs& attrs,
                        Acc* sums) {  // [kVecs * kLanes]
  using VA = Vec<Acc>;
  constexpr int kLanes = VA::kLanes;
  typename VA::V acc[kVecs];
  for (int v = 0; v < kVecs; ++v) acc[v] = VA::Zero();
  const bool padding = attrs.has_padding_id;
  const int64_t padding_id = attrs.padding_id;
  const RowPrefetch pf =
      SlicePrefetchFor(dim * static_cast<int64_t>(sizeof(T)), col, prefetch_bytes);
  for (int64_t j = begin; j < end; ++j) {
    const int64_t id = static_cast<int64_t>(ids[j]);
    PrefetchAhead(params, ids, j + pf.ahead, prefetch_end, pf, dim, attrs);
    if (padding && id == padding_id) continue;
    const T* row = params + id * dim + col;
    if (kWeighted) {
      const typename VA::V w = VA::Set(static_cast<Acc>(weights[j]));
      for (int v = 0; v < kVecs; ++v) {
        const typename VA::V x = (kTail && v == kVecs - 1) ? VA::LoadPartial(row + v * kLanes, tail)
                                                           : VA::Load(row + v * kLanes);
        acc[v] = VA::Fma(w, x, acc[v]);
      }
    } else {
      for (int v = 0; v < kVecs; ++v) {
        const typename VA::V x = (kTail && v == kVecs - 1) ? VA::LoadPartial(row + v * kLanes, tail)
                                                           : VA::Load(row + v * kLanes);
        acc[v] = VA::Add(acc[v], x);
      }
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    if (kTail && v == kVecs - 1) {
      VA::StorePartial(sums + v * kLanes, acc[v], tail);
    } else {
      VA::Store(sums + v * kLanes, acc[v]);
    }
  }
}

template <int kVecs, bool kWeighted, typename T, typename Tindex, typename Acc>
inline void BagChunkSumTail(const T* params, const Tindex* ids, const T* weights, int64_t begin,
                            int64_t end, int64_t prefetch_end, int64_t prefetch_bytes, int64_t dim,
                            int64_t col, int tail, const BagAttrs& attrs, Acc* sums) {
  if (tail == 0) {
    BagChunkSum<kVecs, false, kWeighted>(params, ids, weights, begin, end, prefetch_end,
                                         prefetch_bytes, dim, col, tail, attrs, sums);
  } else {
    BagChunkSum<kVecs, true, kWeighted>(params, ids, weights, begin, end, prefetch_end,
                                        prefetch_bytes, dim, col, tail, attrs, sums);
  }
}

// sums[0, dim) = the sequential sum over entries [begin, end) of the
// (weighted) rows, chunk by chunk of columns; each chunk's pass prefetches its
// own slice of the rows ahead, up to entry prefetch_end.
template <bool kWeighted, typename T, typename Tindex, typename Acc>
void BagSumAvx2(const T* params, const Tindex* ids, const T* weights, int64_t begin, int64_t end,
                int64_t prefetch_end, int64_t dim, const BagAttrs& attrs, Acc* sums) {
  constexpr int kLanes = Vec<Acc>::kLanes;
  constexpr int64_t kChunkBytes = kMaxVecs * kLanes * static_cast<int64_t>(sizeof(T));
  const int64_t vecs = (dim + kLanes - 1) / kLanes;
  const int tail = static_cast<int>(dim % kLanes);
  int64_t col = 0;
  int64_t left = vecs;
  for (; left > kMaxVecs; left -= kMaxVecs, col += kMaxVecs * kLanes) {
    BagChunkSum<kMaxVecs, false, kWeighted>(params, ids, weights, begin, end, prefetch_end,
                                            kChunkBytes, dim, col, 0, attrs, sums + col);
  }
  const int64_t last_bytes = (dim - col) * static_cast<int64_t>(sizeof(T));
#define TF_TTEMB_CHUNK_CASE(k)                                                                     \
  case k:                                                                                          \
    BagChunkSumTail<k, kWeighted>(params, ids, weights, begin, end, prefetch_end, last_bytes, dim, \
                                  col, tail, attrs, sums + col);                                   \
    break;
  TF_TTEMB_SWITCH_CHUNKS(left, TF_TTEMB_CHUNKS_8, TF_TTEMB_CHUNK_CASE)
#undef TF_TTEMB_CHUNK_CASE
}

// The max combiner on the same column chunks: the running max of each column
// and the position (inside the bag) it came from, both in registers over one
// pass of the entries [begin, end). The first non-padding entry sets both; a
// later entry takes a column where its value is greater (an ordered compare,
// false for NaN) or is NaN where the max is not. That is the scalar rule
// `pos < 0 || v > max || (isnan(v) && !isnan(max))`: the first maximal entry
// wins, NaN is above every number, and the bits are the scalar loop's. Writes
// the maxes (0 where the bag has no entry) and the positions (-1 there).
template <int kVecs, bool kTail, typename T, typename Tindex, typename Acc>
inline void BagChunkMax(const T* params,    // [N, D]
                        const Tindex* ids,  // [nnz]
                        int64_t begin, int64_t end, int64_t prefetch_end, int64_t prefetch_bytes,
                        int64_t dim, int64_t col, int tail, const BagAttrs& attrs,
                        Acc* maxes,    // [kVecs * kLanes]
                        int32* pos) {  // [kVecs * kLanes]
  using VA = Vec<Acc>;
  constexpr int kLanes = VA::kLanes;
  typename VA::V acc[kVecs];
  typename VA::P at[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    acc[v] = VA::Zero();
    at[v] = VA::PosSet(-1);
  }
  const bool padding = attrs.has_padding_id;
  const int64_t padding_id = attrs.padding_id;
  const RowPrefetch pf =
      SlicePrefetchFor(dim * static_cast<int64_t>(sizeof(T)), col, prefetch_bytes);
  auto load = [&](const T* row, int v) {
    return (kTail && v == kVecs - 1) ? VA::LoadPartial(row + v * kLanes, tail)
                                     : VA::Load(row + v * kLanes);
  };
  int64_t j = begin;
  for (; j < end; ++j) {  // up to the first non-padding entry
    PrefetchAhead(params, ids, j + pf.ahead, prefetch_end, pf, dim, attrs);
    const int64_t id = static_cast<int64_t>(ids[j]);
    if (padding && id == padding_id) continue;
    const T* row = params + id * dim + col;
    for (int v = 0; v < kVecs; ++v) {
      acc[v] = load(row, v);
      at[v] = VA::PosSet(static_cast<int32>(j - begin));
    }
    ++j;
    break;
  }
  for (; j < end; ++j) {
    PrefetchAhead(params, ids, j + pf.ahead, prefetch_end, pf, dim, attrs);
    const int64_t id = static_cast<int64_t>(ids[j]);
    if (padding && id == padding_id) continue;
    const T* row = params + id * dim + col;
    const typename VA::P here = VA::PosSet(static_cast<int32>(j - begin));
    for (int v = 0; v < kVecs; ++v) {
      const typename VA::V x = load(row, v);
      const typename VA::V take = VA::Takes(x, acc[v]);
      acc[v] = VA::Select(take, acc[v], x);
      at[v] = VA::PosSelect(take, at[v], here);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const int n = (kTail && v == kVecs - 1) ? tail : kLanes;
    if (n == kLanes) {
      VA::Store(maxes + v * kLanes, acc[v]);
    } else {
      VA::StorePartial(maxes + v * kLanes, acc[v], n);
    }
    VA::PosStore(pos + v * kLanes, at[v], n);
  }
}

// Vectors of columns one pass of the max keeps in registers (a max and a
// position per vector).
constexpr int kMaxVecsMax = 4;

template <typename T, typename Tindex, typename Acc>
void BagMaxAvx2(const T* params, const Tindex* ids, int64_t begin, int64_t end,
                int64_t prefetch_end, int64_t dim, const BagAttrs& attrs, Acc* maxes, int32* pos) {
  constexpr int kLanes = Vec<Acc>::kLanes;
  const int64_t vecs = (dim + kLanes - 1) / kLanes;
  const int tail = static_cast<int>(dim % kLanes);
  constexpr int64_t kChunkBytes = kMaxVecsMax * kLanes * static_cast<int64_t>(sizeof(T));
  int64_t col = 0;
  int64_t left = vecs;
  for (; left > kMaxVecsMax; left -= kMaxVecsMax, col += kMaxVecsMax * kLanes) {
    BagChunkMax<kMaxVecsMax, false>(params, ids, begin, end, prefetch_end, kChunkBytes, dim, col, 0,
                                    attrs, maxes + col, pos + col);
  }
  const int64_t last_bytes = (dim - col) * static_cast<int64_t>(sizeof(T));
#define TF_TTEMB_CHUNK_CASE(k)                                                                     \
  case k:                                                                                          \
    if (tail == 0) {                                                                               \
      BagChunkMax<k, false>(params, ids, begin, end, prefetch_end, last_bytes, dim, col, 0, attrs, \
                            maxes + col, pos + col);                                               \
    } else {                                                                                       \
      BagChunkMax<k, true>(params, ids, begin, end, prefetch_end, last_bytes, dim, col, tail,      \
                           attrs, maxes + col, pos + col);                                         \
    }                                                                                              \
    break;
  TF_TTEMB_SWITCH_CHUNKS(left, TF_TTEMB_CHUNKS_4, TF_TTEMB_CHUNK_CASE)
#undef TF_TTEMB_CHUNK_CASE
}

// ---------------------------------------------------------------------------
// AVX-512, chosen at run time (the library itself is built for AVX2, so one
// build runs everywhere): 16 float lanes per vector and up to kMaxVecs512 = 16
// vectors (256 columns) of sums in registers per pass over a bag's entries,
// where AVX2 holds 64 columns; D = 256 takes one pass instead of four. The
// arithmetic per column is the same sequential fma (weighted) or add chain
// over the entries as BagChunkSum's, so both paths give the same bits.
struct Vec512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  TF_TTEMB_AVX512 static V Load(const float* p) { return _mm512_loadu_ps(p); }
  TF_TTEMB_AVX512 static V Load(const Eigen::half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  TF_TTEMB_AVX512 static V Load(const bfloat16* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // The lanes of `mask` (a prefix); the others 0, never read from memory.
  TF_TTEMB_AVX512 static V LoadPartial(const float* p, __mmask16 mask) {
    return _mm512_maskz_loadu_ps(mask, p);
  }
  TF_TTEMB_AVX512 static V LoadPartial(const Eigen::half* p, __mmask16 mask) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
  TF_TTEMB_AVX512 static V LoadPartial(const bfloat16* p, __mmask16 mask) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};

constexpr int kMaxVecs512 = 16;

// acc[0, kVecs) += w * row's vectors (fma) when kWeighted, + row's vectors
// otherwise; `mask` selects the last vector's lanes when kTail.
template <int kVecs, bool kTail, bool kWeighted, typename T>
TF_TTEMB_AVX512 inline void AddRow512(const T* row, __m512 w, __mmask16 mask, __m512* acc) {
  constexpr int kLanes = Vec512::kLanes;
  for (int v = 0; v < kVecs; ++v) {
    const __m512 x = (kTail && v == kVecs - 1) ? Vec512::LoadPartial(row + v * kLanes, mask)
                                               : Vec512::Load(row + v * kLanes);
    acc[v] = kWeighted ? _mm512_fmadd_ps(w, x, acc[v]) : _mm512_add_ps(acc[v], x);
  }
}

// As BagChunkSum, 16 lanes per vector; `mask` selects the last vector's lanes
// when kTail.
template <int kVecs, bool kTail, bool kWeighted, typename T, typename Tindex>
TF_TTEMB_AVX512 void BagChunkSum512(const T* params,    // [N, D]
                                    const Tindex* ids,  // [nnz]
                                    const T* weights,   // [nnz] when kWeighted
                                    int64_t begin, int64_t end, int64_t prefetch_end,
                                    int64_t prefetch_bytes, int64_t dim, int64_t col,
                                    __mmask16 mask, const BagAttrs& attrs,
                                    float* sums) {  // [kVecs * 16]
  constexpr int kLanes = Vec512::kLanes;
  __m512 acc[kVecs];
  for (int v = 0; v < kVecs; ++v) acc[v] = _mm512_setzero_ps();
  const bool padding = attrs.has_padding_id;
  const int64_t padding_id = attrs.padding_id;
  const RowPrefetch pf = RowPrefetchFor(prefetch_bytes);
  int64_t j = begin;
  if (pf.bytes > 0) {
    // The entries whose look-ahead entry lies before prefetch_end: no bound
    // check per entry (short rows spend more on the loop than on the row).
    const int64_t checked_from = std::min(end, prefetch_end - pf.ahead);
    for (; j < checked_from; ++j) {
      const int64_t ahead = static_cast<int64_t>(ids[j + pf.ahead]);
      if (!padding || ahead != padding_id) {
        PrefetchBytes(params + ahead * dim, pf.bytes, pf.level);
      }
      const int64_t id = static_cast<int64_t>(ids[j]);
      if (padding && id == padding_id) continue;
      const __m512 w = _mm512_set1_ps(kWeighted ? static_cast<float>(weights[j]) : 1.0f);
      AddRow512<kVecs, kTail, kWeighted>(params + id * dim + col, w, mask, acc);
    }
  }
  for (; j < end; ++j) {
    const int64_t id = static_cast<int64_t>(ids[j]);
    PrefetchAhead(params, ids, j + pf.ahead, prefetch_end, pf, dim, attrs);
    if (padding && id == padding_id) continue;
    const __m512 w = _mm512_set1_ps(kWeighted ? static_cast<float>(weights[j]) : 1.0f);
    AddRow512<kVecs, kTail, kWeighted>(params + id * dim + col, w, mask, acc);
  }
  for (int v = 0; v < kVecs; ++v) {
    if (kTail && v == kVecs - 1) {
      _mm512_mask_storeu_ps(sums + v * kLanes, mask, acc[v]);
    } else {
      _mm512_storeu_ps(sums + v * kLanes, acc[v]);
    }
  }
}

template <int kVecs, bool kWeighted, typename T, typename Tindex>
TF_TTEMB_AVX512 void BagChunkSum512Tail(const T* params, const Tindex* ids, const T* weights,
                                        int64_t begin, int64_t end, int64_t prefetch_end,
                                        int64_t prefetch_bytes, int64_t dim, int64_t col, int tail,
                                        const BagAttrs& attrs, float* sums) {
  if (tail == 0) {
    BagChunkSum512<kVecs, false, kWeighted>(params, ids, weights, begin, end, prefetch_end,
                                            prefetch_bytes, dim, col, 0xFFFF, attrs, sums);
  } else {
    const __mmask16 mask = static_cast<__mmask16>((1u << tail) - 1);
    BagChunkSum512<kVecs, true, kWeighted>(params, ids, weights, begin, end, prefetch_end,
                                           prefetch_bytes, dim, col, mask, attrs, sums);
  }
}

// Rows wider than one pass holds (D > 256): the sums in sums[0, dim), which
// stays in L1, and one pass over the entries that reads each row once, front
// to back, prefetching the row kWideRowsAhead entries on one line per vector
// loaded. Chunked passes read each row in slices, one slice a pass. Each
// column is still the same sequential fma (or add) chain.
constexpr int64_t kWideRowsAhead = 8;

template <bool kWeighted, typename T, typename Tindex>
TF_TTEMB_AVX512 void BagWideSum512(const T* params, const Tindex* ids, const T* weights,
                                   int64_t begin, int64_t end, int64_t prefetch_end, int64_t dim,
                                   const BagAttrs& attrs, float* sums) {
  constexpr int kLanes = Vec512::kLanes;
  constexpr int64_t kVecBytes = kLanes * sizeof(T);  // 64 or 32: a line per 1 or 2 vectors
  const int64_t full = dim / kLanes;
  const int tail = static_cast<int>(dim % kLanes);
  const __mmask16 mask = static_cast<__mmask16>((1u << tail) - 1);
  std::fill(sums, sums + dim, 0.0f);
  for (int64_t j = begin; j < end; ++j) {
    const int64_t id = static_cast<int64_t>(ids[j]);
    const int64_t ahead = j + kWideRowsAhead;
    const char* next = nullptr;  // the row to prefetch, or null
    if (ahead < prefetch_end && !IsPadding(ids[ahead], attrs)) {
      next = reinterpret_cast<const char*>(params + static_cast<int64_t>(ids[ahead]) * dim);
    }
    if (attrs.has_padding_id && id == attrs.padding_id) continue;
    const T* row = params + id * dim;
    const __m512 w = _mm512_set1_ps(kWeighted ? static_cast<float>(weights[j]) : 1.0f);
    for (int64_t v = 0; v < full; ++v) {
      if (next != nullptr && (v * kVecBytes) % 64 == 0) PrefetchLine(next + v * kVecBytes);
      const __m512 x = Vec512::Load(row + v * kLanes);
      const __m512 acc = _mm512_loadu_ps(sums + v * kLanes);
      _mm512_storeu_ps(sums + v * kLanes,
                       kWeighted ? _mm512_fmadd_ps(w, x, acc) : _mm512_add_ps(acc, x));
    }
    if (tail != 0) {
      if (next != nullptr) PrefetchBytes(next + full * kVecBytes, tail * sizeof(T));
      const __m512 x = Vec512::LoadPartial(row + full * kLanes, mask);
      const __m512 acc = _mm512_maskz_loadu_ps(mask, sums + full * kLanes);
      _mm512_mask_storeu_ps(sums + full * kLanes, mask,
                            kWeighted ? _mm512_fmadd_ps(w, x, acc) : _mm512_add_ps(acc, x));
    }
  }
}

template <bool kWeighted, typename T, typename Tindex>
TF_TTEMB_AVX512 void BagSum512(const T* params, const Tindex* ids, const T* weights, int64_t begin,
                               int64_t end, int64_t prefetch_end, int64_t dim,
                               const BagAttrs& attrs, float* sums) {
  constexpr int kLanes = Vec512::kLanes;
  const int64_t vecs = (dim + kLanes - 1) / kLanes;
  if (vecs > kMaxVecs512) {
    BagWideSum512<kWeighted>(params, ids, weights, begin, end, prefetch_end, dim, attrs, sums);
    return;
  }
  const int tail = static_cast<int>(dim % kLanes);
  int64_t prefetch_bytes = dim * static_cast<int64_t>(sizeof(T));
  int64_t col = 0;
  int64_t left = vecs;
  for (; left > kMaxVecs512; left -= kMaxVecs512, col += kMaxVecs512 * kLanes) {
    BagChunkSum512<kMaxVecs512, false, kWeighted>(params, ids, weights, begin, end, prefetch_end,
                                                  prefetch_bytes, dim, col, 0xFFFF, attrs,
                                                  sums + col);
    prefetch_bytes = 0;
  }
#define TF_TTEMB_CHUNK_CASE(k)                                                           \
  case k:                                                                                \
    BagChunkSum512Tail<k, kWeighted>(params, ids, weights, begin, end, prefetch_end,     \
                                     prefetch_bytes, dim, col, tail, attrs, sums + col); \
    break;
  TF_TTEMB_SWITCH_CHUNKS(left, TF_TTEMB_CHUNKS_16, TF_TTEMB_CHUNK_CASE)
#undef TF_TTEMB_CHUNK_CASE
}

// As BagChunkMax, 16 lanes per vector; `mask` selects the last vector's lanes
// when kTail.
template <int kVecs, bool kTail, typename T, typename Tindex>
TF_TTEMB_AVX512 void BagChunkMax512(const T* params,    // [N, D]
                                    const Tindex* ids,  // [nnz]
                                    int64_t begin, int64_t end, int64_t prefetch_end,
                                    int64_t prefetch_bytes, int64_t dim, int64_t col,
                                    __mmask16 mask, const BagAttrs& attrs,
                                    float* maxes,  // [kVecs * 16]
                                    int32* pos) {  // [kVecs * 16]
  constexpr int kLanes = Vec512::kLanes;
  __m512 acc[kVecs];
  __m512i at[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    acc[v] = _mm512_setzero_ps();
    at[v] = _mm512_set1_epi32(-1);
  }
  const bool padding = attrs.has_padding_id;
  const int64_t padding_id = attrs.padding_id;
  const RowPrefetch pf = RowPrefetchFor(prefetch_bytes);
  int64_t j = begin;
  for (; j < end; ++j) {  // up to the first non-padding entry
    PrefetchAhead(params, ids, j + pf.ahead, prefetch_end, pf, dim, attrs);
    const int64_t id = static_cast<int64_t>(ids[j]);
    if (padding && id == padding_id) continue;
    const T* row = params + id * dim + col;
    for (int v = 0; v < kVecs; ++v) {
      acc[v] = (kTail && v == kVecs - 1) ? Vec512::LoadPartial(row + v * kLanes, mask)
                                         : Vec512::Load(row + v * kLanes);
      at[v] = _mm512_set1_epi32(static_cast<int32>(j - begin));
    }
    ++j;
    break;
  }
  for (; j < end; ++j) {
    PrefetchAhead(params, ids, j + pf.ahead, prefetch_end, pf, dim, attrs);
    const int64_t id = static_cast<int64_t>(ids[j]);
    if (padding && id == padding_id) continue;
    const T* row = params + id * dim + col;
    const __m512i here = _mm512_set1_epi32(static_cast<int32>(j - begin));
    for (int v = 0; v < kVecs; ++v) {
      const __m512 x = (kTail && v == kVecs - 1) ? Vec512::LoadPartial(row + v * kLanes, mask)
                                                 : Vec512::Load(row + v * kLanes);
      // Vec<float>::Takes's rule: not x <= acc, where acc is not NaN.
      const __mmask16 take = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(acc[v], acc[v], _CMP_ORD_Q),
                                                     x, acc[v], _CMP_NLE_UQ);
      acc[v] = _mm512_mask_mov_ps(acc[v], take, x);
      at[v] = _mm512_mask_mov_epi32(at[v], take, here);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const __mmask16 store = (kTail && v == kVecs - 1) ? mask : __mmask16{0xFFFF};
    _mm512_mask_storeu_ps(maxes + v * kLanes, store, acc[v]);
    _mm512_mask_storeu_epi32(pos + v * kLanes, store, at[v]);
  }
}

constexpr int kMaxVecsMax512 = 8;

template <typename T, typename Tindex>
TF_TTEMB_AVX512 void BagMax512(const T* params, const Tindex* ids, int64_t begin, int64_t end,
                               int64_t prefetch_end, int64_t dim, const BagAttrs& attrs,
                               float* maxes, int32* pos) {
  constexpr int kLanes = Vec512::kLanes;
  const int64_t vecs = (dim + kLanes - 1) / kLanes;
  const int tail = static_cast<int>(dim % kLanes);
  const __mmask16 mask = tail == 0 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << tail) - 1);
  int64_t prefetch_bytes = dim * static_cast<int64_t>(sizeof(T));
  int64_t col = 0;
  int64_t left = vecs;
  for (; left > kMaxVecsMax512; left -= kMaxVecsMax512, col += kMaxVecsMax512 * kLanes) {
    BagChunkMax512<kMaxVecsMax512, false>(params, ids, begin, end, prefetch_end, prefetch_bytes,
                                          dim, col, 0xFFFF, attrs, maxes + col, pos + col);
    prefetch_bytes = 0;
  }
#define TF_TTEMB_CHUNK_CASE(k)                                                                  \
  case k:                                                                                       \
    if (tail == 0) {                                                                            \
      BagChunkMax512<k, false>(params, ids, begin, end, prefetch_end, prefetch_bytes, dim, col, \
                               mask, attrs, maxes + col, pos + col);                            \
    } else {                                                                                    \
      BagChunkMax512<k, true>(params, ids, begin, end, prefetch_end, prefetch_bytes, dim, col,  \
                              mask, attrs, maxes + col, pos + col);                             \
    }                                                                                           \
    break;
  TF_TTEMB_SWITCH_CHUNKS(left, TF_TTEMB_CHUNKS_8, TF_TTEMB_CHUNK_CASE)
#undef TF_TTEMB_CHUNK_CASE
}

// The bag sum on the widest path this CPU has: AVX-512 for float
// accumulators (float, half and bfloat16 tables) where the CPU supports it,
// AVX2 otherwise and for double.
template <bool kWeighted, typename T, typename Tindex, typename Acc>
void BagSum(const T* params, const Tindex* ids, const T* weights, int64_t begin, int64_t end,
            int64_t prefetch_end, int64_t dim, const BagAttrs& attrs, Acc* sums) {
  if constexpr (std::is_same<Acc, float>::value) {
    if (CpuHasAvx512()) {
      BagSum512<kWeighted>(params, ids, weights, begin, end, prefetch_end, dim, attrs, sums);
      return;
    }
  }
  BagSumAvx2<kWeighted>(params, ids, weights, begin, end, prefetch_end, dim, attrs, sums);
}

// The max of a bag (see BagChunkMax) on the widest path this CPU has.
template <typename T, typename Tindex, typename Acc>
void BagMax(const T* params, const Tindex* ids, int64_t begin, int64_t end, int64_t prefetch_end,
            int64_t dim, const BagAttrs& attrs, Acc* maxes, int32* pos) {
  if constexpr (std::is_same<Acc, float>::value) {
    if (CpuHasAvx512()) {
      BagMax512(params, ids, begin, end, prefetch_end, dim, attrs, maxes, pos);
      return;
    }
  }
  BagMaxAvx2(params, ids, begin, end, prefetch_end, dim, attrs, maxes, pos);
}

#else  // !TF_TTEMB_CPU_AVX2

// Portable fallback: one column sum per element, in memory.
template <bool kWeighted, typename T, typename Tindex, typename Acc>
void BagSum(const T* params, const Tindex* ids, const T* weights, int64_t begin, int64_t end,
            int64_t prefetch_end, int64_t dim, const BagAttrs& attrs, Acc* sums) {
  std::fill(sums, sums + dim, Acc(0));
  for (int64_t j = begin; j < end; ++j) {
    if (IsPadding(ids[j], attrs)) continue;
    if (j + kPrefetchDistance < end && !IsPadding(ids[j + kPrefetchDistance], attrs)) {
      PrefetchRow(params + static_cast<int64_t>(ids[j + kPrefetchDistance]) * dim, dim);
    }
    const T* row = params + static_cast<int64_t>(ids[j]) * dim;
    if (kWeighted) {
      Axpy(sums, static_cast<Acc>(weights[j]), row, dim);
    } else {
      AddRow(sums, row, dim);
    }
  }
}

// Portable fallback of the max: the scalar rule, column by column.
template <typename T, typename Tindex, typename Acc>
void BagMax(const T* params, const Tindex* ids, int64_t begin, int64_t end, int64_t prefetch_end,
            int64_t dim, const BagAttrs& attrs, Acc* maxes, int32* pos) {
  (void)prefetch_end;
  std::fill(maxes, maxes + dim, Acc(0));
  std::fill(pos, pos + dim, -1);
  for (int64_t j = begin; j < end; ++j) {
    if (IsPadding(ids[j], attrs)) continue;
    const T* row = params + static_cast<int64_t>(ids[j]) * dim;
    const int32 p = static_cast<int32>(j - begin);
    for (int64_t d = 0; d < dim; ++d) {
      const Acc v = static_cast<Acc>(row[d]);
      const bool take = pos[d] < 0 || v > maxes[d] || (std::isnan(v) && !std::isnan(maxes[d]));
      maxes[d] = take ? v : maxes[d];
      pos[d] = take ? p : pos[d];
    }
  }
}

#endif  // TF_TTEMB_CPU_AVX2

template <typename T, typename Tindex>
void ForwardMaxBags(const T* params,        // [N, D]
                    const Tindex* ids,      // [nnz]
                    const int64_t* splits,  // [B + 1]
                    int64_t dim, const BagAttrs& attrs, int64_t bag_begin, int64_t bag_end,
                    T* out,           // [B, D]
                    int32* argmax) {  // [B, D]
  using Acc = AccT<T>;
  // A bag's maxes; Acc-typed outputs take them in place. The first entry of
  // the max wins; NaN is above every number (as in tf.reduce_max), so the
  // first NaN entry wins a column holding NaN; an empty bag gives 0 and -1.
  std::vector<Acc> scratch(std::is_same<T, Acc>::value ? 0 : dim);
  const int64_t prefetch_end = splits[bag_end];
  for (int64_t b = bag_begin; b < bag_end; ++b) {
    T* out_row = out + b * dim;
    Acc* maxes = std::is_same<T, Acc>::value ? reinterpret_cast<Acc*>(out_row) : scratch.data();
    BagMax(params, ids, splits[b], splits[b + 1], prefetch_end, dim, attrs, maxes,
           argmax + b * dim);
    if constexpr (!std::is_same<T, Acc>::value) StoreRow(out_row, maxes, dim);
  }
}

template <bool kWeighted, typename T, typename Tindex>
void ForwardSumBags(const T* params,        // [N, D]
                    const Tindex* ids,      // [nnz]
                    const int64_t* splits,  // [B + 1]
                    const T* weights,       // [nnz] when kWeighted
                    int64_t dim, const BagAttrs& attrs, int64_t bag_begin, int64_t bag_end,
                    T* out) {  // [B, D]
  using Acc = AccT<T>;
  // A bag's (or a block's) column sums; Acc-typed outputs take them in place.
  std::vector<Acc> scratch(std::is_same<T, Acc>::value ? 0 : dim);
  std::optional<BlockedSum<Acc>> blocks;  // bags longer than kSumBlock
  const int64_t prefetch_end = splits[bag_end];
  for (int64_t b = bag_begin; b < bag_end; ++b) {
    const int64_t begin = splits[b], end = splits[b + 1];
    T* out_row = out + b * dim;
    const Acc scale = BagScaleOf<!std::is_same<T, Acc>::value>(ids, weights, begin, end, attrs);
    if (scale == Acc(0)) {  // +0, also where a row holds Inf or NaN
      std::fill(out_row, out_row + dim, T(0));
      continue;
    }
    const Acc* total;
    if (end - begin <= kSumBlock) {
      Acc* sums = std::is_same<T, Acc>::value ? reinterpret_cast<Acc*>(out_row) : scratch.data();
      BagSum<kWeighted>(params, ids, weights, begin, end, prefetch_end, dim, attrs, sums);
      total = sums;
    } else {
      if (!blocks) blocks.emplace(dim);
      blocks->Reset();
      for (int64_t block = begin; block < end; block += kSumBlock) {
        const int64_t block_end = std::min(end, block + kSumBlock);
        BagSum<kWeighted>(params, ids, weights, block, block_end, prefetch_end, dim, attrs,
                          blocks->current());
        if (block_end < end) blocks->Carry();
      }
      total = blocks->Total();
    }
    if constexpr (std::is_same<T, Acc>::value) {
      for (int64_t d = 0; d < dim; ++d) out_row[d] = total[d] * scale;  // total may be out_row
    } else {
      StoreScaledRow(out_row, total, scale, dim);
    }
  }
}

template <typename T, typename Tindex>
void ForwardBags(const T* params,        // [N, D]
                 const Tindex* ids,      // [nnz]
                 const int64_t* splits,  // [B + 1]
                 const T* weights,       // [nnz] or null
                 int64_t dim, const BagAttrs& attrs, int64_t bag_begin, int64_t bag_end,
                 T* out,           // [B, D]
                 int32* argmax) {  // [B, D] for max, else null
  if (attrs.combiner == Combiner::kMax) {
    ForwardMaxBags(params, ids, splits, dim, attrs, bag_begin, bag_end, out, argmax);
  } else if (attrs.has_weights) {
    ForwardSumBags<true>(params, ids, splits, weights, dim, attrs, bag_begin, bag_end, out);
  } else {
    ForwardSumBags<false>(params, ids, splits, weights, dim, attrs, bag_begin, bag_end, out);
  }
}

}  // namespace

// The CPU forward: checks the row_splits on the host (the report stays empty),
// then each block of bags on the thread pool checks its ids and sums its bags.
template <typename T, typename Tindex>
struct ForwardLaunch<CpuDevice, T, Tindex> {
  static constexpr int64_t kReportWords = 0;

  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const ForwardArgs& a) {
    const int64_t num_bags = a.shapes.num_bags;
    const int64_t* splits = a.row_splits->flat<int64_t>().data();
    const Tindex* ids = a.indices->flat<Tindex>().data();
    thread::ThreadPool* pool = CpuPool(ctx);
    const int64_t nnz = a.shapes.nnz;
    const bool is_max = attrs.combiner == Combiner::kMax;
    // argmax holds int32 positions inside a bag: only more entries than that in
    // all could make one bag too long (once row_splits are known to be sound).
    if (is_max && nnz > std::numeric_limits<int32>::max()) {
      TF_RETURN_IF_ERROR(ValidateRowSplits(splits, num_bags, nnz));
      for (int64_t b = 0; b < num_bags; ++b) {
        if (splits[b + 1] - splits[b] > std::numeric_limits<int32>::max()) {
          return errors::InvalidArgument(
              "combiner 'max' supports bags of at most 2^31 - 1 entries, bag ", b, " has ",
              splits[b + 1] - splits[b]);
        }
      }
    }
    if (num_bags == 0 || a.dim == 0) {
      return ValidateBags(pool, splits, ids, num_bags, nnz, a.num_rows, attrs);
    }
    CollapseToHugePages(*a.params);
    const T* params = a.params->flat<T>().data();
    const T* weights = attrs.has_weights ? a.weights->flat<T>().data() : nullptr;
    T* out = a.output->flat<T>().data();
    int32* argmax = is_max ? a.argmax->flat<int32>().data() : nullptr;
    const int64_t dim = a.dim;
    // Fresh [B, D] memory, first touched below: a large output (many short bags,
    // one-hot features at a big batch) faults once per 2 MiB instead of once per
    // 4 KiB page on every call (huge_pages.h), as the backward's gradients do.
    AdviseHugePages(out, num_bags * dim * static_cast<int64_t>(sizeof(T)));
    if (is_max) AdviseHugePages(argmax, num_bags * dim * static_cast<int64_t>(sizeof(int32)));
    // Each block of bags checks its ids, then sums them (ForValidatedBlocks).
    return ForValidatedBlocks(
        pool, splits, ids, num_bags, nnz, a.num_rows, attrs, dim, [&](int64_t begin, int64_t end) {
          ForwardBags(params, ids, splits, weights, dim, attrs, begin, end, out, argmax);
        });
  }
};

namespace {

// An empty report (a CPU forward's) is OK; a GPU one, copied here, raises what it holds.
REGISTER_KERNEL_BUILDER(Name("TfTtemb>CheckBagReport").Device(DEVICE_CPU),
                        CheckReportCpuOp<BagReportTraits>);

TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GatherReduceSum", GatherReduceSumOp, false)
TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>ResourceGatherReduceSum", GatherReduceSumOp, true)

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow
