// CPU kernels of ResourceGroupedGatherSum and its gradient (cc/ops/grouped_bags_ops.cc):
// every feature's sum bags on the stacked table in one op, table after table.
//
// GroupBags + GatherReduceSum orders the bags example by example, so that the
// output is the [B, T * D] concatenation; on the CPU that order alternates
// between the tables at every bag (a small table's rows leave the cache between
// two of its bags) and, in the backward pass, reads the upstream gradient of one
// table's rows scattered over the whole [B, T * D] gradient. These kernels keep
// the input's order (feature after feature, as separate EmbeddingBag layers run):
// the forward writes each bag's [D] slice of the [B, T * D] output in place, with
// no reordering of the bags and no transpose. Measured on a 2-core CPU at the
// Criteo-like shape of python/bench/bench_grouped.py (scale 0.1, batch 8,192),
// each op takes about 20% less CPU time than its GroupBags + GatherReduceSum
// counterpart.
//
// Forward: the bags are split over the thread pool in blocks of about equal entry
// counts; each bag's weighted sum is accumulated in AccT<T> in entry order and
// written to output[b, t * D : (t + 1) * D].
//
// Backward: the upstream gradient is first copied bag by bag of the input
// ([T * B, D]: each table's bags together, a few pages apart rather than every
// T * D-th row of [B, T * D], which costs a TLB miss per entry). The stacked
// table's rows are split into ranges, one per set of
// features whose tables overlap (features sharing a table form one range). Each
// range's non-padding entries are radix-sorted by row (stable, as many key bits
// as the range has rows; ranges in parallel), which groups equal rows into
// segments with their entries in input order. Each segment is reduced by one
// thread in that fixed order: deterministic, no atomics. The segments of all
// ranges, in row order, give the deduplicated IndexedSlices ([U] ascending rows
// of the stacked table, [U, D]); with weights, the weights gradient of each entry
// (<dy, row>) is computed with its segment's row loaded once.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/grouped_bags_kernels.h"
#include "cc/kernels/shape_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {
namespace {

constexpr int64_t kPrefetchAhead = 4;  // entries
constexpr int64_t kExamples = 64;      // examples per task of the gradient's reordering

template <typename T>
inline void PrefetchRange(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset);
  }
}

// acc += w * row, over [dim] (restrict: the compiler vectorizes it).
template <typename T, typename Acc>
inline void AddScaled(Acc* __restrict acc, Acc w, const T* __restrict row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * static_cast<Acc>(row[d]);
}

template <typename T, typename Acc>
inline Acc DotOf(const T* __restrict x, const T* __restrict y, int64_t dim) {
  Acc dot = 0;
  for (int64_t d = 0; d < dim; ++d) dot += static_cast<Acc>(x[d]) * static_cast<Acc>(y[d]);
  return dot;
}

template <typename T, typename Acc>
inline void Store(T* __restrict out, const Acc* __restrict acc, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<T>(acc[d]);
}

// Runs fn(begin, end) over [0, n) in at most 4 blocks per pool thread of about
// equal work, prefix[i] being the work before item i (prefix[n] the total).
template <typename Fn>
void ForWorkBlocks(thread::ThreadPool* pool, const int64_t* prefix, int64_t n, Fn fn) {
  const int64_t threads = pool->NumThreads();
  const int64_t total = prefix[n] - prefix[0] + n;
  if (n == 0) return;
  if (threads <= 1 || total < 4096) {
    fn(0, n);
    return;
  }
  const int64_t blocks = std::min<int64_t>(n, 4 * threads);
  std::vector<int64_t> bounds{0};
  for (int64_t k = 1; k < blocks; ++k) {
    // The first item whose prefix (work plus one per item) reaches k / blocks.
    const int64_t target = total * k / blocks;
    int64_t lo = bounds.back(), hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (prefix[mid] - prefix[0] + mid < target) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    if (lo > bounds.back() && lo < n) bounds.push_back(lo);
  }
  bounds.push_back(n);
  pool->ParallelFor(static_cast<int64_t>(bounds.size()) - 1, std::numeric_limits<int32>::max(),
                    [&](int64_t first, int64_t last) {
                      for (int64_t k = first; k < last; ++k) fn(bounds[k], bounds[k + 1]);
                    });
}

// The inputs shared by the two ops, checked (row_splits, every id against its own
// feature's table, the stacked table's size): the first bad id (smallest
// position) raises GroupBags' message.
struct GroupedSumArgs {
  int64_t nnz = 0;
  int64_t batch = 0;     // B
  int64_t features = 0;  // T
  int64_t num_rows = 0;  // N, of the stacked table
  int64_t dim = 0;       // D
  const int64_t* splits = nullptr;
};

template <typename Tindex>
Status CheckGroupedSumInputs(thread::ThreadPool* pool, const GroupAttrs& attrs,
                             const Tensor& indices, const Tensor& row_splits, const Tensor& weights,
                             const Tensor& params, GroupedSumArgs* a) {
  GroupArgs group;
  TF_RETURN_IF_ERROR(ValidateGroupInputs(attrs, indices, row_splits, weights, &group));
  TF_RETURN_IF_ERROR(ValidateParamsShape(params));
  a->nnz = group.nnz;
  a->batch = group.batch;
  a->features = attrs.num_features();
  a->num_rows = params.dim_size(0);
  a->dim = params.dim_size(1);
  for (int64_t t = 0; t < a->features; ++t) {
    if (attrs.row_offsets[t] + attrs.num_rows[t] > a->num_rows) {
      return errors::InvalidArgument(
          "params has ", a->num_rows, " rows but feature ", attrs.labels[t], "'s table needs ",
          attrs.row_offsets[t] + attrs.num_rows[t], " (row_offsets + num_rows)");
    }
  }
  a->splits = row_splits.flat<int64_t>().data();
  TF_RETURN_IF_ERROR(ValidateRowSplits(a->splits, a->features * a->batch, a->nnz));
  const Tindex* ids = indices.flat<Tindex>().data();
  const int64_t batch = a->batch;
  const int64_t* splits = a->splits;
  std::atomic<int64_t> first_bad{a->nnz};
  std::vector<int64_t> feature_entries(a->features + 1);
  for (int64_t t = 0; t <= a->features; ++t) feature_entries[t] = splits[t * batch];
  ForWorkBlocks(pool, feature_entries.data(), a->features, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rows = attrs.num_rows[t];
      for (int64_t j = splits[t * batch]; j < splits[(t + 1) * batch]; ++j) {
        const int64_t id = static_cast<int64_t>(ids[j]);
        if ((id < 0 || id >= rows) && !attrs.IsPadding(t, id)) {
          int64_t seen = first_bad.load();
          while (j < seen && !first_bad.compare_exchange_weak(seen, j)) {
          }
          break;
        }
      }
    }
  });
  const int64_t j = first_bad.load();
  if (j == a->nnz) return OkStatus();
  int64_t t = 0;
  while (t + 1 < a->features && splits[(t + 1) * batch] <= j) ++t;
  return GroupBadIndexError(attrs, t, j - splits[t * batch], static_cast<int64_t>(ids[j]));
}

// The OpKernel of both ops: the group attrs, parsed once; the stacked table
// (resource input kParams, read under its variable's shared lock) and the bags
// (inputs kParams + 1 to 3) checked, then Op::Run(ctx, pool, params, args).
template <typename Op, typename T, typename Tindex, int kParams>
class GroupedSumKernel : public OpKernel {
 public:
  explicit GroupedSumKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetGroupAttrs(ctx, /*with_weights=*/true, &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    thread::ThreadPool* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    OP_REQUIRES_OK(ctx, WithParamsStatus<T, true>(ctx, kParams, [&](const Tensor& params) {
                     GroupedSumArgs a;
                     TF_RETURN_IF_ERROR(CheckGroupedSumInputs<Tindex>(
                         pool, attrs_, ctx->input(kParams + 1), ctx->input(kParams + 2),
                         ctx->input(kParams + 3), params, &a));
                     return static_cast<Op*>(this)->Run(ctx, pool, params, a);
                   }));
  }

 protected:
  GroupAttrs attrs_;
};

// ---------------------------------------------------------------------------
// Forward.

template <typename T, typename Tindex>
class GroupedSumOp : public GroupedSumKernel<GroupedSumOp<T, Tindex>, T, Tindex, 0> {
 public:
  using GroupedSumKernel<GroupedSumOp, T, Tindex, 0>::GroupedSumKernel;

  Status Run(OpKernelContext* ctx, thread::ThreadPool* pool, const Tensor& params,
             const GroupedSumArgs& a) {
    const GroupAttrs& attrs = this->attrs_;
    using Acc = AccT<T>;
    const Tensor& indices = ctx->input(1);
    const Tensor& weights_in = ctx->input(3);
    TensorShape shape;
    TF_RETURN_IF_ERROR(MatrixShape("output [B, T * D]", a.batch, a.features * a.dim, &shape));
    Tensor* output = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, shape, &output));
    const int64_t batch = a.batch, features = a.features, dim = a.dim;
    if (output->NumElements() == 0) return OkStatus();
    const T* table = params.flat<T>().data();
    const Tindex* ids = indices.flat<Tindex>().data();
    const T* weights = attrs.has_weights ? weights_in.flat<T>().data() : nullptr;
    const int64_t* splits = a.splits;
    T* out = output->flat<T>().data();
    // Bag k = t * B + b of the input: feature t's bag of example b.
    ForWorkBlocks(pool, splits, features * batch, [&](int64_t begin, int64_t end) {
      std::vector<Acc> acc(dim);
      for (int64_t k = begin; k < end; ++k) {
        const int64_t t = k / batch, b = k - t * batch;
        const T* base = table + attrs.row_offsets[t] * dim;
        const int64_t rows = attrs.num_rows[t];
        const int64_t feature_end = splits[(t + 1) * batch];
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t j = splits[k]; j < splits[k + 1]; ++j) {
          const int64_t ahead = j + kPrefetchAhead;
          if (ahead < feature_end) {
            const int64_t next = static_cast<int64_t>(ids[ahead]);
            if (next >= 0 && next < rows) PrefetchRange(base + next * dim, dim);
          }
          const int64_t id = static_cast<int64_t>(ids[j]);
          if (attrs.IsPadding(t, id)) continue;
          const Acc w = weights != nullptr ? static_cast<Acc>(weights[j]) : Acc(1);
          AddScaled(acc.data(), w, base + id * dim, dim);
        }
        Store(out + (b * features + t) * dim, acc.data(), dim);
      }
    });
    return OkStatus();
  }
};

// ---------------------------------------------------------------------------
// Backward.

// A range of the stacked table's rows [low, high) holding the tables of
// `features` (which overlap, or are one shared table), and where its entries
// and segments go in the op's sorted arrays.
struct RowRange {
  int64_t low = 0, high = 0;
  std::vector<int64_t> features;
  int64_t entries = 0;        // non-padding entries
  int64_t first_entry = 0;    // in the sorted arrays
  int64_t first_segment = 0;  // in the unique rows
  int64_t segments = 0;
};

// The row ranges of the features' tables, in row order.
std::vector<RowRange> RowRanges(const GroupAttrs& attrs) {
  std::vector<int64_t> order(attrs.num_features());
  for (int64_t t = 0; t < attrs.num_features(); ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return attrs.row_offsets[x] < attrs.row_offsets[y];
  });
  std::vector<RowRange> ranges;
  for (const int64_t t : order) {
    const int64_t low = attrs.row_offsets[t], high = low + attrs.num_rows[t];
    if (ranges.empty() || low >= ranges.back().high) {
      ranges.emplace_back();
      ranges.back().low = low;
      ranges.back().high = high;
    }
    ranges.back().high = std::max(ranges.back().high, high);
    ranges.back().features.push_back(t);
  }
  return ranges;
}

inline int BitsOf(int64_t count) {
  int bits = 0;
  while (bits < 63 && (int64_t{1} << bits) < count) ++bits;
  return bits;
}

// Stable LSD radix sort of `words` on bits [shift, shift + key_bits) (digits of up
// to 11 bits; a pass whose digit is the same for every word is skipped).
void RadixSort(uint64_t* words, uint64_t* tmp, int64_t n, int shift, int key_bits) {
  if (n <= 1 || key_bits <= 0) return;
  const int passes = (key_bits + 10) / 11;
  const int digit_bits = (key_bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit_bits;
  const uint64_t mask = static_cast<uint64_t>(buckets - 1);
  std::vector<int64_t> count(buckets);
  uint64_t* src = words;
  uint64_t* dst = tmp;
  for (int pass = 0; pass < passes; ++pass) {
    const int sh = shift + pass * digit_bits;
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[(src[i] >> sh) & mask];
    if (count[(src[0] >> sh) & mask] == n) continue;
    int64_t running = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      const int64_t here = count[d];
      count[d] = running;
      running += here;
    }
    for (int64_t i = 0; i < n; ++i) dst[count[(src[i] >> sh) & mask]++] = src[i];
    std::swap(src, dst);
  }
  if (src != words) std::copy(src, src + n, words);
}

// Scratch of one CPU thread, reused by every call on it (grown, never shrunk): a
// fresh multi-MiB vector per call costs a page fault per 4 KiB.
struct GroupedSumScratch {
  std::vector<uint64_t> words, tmp;  // [M] (row - low) << pos_bits | entry
  std::vector<int64_t> seg_starts;   // [U + 1] into words
  std::vector<int64_t> entry_rows;   // [nnz] the bag (t * B + b) of each entry
  std::vector<int64_t> grad_rows;    // [M] the same, of each sorted entry
  std::vector<char> grad;            // [T * B, D] of T: the upstream gradient by bag
  static GroupedSumScratch& Get() {
    static thread_local GroupedSumScratch scratch;
    return scratch;
  }
};

template <typename T, typename Tindex>
class GroupedSumGradOp : public GroupedSumKernel<GroupedSumGradOp<T, Tindex>, T, Tindex, 1> {
 public:
  using GroupedSumKernel<GroupedSumGradOp, T, Tindex, 1>::GroupedSumKernel;

  Status Run(OpKernelContext* ctx, thread::ThreadPool* pool, const Tensor& params,
             const GroupedSumArgs& a) {
    const GroupAttrs& attrs = this->attrs_;
    using Acc = AccT<T>;
    const Tensor& grad_in = ctx->input(0);
    const Tensor& indices = ctx->input(2);
    const Tensor& weights_in = ctx->input(4);
    const int64_t batch = a.batch, features = a.features, dim = a.dim, nnz = a.nnz;
    if (grad_in.dims() != 2 || grad_in.dim_size(0) != batch ||
        grad_in.dim_size(1) != features * dim) {
      return errors::InvalidArgument("grad must have shape [", batch, ", ", features * dim,
                                     "], got ", grad_in.shape().DebugString());
    }
    const Tindex* ids = indices.flat<Tindex>().data();
    const int64_t* splits = a.splits;
    const T* weights = attrs.has_weights ? weights_in.flat<T>().data() : nullptr;
    Tensor* weights_grad = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, TensorShape({attrs.has_weights ? nnz : int64_t{0}}),
                                            &weights_grad));
    T* dw = attrs.has_weights ? weights_grad->flat<T>().data() : nullptr;
    if (dw != nullptr) std::fill(dw, dw + nnz, T(0));  // padding entries keep 0

    // The entries of each range, counted, then packed and sorted range by range.
    std::vector<RowRange> ranges = RowRanges(attrs);
    const int64_t num_ranges = static_cast<int64_t>(ranges.size());
    int64_t total = 0;
    for (RowRange& r : ranges) {
      for (const int64_t t : r.features) {
        for (int64_t j = splits[t * batch]; j < splits[(t + 1) * batch]; ++j) {
          r.entries += attrs.IsPadding(t, static_cast<int64_t>(ids[j])) ? 0 : 1;
        }
      }
      r.first_entry = total;
      total += r.entries;
    }
    const int pos_bits = BitsOf(nnz);
    for (const RowRange& r : ranges) {
      if (BitsOf(r.high - r.low) + pos_bits > 64) {
        return errors::InvalidArgument("tables of ", r.high - r.low, " rows with ", nnz,
                                       " ids need more than 64 bits per sort key");
      }
    }
    GroupedSumScratch& scratch = GroupedSumScratch::Get();
    scratch.words.resize(total);
    scratch.tmp.resize(total);
    scratch.entry_rows.resize(nnz);
    int64_t* entry_rows = scratch.entry_rows.data();
    uint64_t* words = scratch.words.data();
    uint64_t* tmp = scratch.tmp.data();
    std::vector<int64_t> range_work(num_ranges + 1);
    for (int64_t g = 0; g < num_ranges; ++g)
      range_work[g + 1] = ranges[g].first_entry + ranges[g].entries;
    std::vector<int64_t> range_unique(num_ranges);
    ForWorkBlocks(pool, range_work.data(), num_ranges, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const RowRange& r = ranges[g];
        uint64_t* w = words + r.first_entry;
        int64_t m = 0;
        // Features in position order: the sort is stable, so a segment's entries
        // keep their input order.
        std::vector<int64_t> by_position = r.features;
        std::sort(by_position.begin(), by_position.end());
        for (const int64_t t : by_position) {
          const uint64_t base = static_cast<uint64_t>(attrs.row_offsets[t] - r.low);
          for (int64_t b = 0; b < batch; ++b) {
            for (int64_t j = splits[t * batch + b]; j < splits[t * batch + b + 1]; ++j) {
              const int64_t id = static_cast<int64_t>(ids[j]);
              if (attrs.IsPadding(t, id)) continue;
              w[m++] = ((base + static_cast<uint64_t>(id)) << pos_bits) | static_cast<uint64_t>(j);
              entry_rows[j] = t * batch + b;
            }
          }
        }
        RadixSort(w, tmp + r.first_entry, m, pos_bits, BitsOf(r.high - r.low));
        int64_t unique = 0;
        for (int64_t i = 0; i < m; ++i) {
          unique += (i == 0 || (w[i] >> pos_bits) != (w[i - 1] >> pos_bits)) ? 1 : 0;
        }
        range_unique[g] = unique;
      }
    });
    int64_t num_unique = 0;
    for (int64_t g = 0; g < num_ranges; ++g) {
      ranges[g].first_segment = num_unique;
      ranges[g].segments = range_unique[g];
      num_unique += range_unique[g];
    }
    scratch.seg_starts.resize(num_unique + 1);
    int64_t* seg_starts = scratch.seg_starts.data();
    seg_starts[num_unique] = total;
    Tensor* unique_rows = nullptr;
    Tensor* values = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({num_unique}), &unique_rows));
    TensorShape values_shape;
    TF_RETURN_IF_ERROR(MatrixShape("values [U, D]", num_unique, dim, &values_shape));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, values_shape, &values));
    int64_t* rows_out = unique_rows->flat<int64_t>().data();
    const uint64_t pos_mask = pos_bits == 0 ? 0 : (~uint64_t{0} >> (64 - pos_bits));
    // Segment starts and rows, and the bag of every sorted entry (gathered with
    // independent loads, before the reduction's dependent ones).
    scratch.grad_rows.resize(total);
    int64_t* grad_rows = scratch.grad_rows.data();
    ForWorkBlocks(pool, range_work.data(), num_ranges, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const RowRange& r = ranges[g];
        const uint64_t* w = words + r.first_entry;
        int64_t u = r.first_segment;
        for (int64_t i = 0; i < r.entries; ++i) {
          if (i == 0 || (w[i] >> pos_bits) != (w[i - 1] >> pos_bits)) {
            seg_starts[u] = r.first_entry + i;
            rows_out[u] = r.low + static_cast<int64_t>(w[i] >> pos_bits);
            ++u;
          }
          grad_rows[r.first_entry + i] = entry_rows[w[i] & pos_mask];
        }
      }
    });
    if (dim == 0 || num_unique == 0) return OkStatus();
    // The upstream gradient bag by bag of the input ([T * B, D], feature after
    // feature), copied in tiles of kExamples examples: a table's entries then read
    // their rows from one [B, D] block (few pages), not every T * D-th row.
    scratch.grad.resize(features * batch * dim * static_cast<int64_t>(sizeof(T)));
    T* dy = reinterpret_cast<T*>(scratch.grad.data());
    const T* dy_in = grad_in.flat<T>().data();
    const int64_t tiles = (batch + kExamples - 1) / kExamples;
    pool->ParallelFor(tiles, kExamples * features * dim, [&](int64_t first, int64_t last) {
      for (int64_t b = first * kExamples; b < std::min(batch, last * kExamples); ++b) {
        for (int64_t t = 0; t < features; ++t) {
          std::copy_n(dy_in + (b * features + t) * dim, dim, dy + (t * batch + b) * dim);
        }
      }
    });
    const T* table = params.flat<T>().data();
    T* values_out = values->flat<T>().data();
    const int64_t rows_ahead = 4;
    ForWorkBlocks(pool, seg_starts, num_unique, [&](int64_t begin, int64_t end) {
      std::vector<Acc> acc(dim);
      for (int64_t u = begin; u < end; ++u) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        const T* row = table + rows_out[u] * dim;
        if (dw != nullptr && u + rows_ahead < end) {
          PrefetchRange(table + rows_out[u + rows_ahead] * dim, dim);
        }
        for (int64_t i = seg_starts[u]; i < seg_starts[u + 1]; ++i) {
          if (i + kPrefetchAhead < total) {
            PrefetchRange(dy + grad_rows[i + kPrefetchAhead] * dim, dim);
          }
          const T* g = dy + grad_rows[i] * dim;
          if (weights == nullptr) {
            AddScaled(acc.data(), Acc(1), g, dim);
            continue;
          }
          const int64_t j = static_cast<int64_t>(words[i] & pos_mask);
          AddScaled(acc.data(), static_cast<Acc>(weights[j]), g, dim);
          dw[j] = static_cast<T>(DotOf<T, Acc>(g, row, dim));
        }
        Store(values_out + u * dim, acc.data(), dim);
      }
    });
    return OkStatus();
  }
};

#define TF_TTEMB_REGISTER(T, Tindex)                                   \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>ResourceGroupedGatherSum")     \
                              .Device(DEVICE_CPU)                      \
                              .TypeConstraint<T>("T")                  \
                              .TypeConstraint<Tindex>("Tindices"),     \
                          GroupedSumOp<T, Tindex>);                    \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>ResourceGroupedGatherSumGrad") \
                              .Device(DEVICE_CPU)                      \
                              .TypeConstraint<T>("T")                  \
                              .TypeConstraint<Tindex>("Tindices"),     \
                          GroupedSumGradOp<T, Tindex>);
#define TF_TTEMB_REGISTER_TYPES(T) TF_TTEMB_REGISTER(T, int32) TF_TTEMB_REGISTER(T, int64_t)
TF_TTEMB_REGISTER_TYPES(Eigen::half)
TF_TTEMB_REGISTER_TYPES(bfloat16)
TF_TTEMB_REGISTER_TYPES(float)
TF_TTEMB_REGISTER_TYPES(double)
#undef TF_TTEMB_REGISTER_TYPES
#undef TF_TTEMB_REGISTER

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow
