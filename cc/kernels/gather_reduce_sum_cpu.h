// Internal to the gather_reduce_sum CPU kernels (gather_reduce_sum_forward_cpu.cc,
// gather_reduce_sum_backward_cpu.cc, gather_reduce_sum_sparse_apply_cpu.cc): the pool
// helpers, the row arithmetic, the bag scales, the sort of the entries by id and the
// registration macros they share. Not for other callers; the contract shared with the GPU
// glue is gather_reduce_sum_kernels.h.

#ifndef TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_CPU_H_
#define TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_CPU_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace tf_ttemb {

inline thread::ThreadPool* CpuPool(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->workers;
}

// Splits [0, n) into at most `max_blocks` contiguous blocks of about equal
// work, where prefix[i] is the cumulative work before item i (prefix has
// n + 1 entries, prefix[n] the total). Returns the n_blocks + 1 boundaries.
inline std::vector<int64_t> BalancedBlocks(const int64_t* prefix, int64_t n, int64_t max_blocks) {
  std::vector<int64_t> bounds{0};
  if (n == 0) return bounds;
  const int64_t total = prefix[n] - prefix[0];
  const int64_t blocks = std::max<int64_t>(1, std::min(max_blocks, n));
  for (int64_t k = 1; k < blocks; ++k) {
    const int64_t target = prefix[0] + total * k / blocks;
    int64_t pos = std::lower_bound(prefix, prefix + n + 1, target) - prefix;
    pos = std::min(std::max(pos, bounds.back()), n);
    if (pos > bounds.back()) bounds.push_back(pos);
  }
  if (bounds.back() != n) bounds.push_back(n);
  return bounds;
}

// Runs fn(begin, end) over the balanced blocks, one block per work item.
template <typename Fn>
void ForBalancedBlocks(thread::ThreadPool* pool, const int64_t* prefix, int64_t n,
                       int64_t cost_per_item, Fn fn) {
  const int64_t threads = pool->NumThreads();
  const int64_t total_cost = (prefix[n] - prefix[0] + n) * std::max<int64_t>(1, cost_per_item);
  // Small problems run inline: the pool's overhead would dominate.
  if (threads <= 1 || total_cost < 100000) {
    fn(0, n);
    return;
  }
  const std::vector<int64_t> bounds = BalancedBlocks(prefix, n, 4 * threads);
  const int64_t num_blocks = static_cast<int64_t>(bounds.size()) - 1;
  pool->ParallelFor(num_blocks, std::numeric_limits<int32_t>::max(),
                    [&](int64_t first, int64_t last) {
                      for (int64_t k = first; k < last; ++k) {
                        fn(bounds[k], bounds[k + 1]);
                      }
                    });
}

// Finds the first index that is neither in [0, num_rows) nor the padding id.
template <typename Tindex>
Status ValidateIndices(thread::ThreadPool* pool, const Tindex* ids, int64_t nnz, int64_t num_rows,
                       const BagAttrs& attrs) {
  std::atomic<int64_t> first_bad{nnz};
  auto check = [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t id = static_cast<int64_t>(ids[j]);
      if ((id < 0 || id >= num_rows) && !IsPadding(ids[j], attrs)) {
        int64_t seen = first_bad.load();
        while (j < seen && !first_bad.compare_exchange_weak(seen, j)) {
        }
        return;
      }
    }
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

template <typename Acc>
inline void Axpy(Acc* __restrict acc, Acc w, const float* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
}
template <typename Acc>
inline void Axpy(Acc* __restrict acc, Acc w, const double* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
}
template <typename Acc, typename T>
inline void Axpy(Acc* __restrict acc, Acc w, const T* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * static_cast<Acc>(row[d]);
}

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

// Prefetches every cache line of a row that will be read soon, so the
// random-access gather runs at memory bandwidth rather than latency.
template <typename T>
inline void PrefetchRow(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Dot product in Acc with 16 independent partial sums (vectorisable without
// reassociation flags; the summation order is fixed, so results are
// deterministic).
template <typename Acc, typename A, typename B>
inline Acc Dot(const A* __restrict a, const B* __restrict b, int64_t dim) {
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
  Acc sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
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
  std::optional<BlockedSum<Acc>> blocks;
  Acc sum = 0, sq_sum = 0;  // the current block's
  for (int64_t block = begin; block < end; block += kSumBlock) {
    const int64_t block_end = std::min(end, block + kSumBlock);
    sum = sq_sum = 0;
    for (int64_t j = block; j < block_end; ++j) {
      if (IsPadding(ids[j], attrs)) continue;
      const Acc w = attrs.has_weights ? static_cast<Acc>(weights[j]) : Acc(1);
      sum += w;
      if (kFusedSquare) {
        sq_sum += w * w;
      } else {
        sq_sum += RoundedSquare(w);
      }
    }
    if (block_end == end) break;
    if (!blocks) {
      blocks.emplace(2);
      blocks->Reset();
    }
    blocks->current()[0] = sum;
    blocks->current()[1] = sq_sum;
    blocks->Carry();
  }
  if (blocks) {
    blocks->current()[0] = sum;
    blocks->current()[1] = sq_sum;
    const Acc* total = blocks->Total();
    sum = total[0];
    sq_sum = total[1];
  }
  return BagScale(attrs.combiner, sum, sq_sum);
}

template <typename T, typename Tindex>
inline AccT<T> ComputeBagScale(const Tindex* ids, const T* weights, int64_t begin, int64_t end,
                               const BagAttrs& attrs) {
  return BagScaleOf<true>(ids, weights, begin, end, attrs);
}

// ---------------------------------------------------------------------------
// The entries sorted by id (the backward and the sparse apply).

// Stable LSD radix sort of (key, value) pairs on the low `key_bits` bits of
// the keys. Sorted output ends in keys/values; tmp buffers are scratch.
inline void RadixSortPairs(std::vector<uint64_t>* keys, std::vector<int64_t>* values,
                           int key_bits) {
  const int64_t n = static_cast<int64_t>(keys->size());
  if (n <= 1 || key_bits <= 0) return;
  const int passes = (key_bits + 10) / 11;
  const int digit_bits = (key_bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit_bits;
  const uint64_t mask = static_cast<uint64_t>(buckets - 1);
  std::vector<uint64_t> keys_tmp(n);
  std::vector<int64_t> values_tmp(n);
  std::vector<int64_t> count(buckets);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * digit_bits;
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
  std::vector<int64_t> bag_of;      // [nnz] bag of each entry
  std::vector<int64_t> bags;        // [M] bag of each sorted entry
  int64_t num_unique() const { return static_cast<int64_t>(seg_starts.size()) - 1; }
};

template <typename Tindex>
void SortEntries(thread::ThreadPool* pool, const Tindex* ids, const int64_t* splits,
                 int64_t num_bags, int64_t nnz, int64_t num_rows, const BagAttrs& attrs,
                 SortedEntries* s) {
  s->bag_of.resize(nnz);
  int64_t* bag_of = s->bag_of.data();
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
  RadixSortPairs(&s->keys, &s->positions, BitsFor(num_rows));
  const int64_t m = static_cast<int64_t>(s->keys.size());
  s->seg_starts.clear();
  for (int64_t i = 0; i < m; ++i) {
    if (i == 0 || s->keys[i] != s->keys[i - 1]) s->seg_starts.push_back(i);
  }
  s->seg_starts.push_back(m);
  // The bag of each sorted entry, gathered once here with independent loads,
  // so the reduction's inner loop does not wait on a chain of cache misses
  // (position -> bag -> upstream-gradient row).
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
                          const T* weights,     // [nnz] or null
                          const int32* argmax,  // [B, D] or null
                          const int64_t* splits, const AccT<T>* scales, int64_t dim, AccT<T>* acc) {
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
    const Acc c = scales[b] * (weights != nullptr ? static_cast<Acc>(weights[j]) : Acc(1));
    Axpy(acc, c, dy, dim);
  }
}

// Registers `...` (the kernel class with its template arguments) as the CPU kernel
// of `op` for values T and indices Tindex.
#define TF_TTEMB_REGISTER_CPU_BAG_KERNEL(op, T, Tindex, ...)                                 \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name(op).Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Tindex>("Tindices"), \
      __VA_ARGS__);

// Expands M(T, Tindex) for every value and index type of the family's CPU kernels.
#define TF_TTEMB_FOR_CPU_BAG_TYPES(M) \
  M(Eigen::half, int32)               \
  M(Eigen::half, int64_t)             \
  M(bfloat16, int32)                  \
  M(bfloat16, int64_t)                \
  M(float, int32)                     \
  M(float, int64_t)                   \
  M(double, int32)                    \
  M(double, int64_t)

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_CPU_H_
