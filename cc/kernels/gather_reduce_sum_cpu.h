// Internal to the gather_reduce_sum CPU kernels (gather_reduce_sum_forward_cpu.cc,
// gather_reduce_sum_backward_cpu.cc, gather_reduce_sum_sparse_apply_cpu.cc): the id
// checks, the row arithmetic, the bag scales, the sort of the entries by id and the
// registration macros they share (the pool's fork and join is cpu_parallel.h). Not for
// other callers; the contract shared with the GPU glue is gather_reduce_sum_kernels.h.

#ifndef TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_CPU_H_
#define TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_CPU_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "cc/kernels/cpu_isa.h"
#include "cc/kernels/cpu_parallel.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/huge_pages.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace tf_ttemb {

// The position of the first id in ids[begin, end) that is neither in
// [0, num_rows) nor the padding id, or `end` if there is none. Blocks of
// kCheckBlock ids are tested first with a branch-free OR of the range test
// (and of the inequality to the padding id, if any) into an int64, as two
// signed compares: GCC 12 vectorises that loop with AVX2 but not the
// one-compare unsigned form (AVX2 has no unsigned 64-bit compare), which ran
// 3x slower (0.45 against 0.15 ms for 655,360 int64 ids on one core). Only a
// block that fails is scanned in order for its first bad id.
template <typename Tindex>
int64_t FirstBadIndex(const Tindex* ids, int64_t begin, int64_t end, int64_t num_rows,
                      const BagAttrs& attrs) {
  constexpr int64_t kCheckBlock = 512;
  const bool padding = attrs.has_padding_id;
  const int64_t padding_id = attrs.padding_id;
  auto block_fails = [&](int64_t from, int64_t to) {
    int64_t bad = 0;
    if (padding) {
      for (int64_t j = from; j < to; ++j) {
        const int64_t id = static_cast<int64_t>(ids[j]);
        bad |= (static_cast<int64_t>(id < 0) | static_cast<int64_t>(id >= num_rows)) &
               static_cast<int64_t>(id != padding_id);
      }
    } else {
      for (int64_t j = from; j < to; ++j) {
        const int64_t id = static_cast<int64_t>(ids[j]);
        bad |= static_cast<int64_t>(id < 0) | static_cast<int64_t>(id >= num_rows);
      }
    }
    return bad != 0;
  };
  for (int64_t block = begin; block < end; block += kCheckBlock) {
    const int64_t block_end = std::min(end, block + kCheckBlock);
    if (!block_fails(block, block_end)) continue;
    for (int64_t j = block; j < block_end; ++j) {
      const int64_t id = static_cast<int64_t>(ids[j]);
      if ((id < 0 || id >= num_rows) && !IsPadding(ids[j], attrs)) return j;
    }
  }
  return end;
}

// Lowers `first_bad` to `position` if that is smaller (threads report in any order).
inline void LowerFirstBad(std::atomic<int64_t>* first_bad, int64_t position) {
  int64_t seen = first_bad->load();
  while (position < seen && !first_bad->compare_exchange_weak(seen, position)) {
  }
}

// Every id in [0, num_rows) or the padding id; else the error naming the first one.
template <typename Tindex>
Status ValidateIndices(thread::ThreadPool* pool, const Tindex* ids, int64_t nnz, int64_t num_rows,
                       const BagAttrs& attrs) {
  std::atomic<int64_t> first_bad{nnz};
  auto check = [&](int64_t begin, int64_t end) {
    const int64_t bad = FirstBadIndex(ids, begin, end, num_rows, attrs);
    if (bad < end) LowerFirstBad(&first_bad, bad);
  };
  if (nnz < 65536) {
    check(0, nnz);
  } else {
    pool->ParallelFor(nnz, 2, check);
  }
  const int64_t bad = first_bad.load();
  if (bad < nnz) {
    return BadIndexError(bad, static_cast<int64_t>(ids[bad]), num_rows, attrs);
  }
  return OkStatus();
}

// The one check of a CPU launch's bags: row_splits well formed for num_bags
// bags over nnz entries (ValidateRowSplits), then every id in [0, num_rows) or
// the padding id (ValidateIndices).
template <typename Tindex>
Status ValidateBags(thread::ThreadPool* pool, const int64_t* splits, const Tindex* ids,
                    int64_t num_bags, int64_t nnz, int64_t num_rows, const BagAttrs& attrs) {
  TF_RETURN_IF_ERROR(ValidateRowSplits(splits, num_bags, nnz));
  return ValidateIndices(pool, ids, nnz, num_rows, attrs);
}

// ValidateBags and ForBalancedBlocks(splits, ..., fn) in one pass over the
// pool: each block of bags checks its own ids, then runs fn(begin, end) on
// them only if they all pass. One fork and join instead of two, and the ids
// are still in cache when fn reads them. On a bad id, fn may have run on other
// blocks; the error names the first bad position, as ValidateBags does.
template <typename Tindex, typename Fn>
Status ForValidatedBlocks(thread::ThreadPool* pool, const int64_t* splits, const Tindex* ids,
                          int64_t num_bags, int64_t nnz, int64_t num_rows, const BagAttrs& attrs,
                          int64_t cost_per_item, Fn fn) {
  TF_RETURN_IF_ERROR(ValidateRowSplits(splits, num_bags, nnz));
  std::atomic<int64_t> first_bad{nnz};
  ForBalancedBlocks(pool, splits, num_bags, cost_per_item, [&](int64_t begin, int64_t end) {
    const int64_t bad = FirstBadIndex(ids, splits[begin], splits[end], num_rows, attrs);
    if (bad < splits[end]) {
      LowerFirstBad(&first_bad, bad);
      return;
    }
    fn(begin, end);
  });
  const int64_t bad = first_bad.load();
  if (bad < nnz) {
    return BadIndexError(bad, static_cast<int64_t>(ids[bad]), num_rows, attrs);
  }
  return OkStatus();
}

template <typename Acc>
inline void Axpy(Acc* __restrict acc, Acc w, const float* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
}
template <typename Acc>
inline void Axpy(Acc* __restrict acc, Acc w, const double* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
}
template <typename Acc, typename T>
inline void AxpyScalar(Acc* __restrict acc, Acc w, const T* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * static_cast<Acc>(row[d]);
}
// Half and bfloat16 rows into float: vectorised below where the build has
// AVX2/FMA/F16C (the same fused multiply-add per element, so the same bits).
template <typename Acc, typename T>
inline void Axpy(Acc* __restrict acc, Acc w, const T* __restrict row, int64_t dim);

template <typename Acc>
inline void AddRow(Acc* __restrict acc, const float* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += row[d];
}
template <typename Acc>
inline void AddRow(Acc* __restrict acc, const double* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += row[d];
}
template <typename Acc, typename T>
inline void AddRow(Acc* __restrict acc, const T* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += static_cast<Acc>(row[d]);
}

// Where a loop prefetches the rows it will read: L2 (and L3) or L1.
enum class PrefetchLevel { kL2, kL1 };

// Prefetches the cache line holding `p` into L2 (and L3), or with kL1 into L1.
// L2 is the default: the rows these kernels prefetch are read a few rows
// later, and prefetcht0 of every line of them filled the 32 KiB L1 of a Zen 4
// with lines not yet needed; prefetcht1 instead made the 1M x 64 forward
// 1.7-2.3x faster there and the 262,144 x 1,024 one 1.3-1.6x (BENCHMARKS.md,
// 2026-12-06, fourth). L1 only for RowPrefetchLevel's rows. An asm statement
// on x86-64, not __builtin_prefetch: GCC 12 deletes a loop whose only
// statements are __builtin_prefetch calls (it counts the builtin as free of
// side effects and, from C++11 on, such a loop as finite and so as dead),
// which had silently removed the row prefetches of these kernels.
inline void PrefetchLine(const void* p, PrefetchLevel level = PrefetchLevel::kL2) {
  const bool l1 = level == PrefetchLevel::kL1;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (l1) {
    asm volatile("prefetcht0 (%0)" : : "r"(p));
  } else {
    asm volatile("prefetcht1 (%0)" : : "r"(p));
  }
#else
  if (l1) {
    __builtin_prefetch(p, 0, 3);
  } else {
    __builtin_prefetch(p, 0, 2);
  }
#endif
}

// Rows of 512 B or more go to L1 on Intel cores, every other row to L2. On an
// Ice Lake-SP (model 106, 48 KiB L1), prefetcht0 made the in-graph forward at
// D = 128 and 256 (float32) 7-21 % faster on both instruction sets, 1 and 2
// threads, while on the Zen 4 of the earlier sessions it made D = 256 1.1-1.4x
// slower; at D = 64 on the Ice Lake it was 3-6 % slower with AVX-512
// (BENCHMARKS.md, 2026-12-06, eighth). TF_TTEMB_ROW_PREFETCH=l1 or l2 in the
// environment fixes the choice for rows of 512 B or more on any CPU. Read once.
inline bool WideRowsPrefetchToL1() {
  static const bool to_l1 = EnvChoice("TF_TTEMB_ROW_PREFETCH", "l1", "l2", CpuIsIntel());
  return to_l1;
}

inline PrefetchLevel RowPrefetchLevel(int64_t row_bytes) {
  return row_bytes >= 512 && WideRowsPrefetchToL1() ? PrefetchLevel::kL1 : PrefetchLevel::kL2;
}

// Fetches one cache line for writing (into L2 and owned, PREFETCHW), so that
// a store to a random line about to be written in full does not wait for it.
// Older x86 CPUs run it as a no-op.
inline void PrefetchLineForWrite(const void* p) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  asm volatile("prefetchw (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 1, 2);
#endif
}

// Calls fetch(line) for every cache line that [p, p + bytes) touches.
template <typename Fetch>
inline void ForEachLine(const void* p, int64_t bytes, Fetch fetch) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; line < end; line += 64) {
    fetch(reinterpret_cast<const void*>(line));
  }
}

// Prefetches every cache line that [p, p + bytes) touches, into L2 or, with
// kL1, into L1.
inline void PrefetchBytes(const void* p, int64_t bytes, PrefetchLevel level = PrefetchLevel::kL2) {
  ForEachLine(p, bytes, [level](const void* line) { PrefetchLine(line, level); });
}

// The same for writing (PrefetchLineForWrite).
inline void PrefetchBytesForWrite(void* p, int64_t bytes) {
  ForEachLine(p, bytes, [](const void* line) { PrefetchLineForWrite(line); });
}

// How many rows of `bytes` bytes a random-row loop keeps prefetched ahead:
// about 8 KiB in flight, 4 to 128 rows (64 B rows 128 ahead; 4 KiB rows 4).
// With the prefetches going to L2, 8 KiB beat 4 KiB at D = 16 to 128 on a Zen 4
// (BENCHMARKS.md, 2026-12-06, fourth), and for 64 B rows 128 ahead beat 64
// (the cap until then; 2026-12-06, seventh).
inline int64_t RowsInFlight(int64_t bytes) {
  return std::max<int64_t>(4, std::min<int64_t>(128, 8192 / std::max<int64_t>(1, bytes)));
}

// Whether the forward's loops over rows in random order prefetch only the
// first line of each row (the line holding its first byte) rather than every
// line the row touches. First line only on Intel cores. On a 2-core Xeon with
// AMX (model 167), prefetching every line of 256 B rows stalled the forward on
// its prefetches (86 % of its samples on the instruction after a prefetcht1);
// with the first line only, the core's own prefetchers bring the rest, and the
// in-graph forward at 1M x 64 (float32, 2 threads) took 1.88 ms instead of
// 2.48 (one process, both alternating), at 65,536 x 256 5-9 % less, at
// 500,000 x 128 within the noise (BENCHMARKS.md, 2026-12-07, tenth). The
// backward's loops read rows in id order and keep every line: the first line
// only made its fwd+bwd 1.1-1.25x slower there. Every line on other CPUs: the
// Zen 4 of the earlier sessions was measured only that way.
// TF_TTEMB_ROW_PREFETCH_LINES=first or all in the environment fixes the choice
// on any CPU. Read once.
inline bool RowPrefetchFirstLineOnly() {
  static const bool first = EnvChoice("TF_TTEMB_ROW_PREFETCH_LINES", "first", "all", CpuIsIntel());
  return first;
}

// How the forward's loops prefetch rows: the row of the entry `ahead` entries
// on, `bytes` bytes of it from its column `col`, into `level`. bytes == 0: no
// prefetch.
struct RowPrefetch {
  int64_t ahead = 0;
  int64_t col = 0;
  int64_t bytes = 0;
  PrefetchLevel level = PrefetchLevel::kL2;
};

// The prefetch of rows of `row_bytes` bytes (none where row_bytes is 0).
inline RowPrefetch RowPrefetchFor(int64_t row_bytes) {
  RowPrefetch pf;
  if (row_bytes <= 0) return pf;
  pf.ahead = RowsInFlight(row_bytes);
  pf.bytes = RowPrefetchFirstLineOnly() ? 1 : row_bytes;
  pf.level = RowPrefetchLevel(row_bytes);
  return pf;
}

// How many entries ahead the AVX2 forward prefetches each pass's slice of a row
// (SlicePrefetchFor).
constexpr int64_t kSliceRowsAhead = 16;

// The prefetch of one pass over a bag's entries that reads the columns
// [col, col + slice_bytes / sizeof(T)) of rows of `row_bytes` bytes: only that
// slice of each row, kSliceRowsAhead entries ahead (the first line of the slice
// where RowPrefetchFirstLineOnly holds). The AVX2 forward's passes cover a row
// in slices of 8 vectors for sums and 4 for the max (64 and 32 float32
// columns, half as many for float64). Prefetching the
// whole row in the first pass, as RowPrefetchFor does, left the later passes
// waiting on lines that had been evicted from L2 again: on a 2-core Zen 3
// (AVX2 only, 512 KiB L2 a core), in a plain loop (float32, 2 threads) slices
// 16 ahead took 10.7 / 8.3 / 4.4 ms at 262,144 x 1,024 / 65,536 x 256 /
// 500,000 x 128 where whole rows took 17.0-18.8 / 14.2-16.8 / 7.0-7.8, and at
// rows of one pass (D <= 64) 16 ahead beat RowsInFlight's 32 to 128 by 8 %
// (BENCHMARKS.md, 2026-12-07, seventeenth).
inline RowPrefetch SlicePrefetchFor(int64_t row_bytes, int64_t col, int64_t slice_bytes) {
  RowPrefetch pf;
  if (slice_bytes <= 0) return pf;
  pf.ahead = kSliceRowsAhead;
  pf.col = col;
  pf.bytes = RowPrefetchFirstLineOnly() ? 1 : slice_bytes;
  pf.level = RowPrefetchLevel(row_bytes);
  return pf;
}

// Prefetches a row that will be read soon, so the random-access gather runs at
// memory bandwidth rather than latency.
template <typename T>
inline void PrefetchRow(const T* row, int64_t dim) {
  PrefetchBytes(row, dim * static_cast<int64_t>(sizeof(T)));
}

// Dot product in Acc with 16 independent partial sums (vectorisable without
// reassociation flags), combined as a fixed tree (8 + 8, 4 + 4, 2 + 2, 1 + 1),
// where a sequential sum of the lanes was a chain of 16 dependent scalar adds
// per call. The summation order is fixed, so results are deterministic, and
// the AVX2 specialisation below computes the same bits.
template <typename Acc, typename A, typename B>
inline Acc DotGeneric(const A* __restrict a, const B* __restrict b, int64_t dim) {
  constexpr int kLanes = 16;
  Acc lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lanes[l] += static_cast<Acc>(a[d + l]) * static_cast<Acc>(b[d + l]);
    }
  }
  for (int l = 0; d < dim; ++d, ++l) {
    lanes[l] += static_cast<Acc>(a[d]) * static_cast<Acc>(b[d]);
  }
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 floats widened exactly from float, half or bfloat16.
inline __m256 LoadWide8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 LoadWide8(const Eigen::half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 LoadWide8(const bfloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// The first n < 8 values of p, the other lanes 0 (never read past p + n).
template <typename T>
inline __m256 LoadWidePartial8(const T* p, int64_t n) {
  T tmp[8] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return LoadWide8(tmp);
}

template <typename A, typename B>
inline float DotF32(const A* __restrict a, const B* __restrict b, int64_t dim) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7, 8-15
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    lo = _mm256_fmadd_ps(LoadWide8(a + d), LoadWide8(b + d), lo);
    hi = _mm256_fmadd_ps(LoadWide8(a + d + 8), LoadWide8(b + d + 8), hi);
  }
  const int64_t rest = dim - d;  // the tail adds into lanes 0 .. rest - 1 only
  if (rest > 0) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t n_lo = std::min<int64_t>(rest, 8);
    const __m256 mask_lo =
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n_lo)), lane));
    const __m256 t_lo =
        _mm256_fmadd_ps(LoadWidePartial8(a + d, n_lo), LoadWidePartial8(b + d, n_lo), lo);
    lo = _mm256_blendv_ps(lo, t_lo, mask_lo);
    if (rest > 8) {
      const int64_t n_hi = rest - 8;
      const __m256 mask_hi =
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n_hi)), lane));
      const __m256 t_hi =
          _mm256_fmadd_ps(LoadWidePartial8(a + d + 8, n_hi), LoadWidePartial8(b + d + 8, n_hi), hi);
      hi = _mm256_blendv_ps(hi, t_hi, mask_hi);
    }
  }
  const __m256 v8 = _mm256_add_ps(lo, hi);
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  const __m128 v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
  return _mm_cvtss_f32(v1);
}

template <typename T>
struct IsWideable : std::integral_constant<bool, std::is_same<T, float>::value ||
                                                     std::is_same<T, Eigen::half>::value ||
                                                     std::is_same<T, bfloat16>::value> {};

template <typename T>
struct IsHalfType : std::integral_constant<bool, std::is_same<T, Eigen::half>::value ||
                                                     std::is_same<T, bfloat16>::value> {};

// acc[0, dim) += w * row[0, dim) for a half or bfloat16 row, 8 columns at a
// time: one fused multiply-add per element, as the scalar loop compiles to.
template <typename T>
inline void AxpyHalf(float* __restrict acc, float w, const T* __restrict row, int64_t dim) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, LoadWide8(row + d), _mm256_loadu_ps(acc + d)));
    _mm256_storeu_ps(acc + d + 8,
                     _mm256_fmadd_ps(wv, LoadWide8(row + d + 8), _mm256_loadu_ps(acc + d + 8)));
  }
  for (; d + 8 <= dim; d += 8) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, LoadWide8(row + d), _mm256_loadu_ps(acc + d)));
  }
  for (; d < dim; ++d) acc[d] = std::fma(w, static_cast<float>(row[d]), acc[d]);
}

// 8 floats rounded to 8 halves or bfloat16s exactly as Eigen's scalar
// conversions round them: to nearest even; a NaN becomes bfloat16's quiet
// NaN of its sign (0x7FC0 / 0xFFC0), a half NaN is converted by the hardware
// as _cvtss_sh does.
inline __m128i NarrowHalf8(__m256 v) {
  return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __m128i NarrowBfloat8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan =
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000)),
                      _mm256_set1_epi32(0x7FC0));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i out = _mm256_blendv_epi8(rounded, nan, is_nan);  // 8 x 32 bits, each < 2^16
  return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}
inline __m128i Narrow8(__m256 v, const Eigen::half*) { return NarrowHalf8(v); }
inline __m128i Narrow8(__m256 v, const bfloat16*) { return NarrowBfloat8(v); }
#endif

template <typename Acc, typename T>
inline void Axpy(Acc* __restrict acc, Acc w, const T* __restrict row, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (std::is_same<Acc, float>::value && IsHalfType<T>::value) {
    AxpyHalf(acc, w, row, dim);
    return;
  }
#endif
  AxpyScalar(acc, w, row, dim);
}

// out[0, dim) = acc[0, dim) (times scale where kScaled) converted to T, with
// static_cast<T>'s rounding: 8 columns at a time for half and bfloat16, whose
// scalar conversions were 12-14 % of the half-typed forward's time at
// 1M x 64 (BENCHMARKS.md, 2026-12-07, sixteenth).
template <bool kScaled, typename T, typename Acc>
inline void ConvertRow(T* __restrict out, const Acc* __restrict acc, Acc scale, int64_t dim) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (std::is_same<Acc, float>::value && IsHalfType<T>::value) {
    const __m256 s = _mm256_set1_ps(scale);
    for (; d + 8 <= dim; d += 8) {
      const __m256 v = _mm256_loadu_ps(acc + d);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                       Narrow8(kScaled ? _mm256_mul_ps(v, s) : v, static_cast<const T*>(nullptr)));
    }
  }
#endif
  for (; d < dim; ++d) out[d] = static_cast<T>(kScaled ? acc[d] * scale : acc[d]);
}

// out[0, dim) = acc[0, dim) converted to T.
template <typename T, typename Acc>
inline void StoreRow(T* __restrict out, const Acc* __restrict acc, int64_t dim) {
  ConvertRow<false>(out, acc, Acc(1), dim);
}

// out[0, dim) = acc[0, dim) * scale converted to T.
template <typename T, typename Acc>
inline void StoreScaledRow(T* __restrict out, const Acc* __restrict acc, Acc scale, int64_t dim) {
  ConvertRow<true>(out, acc, scale, dim);
}

template <typename Acc, typename A, typename B>
inline Acc Dot(const A* __restrict a, const B* __restrict b, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (std::is_same<Acc, float>::value && IsWideable<A>::value && IsWideable<B>::value) {
    return DotF32(a, b, dim);
  }
#endif
  return DotGeneric<Acc>(a, b, dim);
}

// How many entries ahead the gather loops prefetch.
constexpr int64_t kPrefetchDistance = 4;

// The sum of a bag's terms (vectors of `width`), added in blocks of kSumBlock
// entries whose sums are combined pairwise (a binary counter of partial sums),
// so that the rounding error grows like (kSumBlock + log2(L / kSumBlock)) ulps
// with the bag's length L instead of like L. A bag of at most kSumBlock entries
// is summed exactly as one sequential pass. Usage: add the terms of entries
// [begin + i kSumBlock, begin + (i + 1) kSumBlock) into current(), call Carry()
// after each such block but the last, and read Total() after the last one.
// Blocks are cut by position (padding entries included), so the inner loop is
// the plain sequential one.
constexpr int64_t kSumBlock = 256;

template <typename Acc>
class BlockedSum {
 public:
  explicit BlockedSum(int64_t width) : width_(width), current_(width) {}

  void Reset() {
    std::fill(current_.begin(), current_.end(), Acc(0));
    std::fill(occupied_.begin(), occupied_.end(), false);
  }
  Acc* current() { return current_.data(); }

  // current() holds a full block: carries it up the counter and clears it.
  void Carry() {
    size_t level = 0;
    for (; level < levels_.size() && occupied_[level]; ++level) {
      const Acc* older = levels_[level].data();
      for (int64_t d = 0; d < width_; ++d) current_[d] = older[d] + current_[d];
      occupied_[level] = false;
    }
    if (level == levels_.size()) {
      levels_.emplace_back(width_);
      occupied_.push_back(false);
    }
    std::copy(current_.begin(), current_.end(), levels_[level].begin());
    occupied_[level] = true;
    std::fill(current_.begin(), current_.end(), Acc(0));
  }

  // The sum of every term added since Reset, in current() (overwritten).
  const Acc* Total() {
    for (size_t level = 0; level < levels_.size(); ++level) {
      if (!occupied_[level]) continue;
      const Acc* older = levels_[level].data();
      for (int64_t d = 0; d < width_; ++d) current_[d] = older[d] + current_[d];
    }
    return current_.data();
  }

 private:
  int64_t width_;
  std::vector<Acc> current_;
  std::vector<std::vector<Acc>> levels_;
  std::vector<bool> occupied_;
};

// Per-bag scale applied to every entry of the bag: 1 for sum and max,
// 1 / sum(w) for mean, 1 / sqrt(sum(w^2)) for sqrtn (0 when the
// denominator is 0). A bag of scale 0 gives +0 and zero gradients, whatever
// its rows hold (0 * Inf would be NaN): every kernel tests `scale == 0`.
template <typename Acc>
inline Acc BagScale(Combiner combiner, Acc weight_sum, Acc weight_sq_sum) {
  switch (combiner) {
    case Combiner::kMean:
      return weight_sum != Acc(0) ? Acc(1) / weight_sum : Acc(0);
    case Combiner::kSqrtn:
      // != 0, not > 0: a NaN weight makes the scale NaN (IEEE), not 0.
      return weight_sq_sum != Acc(0) ? Acc(1) / std::sqrt(weight_sq_sum) : Acc(0);
    default:
      return Acc(1);
  }
}

// w * w rounded on its own, never fused into the addition that follows.
template <typename Acc>
inline Acc RoundedSquare(Acc w) {
  Acc square = w * w;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(square));
#endif
  return square;
}

// The sum and the sum of squares of the weights of entries [from, to), in
// order (1 per entry when unweighted), padding skipped. Its own function so
// that the two running sums live only inside the loop: live across a call
// (the BlockedSum's allocation in BagScaleOf), GCC kept them in stack slots
// for the whole loop, a store and a reload on every entry's chain of
// additions (mean and sqrtn forwards 1.17-1.21x the sum's at 1M x 64).
template <bool kFusedSquare, typename T, typename Tindex>
inline std::pair<AccT<T>, AccT<T>> WeightSums(const Tindex* ids, const T* weights, int64_t from,
                                              int64_t to, const BagAttrs& attrs) {
  using Acc = AccT<T>;
  Acc sum = 0, sq_sum = 0;
  for (int64_t j = from; j < to; ++j) {
    if (IsPadding(ids[j], attrs)) continue;
    const Acc w = attrs.has_weights ? static_cast<Acc>(weights[j]) : Acc(1);
    sum += w;
    if (kFusedSquare) {
      sq_sum += w * w;
    } else {
      sq_sum += RoundedSquare(w);
    }
  }
  return {sum, sq_sum};
}

// The scale of bag [begin, end). kFusedSquare: the squares of sqrtn are added
// with fused multiply-adds (the backward's, and the forward's for half
// types); otherwise rounded first (the forward's for float and double, as the
// compiler built the loop it replaced, so that outputs keep their bits).
template <bool kFusedSquare, typename T, typename Tindex>
inline AccT<T> BagScaleOf(const Tindex* ids, const T* weights, int64_t begin, int64_t end,
                          const BagAttrs& attrs) {
  using Acc = AccT<T>;
  if (attrs.combiner != Combiner::kMean && attrs.combiner != Combiner::kSqrtn) {
    return Acc(1);
  }
  // The forward's denominators, summed the same way (blocks of kSumBlock
  // entries, as in ForwardBags), so that forward and backward scale a bag
  // alike. The BlockedSum exists only for bags longer than one block.
  if (end - begin <= kSumBlock) {
    const auto [sum, sq_sum] = WeightSums<kFusedSquare>(ids, weights, begin, end, attrs);
    return BagScale(attrs.combiner, sum, sq_sum);
  }
  BlockedSum<Acc> blocks(2);
  blocks.Reset();
  for (int64_t block = begin; block < end; block += kSumBlock) {
    const int64_t block_end = std::min(end, block + kSumBlock);
    const auto [sum, sq_sum] = WeightSums<kFusedSquare>(ids, weights, block, block_end, attrs);
    blocks.current()[0] = sum;
    blocks.current()[1] = sq_sum;
    if (block_end < end) blocks.Carry();
  }
  const Acc* total = blocks.Total();
  return BagScale(attrs.combiner, total[0], total[1]);
}

template <typename T, typename Tindex>
inline AccT<T> ComputeBagScale(const Tindex* ids, const T* weights, int64_t begin, int64_t end,
                               const BagAttrs& attrs) {
  return BagScaleOf<true>(ids, weights, begin, end, attrs);
}

// ---------------------------------------------------------------------------
// The entries sorted by id (the backward and the sparse apply).

// The digits an LSD radix sort of `key_bits`-bit keys takes: as few passes as
// digits of at most 11 bits allow (2,048 counters, which stay in L1), the
// bits spread evenly over them.
struct RadixDigits {
  explicit RadixDigits(int key_bits)
      : passes((key_bits + 10) / 11),
        bits((key_bits + passes - 1) / passes),
        buckets(int64_t{1} << bits),
        mask(static_cast<uint64_t>(buckets - 1)) {}
  int passes;
  int bits;         // per digit
  int64_t buckets;  // 2^bits
  uint64_t mask;    // the digit's bits, shifted down
};

// Stable LSD radix sort of (key, value) pairs on the low `key_bits` bits of
// the keys. Sorted output ends in keys/values; tmp buffers are scratch.
inline void RadixSortPairs(std::vector<uint64_t>* keys, std::vector<int64_t>* values,
                           int key_bits) {
  const int64_t n = static_cast<int64_t>(keys->size());
  if (n <= 1 || key_bits <= 0) return;
  const RadixDigits digits(key_bits);
  const int64_t buckets = digits.buckets;
  const uint64_t mask = digits.mask;
  std::vector<uint64_t> keys_tmp(n);
  std::vector<int64_t> values_tmp(n);
  std::vector<int64_t> count(buckets);
  for (int pass = 0; pass < digits.passes; ++pass) {
    const int shift = pass * digits.bits;
    std::fill(count.begin(), count.end(), 0);
    const uint64_t* k_in = keys->data();
    for (int64_t i = 0; i < n; ++i) ++count[(k_in[i] >> shift) & mask];
    int64_t running = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      const int64_t c = count[d];
      count[d] = running;
      running += c;
    }
    const int64_t* v_in = values->data();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = count[(k_in[i] >> shift) & mask]++;
      keys_tmp[slot] = k_in[i];
      values_tmp[slot] = v_in[i];
    }
    keys->swap(keys_tmp);
    values->swap(values_tmp);
  }
}

inline int BitsFor(int64_t num_rows) {
  int bits = 0;
  while (bits < 63 && (int64_t{1} << bits) < num_rows) ++bits;
  return bits;
}

// Sorted, segmented view of the non-padding entries of a batch.
struct SortedEntries {
  std::vector<uint64_t> keys;       // [M] ids, ascending
  std::vector<int64_t> positions;   // [M] entry positions, ascending per id
  std::vector<int64_t> seg_starts;  // [U + 1] segment boundaries into keys
  std::vector<int64_t> bags;        // [M] bag of each sorted entry
  int64_t num_unique() const { return static_cast<int64_t>(seg_starts.size()) - 1; }
};

// Stable LSD radix sort of packed (key << shift | value) words on bits
// [shift, shift + key_bits): one array of 8-byte words instead of two (half
// the memory traffic of RadixSortPairs). Each pass splits the words into one
// contiguous chunk per pool thread: the chunks count their digits in
// parallel, the offsets are laid out digit-major and chunk-minor (so equal
// digits keep their order: stable, and the same result for any thread
// count), and the chunks scatter in parallel. A pass whose digit is the same
// for every word is skipped. The low `shift` bits ride along.
inline void RadixSortPacked(thread::ThreadPool* pool, std::vector<uint64_t>* words,
                            std::vector<uint64_t>* tmp, int shift, int key_bits) {
  const int64_t n = static_cast<int64_t>(words->size());
  if (n <= 1 || key_bits <= 0) return;
  const RadixDigits digits(key_bits);
  const int64_t buckets = digits.buckets;
  const uint64_t mask = digits.mask;
  const int64_t chunks =
      n < 65536 ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool->NumThreads(), n / 32768));
  // Each loop reads its bound into a local first: the loops store int64_t
  // counts, which may alias n, so a bound written in the condition
  // (chunk_begin(c + 1)) was recomputed, with a 64-bit division, per word.
  auto chunk_begin = [&](int64_t c) { return n * c / chunks; };
  auto for_chunks = [&](auto fn) {
    if (chunks == 1) {
      fn(0);
      return;
    }
    pool->ParallelFor(chunks, std::numeric_limits<int32_t>::max(),
                      [&](int64_t first, int64_t last) {
                        for (int64_t c = first; c < last; ++c) fn(c);
                      });
  };
  std::vector<int64_t> count(chunks * buckets);
  tmp->resize(n);
  for (int pass = 0; pass < digits.passes; ++pass) {
    const int sh = shift + pass * digits.bits;
    const uint64_t* src = words->data();
    std::fill(count.begin(), count.end(), 0);
    for_chunks([&](int64_t c) {
      int64_t* cc = count.data() + c * buckets;
      const int64_t end = chunk_begin(c + 1);
      for (int64_t i = chunk_begin(c); i < end; ++i) ++cc[(src[i] >> sh) & mask];
    });
    const uint64_t first_digit = (src[0] >> sh) & mask;
    int64_t first_total = 0;
    for (int64_t c = 0; c < chunks; ++c) first_total += count[c * buckets + first_digit];
    if (first_total == n) continue;
    int64_t running = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t here = count[c * buckets + d];
        count[c * buckets + d] = running;
        running += here;
      }
    }
    uint64_t* dst = tmp->data();
    for_chunks([&](int64_t c) {
      int64_t* cc = count.data() + c * buckets;
      const int64_t end = chunk_begin(c + 1);
      for (int64_t i = chunk_begin(c); i < end; ++i) {
        dst[cc[(src[i] >> sh) & mask]++] = src[i];
      }
    });
    words->swap(*tmp);
  }
}

template <typename Tindex>
void SortEntries(thread::ThreadPool* pool, const Tindex* ids, const int64_t* splits,
                 int64_t num_bags, int64_t nnz, int64_t num_rows, const BagAttrs& attrs,
                 SortedEntries* s) {
  const int key_bits = BitsFor(num_rows);
  const int pos_bits = BitsFor(nnz);
  const int bag_bits = BitsFor(num_bags);
  int64_t m = 0;
  if (key_bits + bag_bits + pos_bits <= 64) {
    // (id, bag, position) packed into one word, written bag by bag: positions
    // ascend on input and the sort is stable, so equal ids keep their
    // positions in order; the bags come out of the sort without a gather.
    const int low_bits = bag_bits + pos_bits;
    // Scratch kept per thread between calls (grown, never shrunk): a fresh
    // multi-MiB vector per call costs a page fault per 4 KiB, as much as the
    // sort itself at small D.
    static thread_local std::vector<uint64_t> words, tmp;
    words.resize(nnz);
    for (int64_t b = 0; b < num_bags; ++b) {
      const uint64_t bag = static_cast<uint64_t>(b) << pos_bits;
      for (int64_t j = splits[b]; j < splits[b + 1]; ++j) {
        if (IsPadding(ids[j], attrs)) continue;
        words[m++] = (static_cast<uint64_t>(ids[j]) << low_bits) | bag | static_cast<uint64_t>(j);
      }
    }
    words.resize(m);
    RadixSortPacked(pool, &words, &tmp, low_bits, key_bits);
    const uint64_t pos_mask = pos_bits == 0 ? 0 : (~uint64_t{0} >> (64 - pos_bits));
    const uint64_t bag_mask = bag_bits == 0 ? 0 : (~uint64_t{0} >> (64 - bag_bits));
    s->keys.resize(m);
    s->positions.resize(m);
    s->bags.resize(m);
    uint64_t* keys_out = s->keys.data();
    int64_t* bags_out = s->bags.data();
    int64_t* positions_out = s->positions.data();
    const uint64_t* sorted = words.data();
    auto unpack = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint64_t w = sorted[i];
        keys_out[i] = w >> low_bits;
        bags_out[i] = static_cast<int64_t>((w >> pos_bits) & bag_mask);
        positions_out[i] = static_cast<int64_t>(w & pos_mask);
      }
    };
    if (m < 65536) {
      unpack(0, m);
    } else {
      pool->ParallelFor(m, 4, unpack);
    }
  } else {
    std::vector<int64_t> bag_of_entry(nnz);  // [nnz] the bag of each entry
    int64_t* bag_of = bag_of_entry.data();
    ForBalancedBlocks(pool, splits, num_bags, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        std::fill(bag_of + splits[b], bag_of + splits[b + 1], b);
      }
    });
    s->keys.clear();
    s->positions.clear();
    s->keys.reserve(nnz);
    s->positions.reserve(nnz);
    for (int64_t j = 0; j < nnz; ++j) {
      if (IsPadding(ids[j], attrs)) continue;
      s->keys.push_back(static_cast<uint64_t>(ids[j]));
      s->positions.push_back(j);
    }
    RadixSortPairs(&s->keys, &s->positions, key_bits);
    m = static_cast<int64_t>(s->keys.size());
    // The bag of each sorted entry, gathered once here with independent
    // loads, so the reduction's inner loop does not wait on a chain of cache
    // misses (position -> bag -> upstream-gradient row).
    s->bags.resize(m);
    int64_t* bags = s->bags.data();
    const int64_t* positions = s->positions.data();
    auto gather_bags = [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) bags[k] = bag_of[positions[k]];
    };
    if (m < 65536) {
      gather_bags(0, m);
    } else {
      pool->ParallelFor(m, 4, gather_bags);
    }
  }
  s->seg_starts.clear();
  const uint64_t* keys = s->keys.data();
  for (int64_t i = 0; i < m; ++i) {
    if (i == 0 || keys[i] != keys[i - 1]) s->seg_starts.push_back(i);
  }
  s->seg_starts.push_back(m);
}

// Scratch of one CPU thread, reused by every params-gradient call that runs on
// it: the sorted view and the per-entry coefficients are several vectors of
// [nnz] each, and a fresh multi-MiB vector per call costs a page fault per 4
// KiB (at D = 16 as much time as the reduction). Grown, never shrunk: a thread
// keeps about 40 bytes per entry of the largest batch it has seen. A kernel's
// Compute never re-enters on its thread (a parallel loop's caller works on its
// blocks, then waits), and the blocks do not use this scratch, so one set per
// thread suffices.
struct ThreadScratch {
  SortedEntries sorted;
  std::vector<float> coef_f, w_f;
  std::vector<double> coef_d, w_d;
  static ThreadScratch& Get() {
    static thread_local ThreadScratch scratch;
    return scratch;
  }
  std::vector<float>* coef(float*) { return &coef_f; }
  std::vector<double>* coef(double*) { return &coef_d; }
  std::vector<float>* weights(float*) { return &w_f; }
  std::vector<double>* weights(double*) { return &w_d; }
};

// coef[k] = scales[b] * weights[j] (scales[b] unweighted) for sorted entry k of
// bag b at position j: the factor of its upstream-gradient row, gathered with
// independent loads before the reduction, whose loop would otherwise wait on
// the random weights[j] of every entry. w_sorted (when not null) gets
// weights[j] itself.
template <typename T>
void SortedCoefficients(thread::ThreadPool* pool, const SortedEntries& s, const T* weights,
                        const AccT<T>* scales, std::vector<AccT<T>>* coef,
                        std::vector<AccT<T>>* w_sorted) {
  using Acc = AccT<T>;
  const int64_t m = static_cast<int64_t>(s.bags.size());
  coef->resize(m);
  if (w_sorted != nullptr) w_sorted->resize(m);
  Acc* c = coef->data();
  Acc* ws = w_sorted != nullptr ? w_sorted->data() : nullptr;
  const int64_t* bags = s.bags.data();
  const int64_t* positions = s.positions.data();
  auto fill = [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const Acc w = weights != nullptr ? static_cast<Acc>(weights[positions[k]]) : Acc(1);
      c[k] = scales[bags[k]] * w;
      if (ws != nullptr) ws[k] = w;
    }
  };
  if (m < 65536) {
    fill(0, m);
  } else {
    pool->ParallelFor(m, 4, fill);
  }
}

// Zeroes the rows of a dense [num_rows, dim] gradient that no sorted entry
// touches: the gaps between consecutive unique ids. The touched rows are
// written whole by the reduction, so each row is written once (where zeroing
// the table first wrote the touched ones twice: nearly all of them at
// 65,536 x 256 with 262,144 lookups). Nothing to zero returns at once, and
// fewer than kInlineZeroBytes of zeros are written on the calling thread:
// ParallelFor waits for the pool's threads, which cost 96 us on a 2-core VM
// for TT's [U, D] rows gradient, every row of it touched (BENCHMARKS.md,
// 2026-12-07, eleventh).
template <typename T>
void ZeroUntouchedRows(thread::ThreadPool* pool, const SortedEntries& s, int64_t num_rows,
                       int64_t dim,
                       T* out) {  // [num_rows, dim]
  constexpr int64_t kInlineZeroBytes = int64_t{256} << 10;
  const int64_t num_unique = s.num_unique();
  const int64_t untouched = num_rows - num_unique;
  if (untouched == 0) return;
  const uint64_t* keys = s.keys.data();
  const int64_t* seg_starts = s.seg_starts.data();
  auto unique_id = [&](int64_t u) { return static_cast<int64_t>(keys[seg_starts[u]]); };
  auto zero = [&](int64_t begin, int64_t end) {
    // The first unique id >= begin.
    int64_t lo = 0, hi = num_unique;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (unique_id(mid) < begin) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    int64_t u = lo;
    int64_t row = begin;
    while (row < end) {
      const int64_t next = u < num_unique ? std::min(unique_id(u), end) : end;
      std::fill(out + row * dim, out + next * dim, T(0));
      if (next < end) {  // rows[next] is touched: skip it
        row = next + 1;
        ++u;
      } else {
        row = next;
      }
    }
  };
  if (untouched * dim * static_cast<int64_t>(sizeof(T)) < kInlineZeroBytes) {
    zero(0, num_rows);
  } else {
    pool->ParallelFor(num_rows, dim, zero);
  }
}

// Per-bag scale (see BagScale), computed once per bag.
template <typename T, typename Tindex>
void ComputeBagScales(thread::ThreadPool* pool, const Tindex* ids, const T* weights,
                      const int64_t* splits, int64_t num_bags, const BagAttrs& attrs,
                      std::vector<AccT<T>>* scales) {
  scales->resize(num_bags);
  auto* out = scales->data();
  ForBalancedBlocks(pool, splits, num_bags, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      out[b] = ComputeBagScale(ids, weights, splits[b], splits[b + 1], attrs);
    }
  });
}

// Reduces segment u of the sorted entries into acc ([D]).
template <typename T>
inline void ReduceSegment(const SortedEntries& s, int64_t u,
                          const T* grad,        // [B, D]
                          const AccT<T>* coef,  // [M] (SortedCoefficients), or null for max
                          const int32* argmax,  // [B, D] or null
                          const int64_t* splits, int64_t dim, AccT<T>* acc) {
  using Acc = AccT<T>;
  std::fill(acc, acc + dim, Acc(0));
  const int64_t num_sorted = static_cast<int64_t>(s.bags.size());
  for (int64_t k = s.seg_starts[u]; k < s.seg_starts[u + 1]; ++k) {
    const int64_t j = s.positions[k];
    const int64_t b = s.bags[k];
    if (k + kPrefetchDistance < num_sorted) {
      PrefetchRow(grad + s.bags[k + kPrefetchDistance] * dim, dim);
    }
    const T* dy = grad + b * dim;
    if (argmax != nullptr) {
      const int32* pos = argmax + b * dim;
      const int32 p = static_cast<int32>(j - splits[b]);
      for (int64_t d = 0; d < dim; ++d) {
        acc[d] += pos[d] == p ? static_cast<Acc>(dy[d]) : Acc(0);
      }
      continue;
    }
    Axpy(acc, coef[k], dy, dim);
  }
}

// A switch on `left` (a bag's remaining column chunks) whose cases are CASE(1)
// ... CASE(n) for the n of CASES (TF_TTEMB_CHUNKS_4, _8 or _16), each ending in
// `break`; other values do nothing.
#define TF_TTEMB_CHUNKS_4(C) C(1) C(2) C(3) C(4)
#define TF_TTEMB_CHUNKS_8(C) TF_TTEMB_CHUNKS_4(C) C(5) C(6) C(7) C(8)
#define TF_TTEMB_CHUNKS_16(C) TF_TTEMB_CHUNKS_8(C) C(9) C(10) C(11) C(12) C(13) C(14) C(15) C(16)
#define TF_TTEMB_SWITCH_CHUNKS(left, CASES, CASE) \
  switch (left) {                                 \
    CASES(CASE)                                   \
    default:                                      \
      break;                                      \
  }

// <dy_b, out_b> per bag, for the weights gradient of mean and sqrtn; zeros
// for sum, which does not read them.
template <typename T>
void BagDyDotOut(thread::ThreadPool* pool, Combiner combiner, const int64_t* splits,
                 int64_t num_bags, int64_t dim,
                 const T* grad,    // [B, D]
                 const T* output,  // [B, D]
                 std::vector<AccT<T>>* dy_dot_out) {
  using Acc = AccT<T>;
  dy_dot_out->assign(num_bags, Acc(0));
  if (combiner == Combiner::kSum) return;
  Acc* out = dy_dot_out->data();
  ForBalancedBlocks(pool, splits, num_bags, dim, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) out[b] = Dot<Acc>(grad + b * dim, output + b * dim, dim);
  });
}

// Segment u of a weighted backward (the fused gradient and the sparse apply of
// weighted sum, mean and sqrtn): acc[0, dim) = the sum over the segment's
// sorted entries k of coef[k] * dy_{bag k}, in ReduceSegment's order, and,
// with the segment's table row read once, the weights gradient of each entry
// (WeightGradFromDot) written to dw[its position]; an entry of a bag of scale
// 0 keeps its 0, as in the forward.
template <typename T>
inline void ReduceWeightedSegment(const SortedEntries& s, int64_t u,
                                  const T* grad,              // [B, D]
                                  const T* row,               // [D] the segment's table row
                                  const AccT<T>* coef,        // [M] SortedCoefficients
                                  const AccT<T>* ws,          // [M] their weights
                                  const AccT<T>* scales,      // [B] BagScale
                                  const AccT<T>* dy_dot_out,  // [B] BagDyDotOut
                                  Combiner combiner, int64_t dim,
                                  AccT<T>* acc,  // [D]
                                  T* dw) {       // [nnz]
  using Acc = AccT<T>;
  std::fill(acc, acc + dim, Acc(0));
  const int64_t num_sorted = static_cast<int64_t>(s.bags.size());
  const int64_t* bags = s.bags.data();
  for (int64_t k = s.seg_starts[u]; k < s.seg_starts[u + 1]; ++k) {
    const int64_t b = bags[k];
    if (k + kPrefetchDistance < num_sorted) {
      PrefetchRow(grad + bags[k + kPrefetchDistance] * dim, dim);
    }
    const T* dy = grad + b * dim;
    const Acc scale = scales[b];
    Axpy(acc, coef[k], dy, dim);
    if (scale == Acc(0)) continue;
    const Acc dot = Dot<Acc>(dy, row, dim);
    dw[s.positions[k]] =
        static_cast<T>(WeightGradFromDot(combiner, dot, dy_dot_out[b], scale, ws[k]));
  }
}

// Registers Kernel<CpuDevice, T, Tindex, extra...> as the CPU kernel of `op`
// for every value type T and index type Tindex of the family's CPU kernels:
//   TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GatherReduceSum", GatherReduceSumOp, false)
#define TF_TTEMB_REGISTER_CPU_BAG_OP(op, Kernel, ...)                         \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, Eigen::half, int32, Kernel, ##__VA_ARGS__)   \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, Eigen::half, int64_t, Kernel, ##__VA_ARGS__) \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, bfloat16, int32, Kernel, ##__VA_ARGS__)      \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, bfloat16, int64_t, Kernel, ##__VA_ARGS__)    \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, float, int32, Kernel, ##__VA_ARGS__)         \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, float, int64_t, Kernel, ##__VA_ARGS__)       \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, double, int32, Kernel, ##__VA_ARGS__)        \
  TF_TTEMB_CPU_BAG_KERNEL_OF(op, double, int64_t, Kernel, ##__VA_ARGS__)
#define TF_TTEMB_CPU_BAG_KERNEL_OF(op, T, Tindex, Kernel, ...)                               \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name(op).Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Tindex>("Tindices"), \
      Kernel<CpuDevice, T, Tindex, ##__VA_ARGS__>);

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_CPU_H_
