// CPU kernels of the gather_reduce_sum family (EmbeddingBag) and the
// validation shared with the GPU glue.
//
// Forward: bags are split into blocks of about equal entry count; each block
// runs on one thread of TF's CPU pool and accumulates one bag at a time into a
// [D] float (double for float64) buffer, so no [nnz, D] tensor is ever built.
//
// Backward w.r.t. params: the (id, position) pairs of the non-padding entries
// are radix-sorted by id (stable, ceil(log2 N) key bits), which groups equal
// ids into segments in position order. Each segment is reduced by exactly one
// thread in that fixed order, so the result is bitwise deterministic and needs
// no atomics. The reduced rows are written as deduplicated IndexedSlices
// ([U] sorted ids + [U, D]) or straight into a dense [N, D] gradient.

#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/shape_util.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace tf_ttemb {

// ---------------------------------------------------------------------------
// Attributes and validation (shared with the GPU glue).

Status ParseCombiner(const std::string& name, Combiner* combiner) {
  if (name == "sum") {
    *combiner = Combiner::kSum;
  } else if (name == "mean") {
    *combiner = Combiner::kMean;
  } else if (name == "sqrtn") {
    *combiner = Combiner::kSqrtn;
  } else if (name == "max") {
    *combiner = Combiner::kMax;
  } else {
    return errors::InvalidArgument("combiner must be one of 'sum', 'mean', ",
                                   "'sqrtn', 'max', got '", name, "'");
  }
  return OkStatus();
}

const char* CombinerName(Combiner combiner) {
  switch (combiner) {
    case Combiner::kSum:
      return "sum";
    case Combiner::kMean:
      return "mean";
    case Combiner::kSqrtn:
      return "sqrtn";
    case Combiner::kMax:
      return "max";
  }
  return "unknown";
}

Status GetBagAttrs(OpKernelConstruction* ctx, BagAttrs* attrs) {
  std::string combiner;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiner", &combiner));
  TF_RETURN_IF_ERROR(ParseCombiner(combiner, &attrs->combiner));
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_weights", &attrs->has_weights));
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_padding_id", &attrs->has_padding_id));
  TF_RETURN_IF_ERROR(ctx->GetAttr("padding_id", &attrs->padding_id));
  if (attrs->has_weights && attrs->combiner == Combiner::kMax) {
    return errors::InvalidArgument("combiner 'max' does not take weights");
  }
  return OkStatus();
}

Status ValidateParamsShape(const Tensor& params) {
  if (params.dims() != 2) {
    return errors::InvalidArgument("params must be a matrix [N, D], got shape ",
                                   params.shape().DebugString());
  }
  return OkStatus();
}

Status ValidateBagShapes(const Tensor& indices, const Tensor& row_splits,
                         const Tensor& weights, const BagAttrs& attrs,
                         BagShapes* shapes) {
  if (indices.dims() != 1) {
    return errors::InvalidArgument("indices must be a vector [nnz], got shape ",
                                   indices.shape().DebugString());
  }
  if (row_splits.dims() != 1 || row_splits.NumElements() < 1) {
    return errors::InvalidArgument(
        "row_splits must be a vector [B + 1] with at least 1 element, got "
        "shape ",
        row_splits.shape().DebugString());
  }
  if (weights.dims() != 1) {
    return errors::InvalidArgument("weights must be a vector, got shape ",
                                   weights.shape().DebugString());
  }
  shapes->nnz = indices.NumElements();
  shapes->num_bags = row_splits.NumElements() - 1;
  if (attrs.has_weights && weights.NumElements() != shapes->nnz) {
    return errors::InvalidArgument("weights has ", weights.NumElements(),
                                   " entries but indices has ", shapes->nnz);
  }
  return OkStatus();
}

Status RowSplitsStartError(int64_t first_split) {
  return errors::InvalidArgument("row_splits[0] = ", first_split, " must be 0");
}

Status RowSplitsOrderError(int64_t bag, int64_t next_split, int64_t split) {
  return errors::InvalidArgument(
      "row_splits must be non-decreasing: row_splits[", bag + 1,
      "] = ", next_split, " < row_splits[", bag, "] = ", split);
}

Status RowSplitsEndError(int64_t num_bags, int64_t last_split, int64_t nnz) {
  return errors::InvalidArgument("row_splits[", num_bags, "] = ", last_split,
                                 " must equal the number of indices (", nnz,
                                 ")");
}

Status ValidateRowSplits(const int64_t* row_splits, int64_t num_bags,
                         int64_t nnz) {
  if (row_splits[0] != 0) return RowSplitsStartError(row_splits[0]);
  for (int64_t b = 0; b < num_bags; ++b) {
    if (row_splits[b + 1] < row_splits[b]) {
      return RowSplitsOrderError(b, row_splits[b + 1], row_splits[b]);
    }
  }
  if (row_splits[num_bags] != nnz) {
    return RowSplitsEndError(num_bags, row_splits[num_bags], nnz);
  }
  return OkStatus();
}

Status ValidateForwardInputs(const Tensor& params, const Tensor& indices,
                             const Tensor& row_splits, const Tensor& weights,
                             const BagAttrs& attrs, BagShapes* shapes,
                             TensorShape* output_shape) {
  TF_RETURN_IF_ERROR(ValidateParamsShape(params));
  TF_RETURN_IF_ERROR(
      ValidateBagShapes(indices, row_splits, weights, attrs, shapes));
  return MatrixShape("output [num_bags, D]", shapes->num_bags,
                     params.dim_size(1), output_shape);
}

Status ValidateWeightsGradInputs(OpKernelContext* ctx, const Tensor& params,
                                 const BagAttrs& attrs, BagShapes* shapes) {
  TF_RETURN_IF_ERROR(ValidateParamsShape(params));
  TF_RETURN_IF_ERROR(ValidateBagShapes(ctx->input(2), ctx->input(3),
                                       ctx->input(4), attrs, shapes));
  const TensorShape bag_shape({shapes->num_bags, params.dim_size(1)});
  const Tensor& grad = ctx->input(0);
  const Tensor& output = ctx->input(5);
  if (grad.shape() != bag_shape) {
    return errors::InvalidArgument("grad must have shape ",
                                   bag_shape.DebugString(), ", got ",
                                   grad.shape().DebugString());
  }
  if (output.shape() != bag_shape) {
    return errors::InvalidArgument("output must have shape ",
                                   bag_shape.DebugString(), ", got ",
                                   output.shape().DebugString());
  }
  return OkStatus();
}

Status ValidateParamsGradInputs(OpKernelContext* ctx, const BagAttrs& attrs,
                                ParamsGradShapes* shapes) {
  const Tensor& grad = ctx->input(0);
  const Tensor& argmax = ctx->input(4);
  const Tensor& num_rows = ctx->input(5);
  if (grad.dims() != 2) {
    return errors::InvalidArgument("grad must be a matrix [B, D], got shape ",
                                   grad.shape().DebugString());
  }
  if (!TensorShapeUtils::IsScalar(num_rows.shape())) {
    return errors::InvalidArgument("num_rows must be a scalar, got shape ",
                                   num_rows.shape().DebugString());
  }
  shapes->num_rows = num_rows.scalar<int64_t>()();
  if (shapes->num_rows < 0) {
    return errors::InvalidArgument("num_rows = ", shapes->num_rows,
                                   " must be >= 0");
  }
  TF_RETURN_IF_ERROR(ValidateBagShapes(ctx->input(1), ctx->input(2),
                                       ctx->input(3), attrs, &shapes->bags));
  const int64_t num_bags = shapes->bags.num_bags;
  shapes->dim = grad.dim_size(1);
  TensorShape dense_shape;  // a table [num_rows, D] that a tensor can hold
  TF_RETURN_IF_ERROR(MatrixShape("params_grad [num_rows, D]", shapes->num_rows,
                                 shapes->dim, &dense_shape));
  if (grad.dim_size(0) != num_bags) {
    return errors::InvalidArgument("grad has ", grad.dim_size(0),
                                   " rows but row_splits describes ", num_bags,
                                   " bags");
  }
  const int64_t argmax_rows = attrs.combiner == Combiner::kMax ? num_bags : 0;
  if (argmax.dims() != 2 || argmax.dim_size(0) != argmax_rows ||
      (argmax_rows > 0 && argmax.dim_size(1) != shapes->dim)) {
    return errors::InvalidArgument("argmax must have shape [", argmax_rows,
                                   ", ", shapes->dim, "], got ",
                                   argmax.shape().DebugString());
  }
  return OkStatus();
}

Status BadIndexError(int64_t position, int64_t value, int64_t num_rows,
                     const BagAttrs& attrs) {
  if (attrs.has_padding_id) {
    return errors::InvalidArgument("indices[", position, "] = ", value,
                                   " is not in [0, ", num_rows,
                                   ") and is not padding_id (",
                                   attrs.padding_id, ")");
  }
  return errors::InvalidArgument("indices[", position, "] = ", value,
                                 " is not in [0, ", num_rows, ")");
}

const char* RowOptimizerName(RowOptimizer optimizer) {
  switch (optimizer) {
    case RowOptimizer::kRowwiseAdagrad:
      return "rowwise_adagrad";
    case RowOptimizer::kAdagrad:
      return "adagrad";
    case RowOptimizer::kSgd:
      break;
  }
  return "sgd";
}

Status GetSparseApplyAttrs(OpKernelConstruction* ctx, DataType params_type,
                           DataType acc_type, SparseApplyAttrs* attrs) {
  TF_RETURN_IF_ERROR(GetBagAttrs(ctx, &attrs->bag));
  std::string name;
  TF_RETURN_IF_ERROR(ctx->GetAttr("optimizer", &name));
  if (name == "sgd") {
    attrs->optimizer = RowOptimizer::kSgd;
  } else if (name == "rowwise_adagrad") {
    attrs->optimizer = RowOptimizer::kRowwiseAdagrad;
  } else if (name == "adagrad") {
    attrs->optimizer = RowOptimizer::kAdagrad;
  } else {
    return errors::InvalidArgument(
        "optimizer must be one of 'sgd', 'rowwise_adagrad', 'adagrad', got '",
        name, "'");
  }
  int num_accumulators = 0;
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_accumulators", &num_accumulators));
  const int expected = attrs->optimizer == RowOptimizer::kSgd ? 0 : 1;
  if (num_accumulators != expected) {
    return errors::InvalidArgument("optimizer '", name, "' takes ", expected,
                                   " accumulator variable(s), got ",
                                   num_accumulators);
  }
  DataType tacc;
  TF_RETURN_IF_ERROR(ctx->GetAttr("Tacc", &tacc));
  if (tacc != acc_type) {
    return errors::InvalidArgument(
        "learning_rate, epsilon and the accumulator must be ",
        DataTypeString(acc_type), " for params of type ",
        DataTypeString(params_type), ", got ", DataTypeString(tacc));
  }
  return OkStatus();
}

Status LookupTypedVariable(OpKernelContext* ctx, int input, DataType dtype,
                           const char* what, core::RefCountPtr<Var>* variable) {
  TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input), variable));
  if ((*variable)->tensor()->dtype() != dtype) {
    return errors::InvalidArgument(
        what, " variable has dtype ",
        DataTypeString((*variable)->tensor()->dtype()), " but the op expects ",
        DataTypeString(dtype));
  }
  if (!(*variable)->is_initialized) {
    return errors::FailedPrecondition(what, " variable is not initialized");
  }
  return OkStatus();
}

template <typename Acc>
Status ValidateSparseApplyInputs(OpKernelContext* ctx, const Tensor& params,
                                 const Tensor* accumulator,
                                 const SparseApplyAttrs& attrs,
                                 BagShapes* shapes, Acc* lr, Acc* eps) {
  TF_RETURN_IF_ERROR(ValidateWeightsGradInputs(ctx, params, attrs.bag, shapes));
  const Tensor& argmax = ctx->input(6);
  const Tensor& learning_rate = ctx->input(7);
  const Tensor& epsilon = ctx->input(8);
  const int64_t num_rows = params.dim_size(0);
  const int64_t dim = params.dim_size(1);
  const int64_t argmax_rows =
      attrs.bag.combiner == Combiner::kMax ? shapes->num_bags : 0;
  if (argmax.dims() != 2 || argmax.dim_size(0) != argmax_rows ||
      (argmax_rows != 0 && argmax.dim_size(1) != dim)) {
    return errors::InvalidArgument("argmax must have shape [", argmax_rows,
                                   ", ", dim, "], got ",
                                   argmax.shape().DebugString());
  }
  if (!TensorShapeUtils::IsScalar(learning_rate.shape())) {
    return errors::InvalidArgument("learning_rate must be a scalar, got shape ",
                                   learning_rate.shape().DebugString());
  }
  if (!TensorShapeUtils::IsScalar(epsilon.shape())) {
    return errors::InvalidArgument("epsilon must be a scalar, got shape ",
                                   epsilon.shape().DebugString());
  }
  *lr = learning_rate.scalar<Acc>()();
  *eps = epsilon.scalar<Acc>()();
  if (!std::isfinite(*lr)) {
    return errors::InvalidArgument("learning_rate = ", *lr, " must be finite");
  }
  if (!std::isfinite(*eps) || *eps < Acc(0)) {
    return errors::InvalidArgument("epsilon = ", *eps,
                                   " must be finite and >= 0");
  }
  if (accumulator != nullptr) {
    const TensorShape expected =
        attrs.optimizer == RowOptimizer::kRowwiseAdagrad
            ? TensorShape({num_rows})
            : TensorShape({num_rows, dim});
    if (accumulator->shape() != expected) {
      return errors::InvalidArgument(
          "accumulator must have shape ", expected.DebugString(),
          " for optimizer '", RowOptimizerName(attrs.optimizer),
          "' and params of shape ", params.shape().DebugString(), ", got ",
          accumulator->shape().DebugString());
    }
  }
  return OkStatus();
}

template Status ValidateSparseApplyInputs<float>(OpKernelContext*,
                                                 const Tensor&, const Tensor*,
                                                 const SparseApplyAttrs&,
                                                 BagShapes*, float*, float*);
template Status ValidateSparseApplyInputs<double>(OpKernelContext*,
                                                  const Tensor&, const Tensor*,
                                                  const SparseApplyAttrs&,
                                                  BagShapes*, double*, double*);

namespace {

using CPUDevice = Eigen::ThreadPoolDevice;

thread::ThreadPool* CpuPool(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->workers;
}

// Splits [0, n) into at most `max_blocks` contiguous blocks of about equal
// work, where prefix[i] is the cumulative work before item i (prefix has
// n + 1 entries, prefix[n] the total). Returns the n_blocks + 1 boundaries.
std::vector<int64_t> BalancedBlocks(const int64_t* prefix, int64_t n,
                                    int64_t max_blocks) {
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
void ForBalancedBlocks(thread::ThreadPool* pool, const int64_t* prefix,
                       int64_t n, int64_t cost_per_item, Fn fn) {
  const int64_t threads = pool->NumThreads();
  const int64_t total_cost =
      (prefix[n] - prefix[0] + n) * std::max<int64_t>(1, cost_per_item);
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
Status ValidateIndices(thread::ThreadPool* pool, const Tindex* ids, int64_t nnz,
                       int64_t num_rows, const BagAttrs& attrs) {
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
inline void Axpy(Acc* __restrict acc, Acc w, const float* __restrict row,
                 int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
}
template <typename Acc>
inline void Axpy(Acc* __restrict acc, Acc w, const double* __restrict row,
                 int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
}
template <typename Acc, typename T>
inline void Axpy(Acc* __restrict acc, Acc w, const T* __restrict row,
                 int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * static_cast<Acc>(row[d]);
}

template <typename Acc>
inline void AddRow(Acc* __restrict acc, const float* __restrict row,
                   int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += row[d];
}
template <typename Acc>
inline void AddRow(Acc* __restrict acc, const double* __restrict row,
                   int64_t dim) {
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
      return weight_sq_sum != Acc(0) ? Acc(1) / std::sqrt(weight_sq_sum)
                                     : Acc(0);
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
inline AccT<T> BagScaleOf(const Tindex* ids,
                                                    const T* weights,
                                                    int64_t begin, int64_t end,
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
inline AccT<T> ComputeBagScale(
    const Tindex* ids, const T* weights, int64_t begin, int64_t end,
    const BagAttrs& attrs) {
  return BagScaleOf<true>(ids, weights, begin, end, attrs);
}

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
// and a bag of scale 0 is never gathered.

#if defined(__AVX2__) && defined(__FMA__)
#define TF_TTEMB_CPU_AVX2 1
#endif

#ifdef TF_TTEMB_CPU_AVX2

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
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V Load(const bfloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static __m256i Mask(int n) {  // the first n lanes
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // The first n < kLanes values; the other lanes are 0 and never read.
  static V LoadPartial(const float* p, int n) {
    return _mm256_maskload_ps(p, Mask(n));
  }
  template <typename T>
  static V LoadPartial(const T* p, int n) {
    T tmp[kLanes] = {};
    std::memcpy(tmp, p, n * sizeof(T));
    return Load(tmp);
  }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void StorePartial(float* p, V v, int n) {
    _mm256_maskstore_ps(p, Mask(n), v);
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
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n),
                              _mm256_setr_epi64x(0, 1, 2, 3));
  }
  static V LoadPartial(const double* p, int n) {
    return _mm256_maskload_pd(p, Mask(n));
  }
  static void Store(double* p, V v) { _mm256_storeu_pd(p, v); }
  static void StorePartial(double* p, V v, int n) {
    _mm256_maskstore_pd(p, Mask(n), v);
  }
};

// Vectors of columns one pass over a bag's entries keeps in registers.
constexpr int kMaxVecs = 8;

// sums[0, kVecs * kLanes) (the last vector `tail` lanes when kTail) = the
// sequential sum over entries [begin, end) of w_j * params[ids_j][col, ...):
// fma(w, x, acc) weighted, acc + x unweighted, as the scalar loop compiles.
// Padding entries are skipped. With `prefetch_bytes` > 0 it prefetches that
// many bytes of the row of an entry 4 to 16 entries ahead (up to entry
// `prefetch_end`, which may lie in later bags) while it adds entry j.
template <int kVecs, bool kTail, bool kWeighted, typename T, typename Tindex,
          typename Acc>
inline void BagChunkSum(const T* params,    // [N, D]
                        const Tindex* ids,  // [nnz]
                        const T* weights,   // [nnz] when kWeighted
                        int64_t begin, int64_t end, int64_t prefetch_end,
                        int64_t prefetch_bytes, int64_t dim, int64_t col,
                        int tail, const BagAttrs& attrs,
                        Acc* sums) {  // [kVecs * kLanes]
  using VA = Vec<Acc>;
  constexpr int kLanes = VA::kLanes;
  typename VA::V acc[kVecs];
  for (int v = 0; v < kVecs; ++v) acc[v] = VA::Zero();
  const bool padding = attrs.has_padding_id;
  const int64_t padding_id = attrs.padding_id;
  // About 4 KiB of rows in flight: 16 entries ahead for rows of up to 256
  // bytes, at least 4 for long rows.
  const int64_t distance = std::max<int64_t>(
      4, std::min<int64_t>(16, 4096 / std::max<int64_t>(1, prefetch_bytes)));
  for (int64_t j = begin; j < end; ++j) {
    const int64_t id = static_cast<int64_t>(ids[j]);
    if (prefetch_bytes > 0 && j + distance < prefetch_end) {
      const int64_t ahead = static_cast<int64_t>(ids[j + distance]);
      if (!padding || ahead != padding_id) {
        const uintptr_t first =
            reinterpret_cast<uintptr_t>(params + ahead * dim) & ~uintptr_t{63};
        const uintptr_t last =
            reinterpret_cast<uintptr_t>(params + ahead * dim) + prefetch_bytes;
        for (uintptr_t p = first; p < last; p += 64) {
          __builtin_prefetch(reinterpret_cast<const void*>(p), 0, 3);
        }
      }
    }
    if (padding && id == padding_id) continue;
    const T* row = params + id * dim + col;
    if (kWeighted) {
      const typename VA::V w = VA::Set(static_cast<Acc>(weights[j]));
      for (int v = 0; v < kVecs; ++v) {
        const typename VA::V x = (kTail && v == kVecs - 1)
                                     ? VA::LoadPartial(row + v * kLanes, tail)
                                     : VA::Load(row + v * kLanes);
        acc[v] = VA::Fma(w, x, acc[v]);
      }
    } else {
      for (int v = 0; v < kVecs; ++v) {
        const typename VA::V x = (kTail && v == kVecs - 1)
                                     ? VA::LoadPartial(row + v * kLanes, tail)
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
inline void BagChunkSumTail(const T* params, const Tindex* ids,
                            const T* weights, int64_t begin, int64_t end,
                            int64_t prefetch_end, int64_t prefetch_bytes,
                            int64_t dim, int64_t col, int tail,
                            const BagAttrs& attrs, Acc* sums) {
  if (tail == 0) {
    BagChunkSum<kVecs, false, kWeighted>(params, ids, weights, begin, end,
                                         prefetch_end, prefetch_bytes, dim,
                                         col, tail, attrs, sums);
  } else {
    BagChunkSum<kVecs, true, kWeighted>(params, ids, weights, begin, end,
                                        prefetch_end, prefetch_bytes, dim, col,
                                        tail, attrs, sums);
  }
}

// sums[0, dim) = the sequential sum over entries [begin, end) of the
// (weighted) rows, chunk by chunk of columns; the first chunk's pass
// prefetches whole rows ahead, up to entry prefetch_end.
template <bool kWeighted, typename T, typename Tindex, typename Acc>
void BagSum(const T* params, const Tindex* ids, const T* weights,
            int64_t begin, int64_t end, int64_t prefetch_end, int64_t dim,
            const BagAttrs& attrs, Acc* sums) {
  constexpr int kLanes = Vec<Acc>::kLanes;
  const int64_t vecs = (dim + kLanes - 1) / kLanes;
  const int tail = static_cast<int>(dim % kLanes);
  int64_t prefetch_bytes = dim * static_cast<int64_t>(sizeof(T));
  int64_t col = 0;
  int64_t left = vecs;
  for (; left > kMaxVecs; left -= kMaxVecs, col += kMaxVecs * kLanes) {
    BagChunkSum<kMaxVecs, false, kWeighted>(params, ids, weights, begin, end,
                                            prefetch_end, prefetch_bytes, dim,
                                            col, 0, attrs, sums + col);
    prefetch_bytes = 0;
  }
#define TF_TTEMB_CHUNK_CASE(k)                                               \
  case k:                                                                    \
    BagChunkSumTail<k, kWeighted>(params, ids, weights, begin, end,          \
                                  prefetch_end, prefetch_bytes, dim, col,    \
                                  tail, attrs, sums + col);                  \
    break;
  switch (left) {
    TF_TTEMB_CHUNK_CASE(1)
    TF_TTEMB_CHUNK_CASE(2)
    TF_TTEMB_CHUNK_CASE(3)
    TF_TTEMB_CHUNK_CASE(4)
    TF_TTEMB_CHUNK_CASE(5)
    TF_TTEMB_CHUNK_CASE(6)
    TF_TTEMB_CHUNK_CASE(7)
    TF_TTEMB_CHUNK_CASE(8)
    default:
      break;
  }
#undef TF_TTEMB_CHUNK_CASE
}

#else  // !TF_TTEMB_CPU_AVX2

// Portable fallback: one column sum per element, in memory.
template <bool kWeighted, typename T, typename Tindex, typename Acc>
void BagSum(const T* params, const Tindex* ids, const T* weights,
            int64_t begin, int64_t end, int64_t prefetch_end, int64_t dim,
            const BagAttrs& attrs, Acc* sums) {
  std::fill(sums, sums + dim, Acc(0));
  for (int64_t j = begin; j < end; ++j) {
    if (IsPadding(ids[j], attrs)) continue;
    if (j + kPrefetchDistance < end &&
        !IsPadding(ids[j + kPrefetchDistance], attrs)) {
      PrefetchRow(
          params + static_cast<int64_t>(ids[j + kPrefetchDistance]) * dim,
          dim);
    }
    const T* row = params + static_cast<int64_t>(ids[j]) * dim;
    if (kWeighted) {
      Axpy(sums, static_cast<Acc>(weights[j]), row, dim);
    } else {
      AddRow(sums, row, dim);
    }
  }
}

#endif  // TF_TTEMB_CPU_AVX2

template <typename T, typename Tindex>
void ForwardMaxBags(const T* params,        // [N, D]
                    const Tindex* ids,      // [nnz]
                    const int64_t* splits,  // [B + 1]
                    int64_t dim, const BagAttrs& attrs, int64_t bag_begin,
                    int64_t bag_end,
                    T* out,           // [B, D]
                    int32* argmax) {  // [B, D]
  using Acc = AccT<T>;
  std::vector<Acc> acc(dim);
  for (int64_t b = bag_begin; b < bag_end; ++b) {
    const int64_t begin = splits[b], end = splits[b + 1];
    T* out_row = out + b * dim;
    // The first entry of the max wins; NaN is above every number (as in
    // tf.reduce_max), so the first NaN entry wins a column holding NaN.
    int32* pos = argmax + b * dim;
    std::fill(pos, pos + dim, -1);
    for (int64_t j = begin; j < end; ++j) {
      if (IsPadding(ids[j], attrs)) continue;
      const T* row = params + static_cast<int64_t>(ids[j]) * dim;
      const int32 p = static_cast<int32>(j - begin);
      for (int64_t d = 0; d < dim; ++d) {
        const Acc v = static_cast<Acc>(row[d]);
        const bool take = pos[d] < 0 || v > acc[d] ||
                          (std::isnan(v) && !std::isnan(acc[d]));
        acc[d] = take ? v : acc[d];
        pos[d] = take ? p : pos[d];
      }
    }
    for (int64_t d = 0; d < dim; ++d) {
      out_row[d] = static_cast<T>(pos[d] < 0 ? Acc(0) : acc[d]);
    }
  }
}

template <bool kWeighted, typename T, typename Tindex>
void ForwardSumBags(const T* params,        // [N, D]
                    const Tindex* ids,      // [nnz]
                    const int64_t* splits,  // [B + 1]
                    const T* weights,       // [nnz] when kWeighted
                    int64_t dim, const BagAttrs& attrs, int64_t bag_begin,
                    int64_t bag_end,
                    T* out) {  // [B, D]
  using Acc = AccT<T>;
  // A bag's (or a block's) column sums; Acc-typed outputs take them in place.
  std::vector<Acc> scratch(std::is_same<T, Acc>::value ? 0 : dim);
  std::optional<BlockedSum<Acc>> blocks;  // bags longer than kSumBlock
  const int64_t prefetch_end = splits[bag_end];
  for (int64_t b = bag_begin; b < bag_end; ++b) {
    const int64_t begin = splits[b], end = splits[b + 1];
    T* out_row = out + b * dim;
    const Acc scale = BagScaleOf<!std::is_same<T, Acc>::value>(
        ids, weights, begin, end, attrs);
    if (scale == Acc(0)) {  // +0, also where a row holds Inf or NaN
      std::fill(out_row, out_row + dim, T(0));
      continue;
    }
    const Acc* total;
    if (end - begin <= kSumBlock) {
      Acc* sums = std::is_same<T, Acc>::value ? reinterpret_cast<Acc*>(out_row)
                                              : scratch.data();
      BagSum<kWeighted>(params, ids, weights, begin, end, prefetch_end, dim,
                        attrs, sums);
      total = sums;
    } else {
      if (!blocks) blocks.emplace(dim);
      blocks->Reset();
      for (int64_t block = begin; block < end; block += kSumBlock) {
        const int64_t block_end = std::min(end, block + kSumBlock);
        BagSum<kWeighted>(params, ids, weights, block, block_end,
                          prefetch_end, dim, attrs, blocks->current());
        if (block_end < end) blocks->Carry();
      }
      total = blocks->Total();
    }
    for (int64_t d = 0; d < dim; ++d) {
      out_row[d] = static_cast<T>(total[d] * scale);
    }
  }
}

template <typename T, typename Tindex>
void ForwardBags(const T* params,        // [N, D]
                 const Tindex* ids,      // [nnz]
                 const int64_t* splits,  // [B + 1]
                 const T* weights,       // [nnz] or null
                 int64_t dim, const BagAttrs& attrs, int64_t bag_begin,
                 int64_t bag_end,
                 T* out,          // [B, D]
                 int32* argmax) {  // [B, D] for max, else null
  if (attrs.combiner == Combiner::kMax) {
    ForwardMaxBags(params, ids, splits, dim, attrs, bag_begin, bag_end, out,
                   argmax);
  } else if (attrs.has_weights) {
    ForwardSumBags<true>(params, ids, splits, weights, dim, attrs, bag_begin,
                         bag_end, out);
  } else {
    ForwardSumBags<false>(params, ids, splits, weights, dim, attrs, bag_begin,
                          bag_end, out);
  }
}

// ParamsFromResource: params arrive as a resource variable, read in place
// under a shared lock instead of as a (possibly copied) tensor.
template <typename T, typename Tindex, bool ParamsFromResource>
class GatherReduceSumOp : public OpKernel {
 public:
  explicit GatherReduceSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetBagAttrs(ctx, &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    WithParams<T, ParamsFromResource>(ctx, 0, [&](const Tensor& params) {
      ComputeWithParams(ctx, params);
    });
  }

 private:
  void ComputeWithParams(OpKernelContext* ctx, const Tensor& params) {
    const Tensor& indices = ctx->input(1);
    const Tensor& row_splits = ctx->input(2);
    const Tensor& weights = ctx->input(3);
    BagShapes shapes;
    TensorShape output_shape;
    OP_REQUIRES_OK(ctx, ValidateForwardInputs(params, indices, row_splits,
                                              weights, attrs_, &shapes,
                                              &output_shape));
    const int64_t num_rows = params.dim_size(0);
    const int64_t dim = params.dim_size(1);
    const int64_t* splits = row_splits.flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, ValidateRowSplits(splits, shapes.num_bags, shapes.nnz));
    const Tindex* ids = indices.flat<Tindex>().data();
    thread::ThreadPool* pool = CpuPool(ctx);
    OP_REQUIRES_OK(ctx,
                   ValidateIndices(pool, ids, shapes.nnz, num_rows, attrs_));
    const bool is_max = attrs_.combiner == Combiner::kMax;
    if (is_max) {
      for (int64_t b = 0; b < shapes.num_bags; ++b) {
        OP_REQUIRES(ctx,
                    splits[b + 1] - splits[b] <=
                        std::numeric_limits<int32>::max(),
                    errors::InvalidArgument(
                        "combiner 'max' supports bags of at most 2^31 - 1 "
                        "entries, bag ",
                        b, " has ", splits[b + 1] - splits[b]));
      }
    }

    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, output_shape, &output));
    Tensor* argmax = nullptr;
    OP_REQUIRES_OK(
        ctx, ctx->allocate_output(
                 1, TensorShape({is_max ? shapes.num_bags : 0, dim}), &argmax));
    if (shapes.num_bags == 0 || dim == 0) return;

    const T* params_data = params.flat<T>().data();
    const T* weights_data = attrs_.has_weights ? weights.flat<T>().data()
                                               : nullptr;
    T* out = output->flat<T>().data();
    int32* argmax_data = is_max ? argmax->flat<int32>().data() : nullptr;
    const BagAttrs attrs = attrs_;
    ForBalancedBlocks(pool, splits, shapes.num_bags, dim,
                      [&](int64_t begin, int64_t end) {
                        ForwardBags(params_data, ids, splits, weights_data, dim,
                                    attrs, begin, end, out, argmax_data);
                      });
  }

  BagAttrs attrs_;
};

// ---------------------------------------------------------------------------
// Backward w.r.t. params.

// Stable LSD radix sort of (key, value) pairs on the low `key_bits` bits of
// the keys. Sorted output ends in keys/values; tmp buffers are scratch.
void RadixSortPairs(std::vector<uint64_t>* keys, std::vector<int64_t>* values,
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

int BitsFor(int64_t num_rows) {
  int bits = 0;
  while (bits < 63 && (int64_t{1} << bits) < num_rows) ++bits;
  return bits;
}

// Sorted, segmented view of the non-padding entries of a batch.
struct SortedEntries {
  std::vector<uint64_t> keys;        // [M] ids, ascending
  std::vector<int64_t> positions;    // [M] entry positions, ascending per id
  std::vector<int64_t> seg_starts;   // [U + 1] segment boundaries into keys
  std::vector<int64_t> bag_of;       // [nnz] bag of each entry
  std::vector<int64_t> bags;         // [M] bag of each sorted entry
  int64_t num_unique() const {
    return static_cast<int64_t>(seg_starts.size()) - 1;
  }
};

template <typename Tindex>
void SortEntries(thread::ThreadPool* pool, const Tindex* ids,
                 const int64_t* splits, int64_t num_bags, int64_t nnz,
                 int64_t num_rows, const BagAttrs& attrs, SortedEntries* s) {
  s->bag_of.resize(nnz);
  int64_t* bag_of = s->bag_of.data();
  ForBalancedBlocks(pool, splits, num_bags, 1,
                    [&](int64_t begin, int64_t end) {
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
void ComputeBagScales(thread::ThreadPool* pool, const Tindex* ids,
                      const T* weights, const int64_t* splits, int64_t num_bags,
                      const BagAttrs& attrs,
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
                          const T* grad,         // [B, D]
                          const T* weights,      // [nnz] or null
                          const int32* argmax,   // [B, D] or null
                          const int64_t* splits,
                          const AccT<T>* scales,
                          int64_t dim,
                          AccT<T>* acc) {
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
    const Acc c =
        scales[b] * (weights != nullptr ? static_cast<Acc>(weights[j]) : Acc(1));
    Axpy(acc, c, dy, dim);
  }
}

// Per-call state of a params-gradient kernel (kernels may run concurrently,
// so nothing of a call lives in the OpKernel object).
template <typename T, typename Tindex>
struct ParamsGradCall {
  using Acc = AccT<T>;
  BagShapes shapes;
  int64_t num_rows = 0;
  int64_t dim = 0;
  const int64_t* splits = nullptr;
  const Tindex* ids = nullptr;
  const T* grad = nullptr;
  const T* weights = nullptr;
  const int32* argmax = nullptr;
  thread::ThreadPool* pool = nullptr;
  SortedEntries sorted;
  std::vector<Acc> scales;

  // Calls write(u, acc) for every unique id, in parallel over segments
  // balanced by entry count.
  template <typename Write>
  void ReduceAll(Write write) const {
    const int64_t num_unique = sorted.num_unique();
    ForBalancedBlocks(pool, sorted.seg_starts.data(), num_unique, dim,
                      [&](int64_t begin, int64_t end) {
                        std::vector<Acc> acc(dim);
                        for (int64_t u = begin; u < end; ++u) {
                          ReduceSegment(sorted, u, grad, weights, argmax,
                                        splits, scales.data(), dim, acc.data());
                          write(u, acc.data());
                        }
                      });
  }
};

// Validates the inputs of GatherReduceSumGrad / GatherReduceSumDenseGrad
// and sorts the entries by id.
template <typename T, typename Tindex>
Status PrepareParamsGrad(OpKernelContext* ctx, const BagAttrs& attrs,
                         ParamsGradCall<T, Tindex>* call) {
  const Tensor& grad = ctx->input(0);
  const Tensor& indices = ctx->input(1);
  const Tensor& row_splits = ctx->input(2);
  const Tensor& weights = ctx->input(3);
  const Tensor& argmax = ctx->input(4);
  ParamsGradShapes shapes;
  TF_RETURN_IF_ERROR(ValidateParamsGradInputs(ctx, attrs, &shapes));
  call->shapes = shapes.bags;
  call->num_rows = shapes.num_rows;
  call->dim = shapes.dim;
  const int64_t num_bags = call->shapes.num_bags;
  const int64_t nnz = call->shapes.nnz;
  const bool is_max = attrs.combiner == Combiner::kMax;
  call->splits = row_splits.flat<int64_t>().data();
  TF_RETURN_IF_ERROR(ValidateRowSplits(call->splits, num_bags, nnz));
  call->ids = indices.flat<Tindex>().data();
  call->pool = CpuPool(ctx);
  TF_RETURN_IF_ERROR(
      ValidateIndices(call->pool, call->ids, nnz, call->num_rows, attrs));
  call->grad = grad.flat<T>().data();
  call->weights = attrs.has_weights ? weights.flat<T>().data() : nullptr;
  call->argmax = is_max ? argmax.flat<int32>().data() : nullptr;
  SortEntries(call->pool, call->ids, call->splits, num_bags, nnz,
              call->num_rows, attrs, &call->sorted);
  if (!is_max) {
    ComputeBagScales(call->pool, call->ids, call->weights, call->splits,
                     num_bags, attrs, &call->scales);
  }
  return OkStatus();
}

template <typename T, typename Tindex>
class GatherReduceSumGradOp : public OpKernel {
 public:
  explicit GatherReduceSumGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetBagAttrs(ctx, &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    ParamsGradCall<T, Tindex> call;
    OP_REQUIRES_OK(ctx, PrepareParamsGrad(ctx, attrs_, &call));
    const int64_t num_unique = call.sorted.num_unique();
    const int64_t dim = call.dim;
    Tensor* unique_ids = nullptr;
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_unique}),
                                             &unique_ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({num_unique, dim}), &values));
    Tindex* ids_out = unique_ids->flat<Tindex>().data();
    T* values_out = values->flat<T>().data();
    const SortedEntries& s = call.sorted;
    for (int64_t u = 0; u < num_unique; ++u) {
      ids_out[u] = static_cast<Tindex>(s.keys[s.seg_starts[u]]);
    }
    if (dim == 0) return;
    call.ReduceAll([&](int64_t u, const auto* acc) {
      T* row = values_out + u * dim;
      for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<T>(acc[d]);
    });
  }

 private:
  BagAttrs attrs_;
};

template <typename T, typename Tindex>
class GatherReduceSumDenseGradOp : public OpKernel {
 public:
  explicit GatherReduceSumDenseGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetBagAttrs(ctx, &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    ParamsGradCall<T, Tindex> call;
    OP_REQUIRES_OK(ctx, PrepareParamsGrad(ctx, attrs_, &call));
    const int64_t dim = call.dim;
    const int64_t num_rows = call.num_rows;
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_rows, dim}),
                                             &output));
    if (dim == 0 || num_rows == 0) return;
    T* out = output->flat<T>().data();
    // Zero the whole table in parallel, then overwrite the touched rows.
    call.pool->ParallelFor(num_rows, dim, [&](int64_t begin, int64_t end) {
      std::fill(out + begin * dim, out + end * dim, T(0));
    });
    const SortedEntries& s = call.sorted;
    call.ReduceAll([&](int64_t u, const auto* acc) {
      T* row = out + static_cast<int64_t>(s.keys[s.seg_starts[u]]) * dim;
      for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<T>(acc[d]);
    });
  }

 private:
  BagAttrs attrs_;
};

// ---------------------------------------------------------------------------
// Backward w.r.t. weights.
//   sum:   dw_j = <dy_b, e_j>
//   mean:  dw_j = <dy_b, e_j - out_b> / S,            S = sum_k w_k
//   sqrtn: dw_j = <dy_b, e_j> / S - w_j <dy_b, out_b> / S^2,  S = sqrt(sum w^2)
// with 0 for padding entries and for bags whose S is 0.

template <typename T, typename Tindex, bool ParamsFromResource>
class GatherReduceSumWeightsGradOp : public OpKernel {
 public:
  explicit GatherReduceSumWeightsGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetBagAttrs(ctx, &attrs_));
    OP_REQUIRES(ctx, attrs_.has_weights,
                errors::InvalidArgument(
                    "GatherReduceSumWeightsGrad needs has_weights = true"));
  }

  void Compute(OpKernelContext* ctx) override {
    WithParams<T, ParamsFromResource>(ctx, 1, [&](const Tensor& params) {
      ComputeWithParams(ctx, params);
    });
  }

 private:
  void ComputeWithParams(OpKernelContext* ctx, const Tensor& params) {
    using Acc = AccT<T>;
    const Tensor& grad = ctx->input(0);
    const Tensor& indices = ctx->input(2);
    const Tensor& row_splits = ctx->input(3);
    const Tensor& weights = ctx->input(4);
    const Tensor& output = ctx->input(5);
    BagShapes shapes;
    OP_REQUIRES_OK(ctx, ValidateWeightsGradInputs(ctx, params, attrs_, &shapes));
    const int64_t num_rows = params.dim_size(0);
    const int64_t dim = params.dim_size(1);
    const int64_t* splits = row_splits.flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, ValidateRowSplits(splits, shapes.num_bags, shapes.nnz));
    const Tindex* ids = indices.flat<Tindex>().data();
    thread::ThreadPool* pool = CpuPool(ctx);
    OP_REQUIRES_OK(ctx,
                   ValidateIndices(pool, ids, shapes.nnz, num_rows, attrs_));

    Tensor* weights_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({shapes.nnz}),
                                             &weights_grad));
    const T* dy_data = grad.flat<T>().data();
    const T* params_data = params.flat<T>().data();
    const T* w = weights.flat<T>().data();
    const T* out_data = output.flat<T>().data();
    T* dw = weights_grad->flat<T>().data();
    const BagAttrs attrs = attrs_;
    ForBalancedBlocks(pool, splits, shapes.num_bags, dim, [&](int64_t begin,
                                                              int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t j0 = splits[b], j1 = splits[b + 1];
        const T* dy = dy_data + b * dim;
        const Acc scale = ComputeBagScale(ids, w, j0, j1, attrs);
        const Acc dy_dot_out =
            attrs.combiner == Combiner::kSum
                ? Acc(0)
                : Dot<Acc>(dy, out_data + b * dim, dim);
        for (int64_t j = j0; j < j1; ++j) {
          if (IsPadding(ids[j], attrs) || scale == Acc(0)) {
            dw[j] = T(0);
            continue;
          }
          if (j + kPrefetchDistance < j1 &&
              !IsPadding(ids[j + kPrefetchDistance], attrs)) {
            PrefetchRow(params_data +
                            static_cast<int64_t>(ids[j + kPrefetchDistance]) * dim,
                        dim);
          }
          const T* row = params_data + static_cast<int64_t>(ids[j]) * dim;
          const Acc dot = Dot<Acc>(dy, row, dim);
          Acc g;
          switch (attrs.combiner) {
            case Combiner::kMean:
              g = (dot - dy_dot_out) * scale;
              break;
            case Combiner::kSqrtn:
              g = dot * scale -
                  static_cast<Acc>(w[j]) * dy_dot_out * scale * scale;
              break;
            default:
              g = dot;
          }
          dw[j] = static_cast<T>(g);
        }
      }
    });
  }

  BagAttrs attrs_;
};

// ---------------------------------------------------------------------------
// Fused backward (weighted sum, mean, sqrtn): one pass over the entries sorted
// by id computes the params gradient of each unique row and, with that row
// loaded once, the weights gradient of each of its entries (formulas as in
// GatherReduceSumWeightsGradOp). Every entry belongs to exactly one segment,
// so each weights-gradient element is written by one thread: deterministic.

template <typename T, typename Tindex, bool ParamsFromResource>
class GatherReduceSumFusedGradOp : public OpKernel {
 public:
  explicit GatherReduceSumFusedGradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetBagAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dense_grad", &dense_grad_));
    OP_REQUIRES(ctx, attrs_.has_weights,
                errors::InvalidArgument(
                    "GatherReduceSumFusedGrad needs has_weights = true"));
  }

  void Compute(OpKernelContext* ctx) override {
    WithParams<T, ParamsFromResource>(ctx, 1, [&](const Tensor& params) {
      ComputeWithParams(ctx, params);
    });
  }

 private:
  void ComputeWithParams(OpKernelContext* ctx, const Tensor& params) {
    using Acc = AccT<T>;
    const Tensor& grad = ctx->input(0);
    const Tensor& indices = ctx->input(2);
    const Tensor& row_splits = ctx->input(3);
    const Tensor& weights = ctx->input(4);
    const Tensor& output = ctx->input(5);
    ParamsGradCall<T, Tindex> call;
    OP_REQUIRES_OK(ctx,
                   ValidateWeightsGradInputs(ctx, params, attrs_, &call.shapes));
    const int64_t num_bags = call.shapes.num_bags;
    const int64_t nnz = call.shapes.nnz;
    call.num_rows = params.dim_size(0);
    call.dim = params.dim_size(1);
    const int64_t dim = call.dim;
    call.splits = row_splits.flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, ValidateRowSplits(call.splits, num_bags, nnz));
    call.ids = indices.flat<Tindex>().data();
    call.pool = CpuPool(ctx);
    OP_REQUIRES_OK(ctx, ValidateIndices(call.pool, call.ids, nnz,
                                        call.num_rows, attrs_));
    call.grad = grad.flat<T>().data();
    call.weights = weights.flat<T>().data();
    SortEntries(call.pool, call.ids, call.splits, num_bags, nnz, call.num_rows,
                attrs_, &call.sorted);
    ComputeBagScales(call.pool, call.ids, call.weights, call.splits, num_bags,
                     attrs_, &call.scales);
    const SortedEntries& s = call.sorted;
    const int64_t num_unique = s.num_unique();

    // <dy_b, out_b> per bag, for mean and sqrtn.
    std::vector<Acc> dy_dot_out(num_bags, Acc(0));
    const T* out_data = output.flat<T>().data();
    if (attrs_.combiner != Combiner::kSum) {
      ForBalancedBlocks(call.pool, call.splits, num_bags, dim,
                        [&](int64_t begin, int64_t end) {
                          for (int64_t b = begin; b < end; ++b) {
                            dy_dot_out[b] = Dot<Acc>(call.grad + b * dim,
                                                     out_data + b * dim, dim);
                          }
                        });
    }

    Tensor* unique_ids = nullptr;
    Tensor* params_grad = nullptr;
    Tensor* weights_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({dense_grad_ ? 0 : num_unique}),
                            &unique_ids));
    const int64_t grad_rows = dense_grad_ ? call.num_rows : num_unique;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({grad_rows, dim}),
                                             &params_grad));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nnz}),
                                             &weights_grad));
    T* values = params_grad->flat<T>().data();
    T* dw = weights_grad->flat<T>().data();
    // Padding entries (in no segment) keep a zero weights gradient.
    std::fill(dw, dw + nnz, T(0));
    if (dense_grad_ && dim > 0) {
      call.pool->ParallelFor(grad_rows, dim, [&](int64_t begin, int64_t end) {
        std::fill(values + begin * dim, values + end * dim, T(0));
      });
    } else {
      Tindex* ids_out = unique_ids->flat<Tindex>().data();
      for (int64_t u = 0; u < num_unique; ++u) {
        ids_out[u] = static_cast<Tindex>(s.keys[s.seg_starts[u]]);
      }
    }
    const T* params_data = params.flat<T>().data();
    const T* w = call.weights;
    const Combiner combiner = attrs_.combiner;
    const int64_t num_sorted = static_cast<int64_t>(s.bags.size());
    ForBalancedBlocks(call.pool, s.seg_starts.data(), num_unique, dim,
                      [&](int64_t begin, int64_t end) {
      std::vector<Acc> acc(dim);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t id = static_cast<int64_t>(s.keys[s.seg_starts[u]]);
        const T* row = params_data + id * dim;
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t k = s.seg_starts[u]; k < s.seg_starts[u + 1]; ++k) {
          const int64_t j = s.positions[k];
          const int64_t b = s.bags[k];
          if (k + kPrefetchDistance < num_sorted) {
            PrefetchRow(call.grad + s.bags[k + kPrefetchDistance] * dim, dim);
          }
          const T* dy = call.grad + b * dim;
          const Acc scale = call.scales[b];
          const Acc wj = static_cast<Acc>(w[j]);
          Axpy(acc.data(), scale * wj, dy, dim);
          if (scale == Acc(0)) continue;  // dw stays 0, as in the forward
          const Acc dot = Dot<Acc>(dy, row, dim);
          Acc g;
          switch (combiner) {
            case Combiner::kMean:
              g = (dot - dy_dot_out[b]) * scale;
              break;
            case Combiner::kSqrtn:
              g = dot * scale - wj * dy_dot_out[b] * scale * scale;
              break;
            default:
              g = dot;
          }
          dw[j] = static_cast<T>(g);
        }
        T* out_row = values + (dense_grad_ ? id : u) * dim;
        for (int64_t d = 0; d < dim; ++d) out_row[d] = static_cast<T>(acc[d]);
      }
    });
  }

  BagAttrs attrs_;
  bool dense_grad_ = false;
};

// ---------------------------------------------------------------------------
// Backward with the optimizer fused in (GatherReduceSumSparseApply).
//
// The entries are sorted by id as for the params gradient; the distinct rows
// are split into blocks of about equal entry count, one block per work item
// on TF's CPU pool. A thread owns every row of its block: it reduces the
// row's gradient in its [D] scratch (entries in position order), computes the
// weights gradient of the row's entries from the row as it was, then updates
// the row (and its accumulator) in place. No row is touched by two threads
// and every sum has a fixed order, so the result is deterministic and no
// [U, D] buffer exists.

// Makes the variable's buffer exclusively owned before an in-place update: a
// tensor read from it earlier (a dense read outside copy-on-read mode) may
// still share it, and must keep the old values.
Status EnsureExclusiveBuffer(OpKernelContext* ctx, Var* var) {
  Tensor* tensor = var->tensor();
  if (tensor->RefCountIsOne()) return OkStatus();
  Tensor copy;
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy));
  std::memcpy(copy.data(), tensor->data(), tensor->TotalBytes());
  *tensor = copy;
  return OkStatus();
}

template <typename T, typename Tindex>
class GatherReduceSumSparseApplyOp : public OpKernel {
 public:
  using Acc = AccT<T>;

  explicit GatherReduceSumSparseApplyOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetSparseApplyAttrs(ctx, DataTypeToEnum<T>::value,
                                            DataTypeToEnum<Acc>::value,
                                            &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    WithLockedSparseApplyVariables<T, Acc>(
        ctx, attrs_, [&](Var* params_var, Var* acc_var) {
          ComputeLocked(ctx, params_var, acc_var);
        });
  }

 private:
  void ComputeLocked(OpKernelContext* ctx, Var* params_var, Var* acc_var) {
    const Tensor& params = *params_var->tensor();
    const Tensor& indices = ctx->input(2);
    const Tensor& row_splits = ctx->input(3);
    const Tensor& weights = ctx->input(4);
    const Tensor& output = ctx->input(5);
    const Tensor& argmax = ctx->input(6);
    BagShapes shapes;
    Acc lr, eps;
    OP_REQUIRES_OK(ctx, ValidateSparseApplyInputs<Acc>(
                            ctx, params,
                            acc_var != nullptr ? acc_var->tensor() : nullptr,
                            attrs_, &shapes, &lr, &eps));
    const BagAttrs& bag = attrs_.bag;
    const int64_t num_bags = shapes.num_bags;
    const int64_t nnz = shapes.nnz;
    const int64_t num_rows = params.dim_size(0);
    const int64_t dim = params.dim_size(1);
    const bool is_max = bag.combiner == Combiner::kMax;
    const int64_t* splits = row_splits.flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, ValidateRowSplits(splits, num_bags, nnz));
    const Tindex* ids = indices.flat<Tindex>().data();
    thread::ThreadPool* pool = CpuPool(ctx);
    OP_REQUIRES_OK(ctx, ValidateIndices(pool, ids, nnz, num_rows, bag));

    Tensor* weights_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({bag.has_weights ? nnz : 0}),
                            &weights_grad));
    T* dw = weights_grad->flat<T>().data();
    if (bag.has_weights) std::fill(dw, dw + nnz, T(0));
    if (nnz == 0 || dim == 0) return;

    OP_REQUIRES_OK(ctx, EnsureExclusiveBuffer(ctx, params_var));
    if (acc_var != nullptr) {
      OP_REQUIRES_OK(ctx, EnsureExclusiveBuffer(ctx, acc_var));
    }
    T* table = params_var->tensor()->flat<T>().data();
    Acc* state =
        acc_var != nullptr ? acc_var->tensor()->flat<Acc>().data() : nullptr;

    SortedEntries s;
    SortEntries(pool, ids, splits, num_bags, nnz, num_rows, bag, &s);
    const T* w = bag.has_weights ? weights.flat<T>().data() : nullptr;
    std::vector<Acc> scales;
    if (!is_max) {
      ComputeBagScales(pool, ids, w, splits, num_bags, bag, &scales);
    }
    const T* dy_data = ctx->input(0).flat<T>().data();
    // <dy_b, out_b> per bag, for the weights gradient of mean and sqrtn.
    std::vector<Acc> dy_dot_out;
    if (bag.has_weights && bag.combiner != Combiner::kSum) {
      dy_dot_out.assign(num_bags, Acc(0));
      const T* out_data = output.flat<T>().data();
      ForBalancedBlocks(pool, splits, num_bags, dim,
                        [&](int64_t begin, int64_t end) {
                          for (int64_t b = begin; b < end; ++b) {
                            dy_dot_out[b] = Dot<Acc>(dy_data + b * dim,
                                                     out_data + b * dim, dim);
                          }
                        });
    }
    const int32* argmax_data = is_max ? argmax.flat<int32>().data() : nullptr;
    const int64_t num_unique = s.num_unique();
    const int64_t num_sorted = static_cast<int64_t>(s.bags.size());
    const BagAttrs attrs = bag;
    const RowOptimizer optimizer = attrs_.optimizer;
    ForBalancedBlocks(pool, s.seg_starts.data(), num_unique, dim,
                      [&](int64_t begin, int64_t end) {
      std::vector<Acc> g(dim);  // the row's gradient: this thread's scratch
      for (int64_t u = begin; u < end; ++u) {
        const int64_t id = static_cast<int64_t>(s.keys[s.seg_starts[u]]);
        T* row = table + id * dim;
        std::fill(g.begin(), g.end(), Acc(0));
        for (int64_t k = s.seg_starts[u]; k < s.seg_starts[u + 1]; ++k) {
          const int64_t j = s.positions[k];
          const int64_t b = s.bags[k];
          if (k + kPrefetchDistance < num_sorted) {
            PrefetchRow(dy_data + s.bags[k + kPrefetchDistance] * dim, dim);
          }
          const T* dy = dy_data + b * dim;
          if (argmax_data != nullptr) {
            const int32* pos = argmax_data + b * dim;
            const int32 p = static_cast<int32>(j - splits[b]);
            for (int64_t d = 0; d < dim; ++d) {
              g[d] += pos[d] == p ? static_cast<Acc>(dy[d]) : Acc(0);
            }
            continue;
          }
          const Acc scale = scales[b];
          const Acc wj = w != nullptr ? static_cast<Acc>(w[j]) : Acc(1);
          Axpy(g.data(), scale * wj, dy, dim);
          if (w == nullptr) continue;
          if (scale == Acc(0)) continue;  // dw stays 0, as in the forward
          const Acc dot = Dot<Acc>(dy, row, dim);
          Acc grad_w;
          switch (attrs.combiner) {
            case Combiner::kMean:
              grad_w = (dot - dy_dot_out[b]) * scale;
              break;
            case Combiner::kSqrtn:
              grad_w = dot * scale - wj * dy_dot_out[b] * scale * scale;
              break;
            default:
              grad_w = dot;
          }
          dw[j] = static_cast<T>(grad_w);
        }
        ApplyRow(optimizer, lr, eps, g.data(), dim, row,
                 state == nullptr ? nullptr
                 : optimizer == RowOptimizer::kRowwiseAdagrad
                     ? state + id
                     : state + id * dim);
      }
    });
  }

  // Applies the optimizer to one row `row` [D] with its summed gradient
  // `g` [D] and its accumulator (`a` [1] row-wise, [D] element-wise).
  static void ApplyRow(RowOptimizer optimizer, Acc lr, Acc eps,
                       const Acc* g, int64_t dim, T* row, Acc* a) {
    switch (optimizer) {
      case RowOptimizer::kSgd:
        for (int64_t d = 0; d < dim; ++d) {
          row[d] = static_cast<T>(static_cast<Acc>(row[d]) - lr * g[d]);
        }
        return;
      case RowOptimizer::kRowwiseAdagrad: {
        Acc square_sum = 0;
        for (int64_t d = 0; d < dim; ++d) square_sum += g[d] * g[d];
        a[0] += square_sum / static_cast<Acc>(dim);
        const Acc denominator = std::sqrt(a[0]) + eps;
        if (denominator == Acc(0)) return;  // then g is 0
        const Acc step = lr / denominator;
        for (int64_t d = 0; d < dim; ++d) {
          row[d] = static_cast<T>(static_cast<Acc>(row[d]) - step * g[d]);
        }
        return;
      }
      case RowOptimizer::kAdagrad:
        for (int64_t d = 0; d < dim; ++d) {
          a[d] += g[d] * g[d];
          const Acc denominator = std::sqrt(a[d]) + eps;
          if (denominator == Acc(0)) continue;  // then g[d] is 0
          row[d] = static_cast<T>(static_cast<Acc>(row[d]) -
                                  lr * g[d] / denominator);
        }
        return;
    }
  }

  SparseApplyAttrs attrs_;
};

#define TF_TTEMB_REGISTER_CPU(T, Tindex)                             \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>GatherReduceSum")            \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Tindex>("Tindices"),   \
                          GatherReduceSumOp<T, Tindex, false>);      \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>ResourceGatherReduceSum")    \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Tindex>("Tindices"),   \
                          GatherReduceSumOp<T, Tindex, true>);       \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>GatherReduceSumGrad")        \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Tindex>("Tindices"),   \
                          GatherReduceSumGradOp<T, Tindex>);         \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>GatherReduceSumDenseGrad")   \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Tindex>("Tindices"),   \
                          GatherReduceSumDenseGradOp<T, Tindex>);    \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>GatherReduceSumWeightsGrad") \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Tindex>("Tindices"),   \
                          GatherReduceSumWeightsGradOp<T, Tindex, false>); \
  REGISTER_KERNEL_BUILDER(                                           \
      Name("TfTtemb>ResourceGatherReduceSumWeightsGrad")             \
          .Device(DEVICE_CPU)                                        \
          .TypeConstraint<T>("T")                                    \
          .TypeConstraint<Tindex>("Tindices"),                       \
      GatherReduceSumWeightsGradOp<T, Tindex, true>);                \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>GatherReduceSumFusedGrad")   \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Tindex>("Tindices"),   \
                          GatherReduceSumFusedGradOp<T, Tindex, false>); \
  REGISTER_KERNEL_BUILDER(                                           \
      Name("TfTtemb>ResourceGatherReduceSumFusedGrad")               \
          .Device(DEVICE_CPU)                                        \
          .TypeConstraint<T>("T")                                    \
          .TypeConstraint<Tindex>("Tindices"),                       \
      GatherReduceSumFusedGradOp<T, Tindex, true>);               \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>GatherReduceSumSparseApply") \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Tindex>("Tindices"),   \
                          GatherReduceSumSparseApplyOp<T, Tindex>);

#define TF_TTEMB_REGISTER_CPU_ALL_INDICES(T) \
  TF_TTEMB_REGISTER_CPU(T, int32)            \
  TF_TTEMB_REGISTER_CPU(T, int64_t)

TF_TTEMB_REGISTER_CPU_ALL_INDICES(Eigen::half)
TF_TTEMB_REGISTER_CPU_ALL_INDICES(bfloat16)
TF_TTEMB_REGISTER_CPU_ALL_INDICES(float)
TF_TTEMB_REGISTER_CPU_ALL_INDICES(double)

#undef TF_TTEMB_REGISTER_CPU_ALL_INDICES
#undef TF_TTEMB_REGISTER_CPU

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow
