// CPU kernels of the gather_reduce_sum gradients (the Launch<CpuDevice>
// functors of gather_reduce_sum_backward_op.h's OpKernels, registered here):
// w.r.t. params (deduplicated and dense), w.r.t. weights, and both fused in
// one pass.
//
// Backward w.r.t. params: the (id, position) pairs of the non-padding entries
// are radix-sorted by id (stable, ceil(log2 N) key bits; SortEntries in
// gather_reduce_sum_cpu.h), which groups equal ids into segments in position
// order. Each segment is reduced by exactly one thread in that fixed order, so
// the result is bitwise deterministic and needs no atomics. The reduced rows
// are written as deduplicated IndexedSlices ([U] sorted ids + [U, D]) or
// straight into a dense [N, D] gradient.

#include "cc/kernels/gather_reduce_sum_backward_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/gather_reduce_sum_backward_op.h"
#include "cc/kernels/gather_reduce_sum_cpu.h"
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
// Backward w.r.t. params (ParamsGradCall and PrepareParamsGrad:
// gather_reduce_sum_backward_cpu.h).

// The ids of the deduplicated form's rows: the first key of each segment.
template <typename Tindex>
void WriteUniqueIds(const SortedEntries& s, Tensor* unique_ids) {
  Tindex* ids_out = unique_ids->flat<Tindex>().data();
  for (int64_t u = 0; u < s.num_unique(); ++u) {
    ids_out[u] = static_cast<Tindex>(s.keys[s.seg_starts[u]]);
  }
}

}  // namespace

template <typename T, typename Tindex>
struct ParamsGradLaunch<CpuDevice, T, Tindex> {
  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const ParamsGradArgs& a,
                    const CpuStep& step) {
    ParamsGradCall<T, Tindex> call;
    BackwardInputs in{a.shapes.bags, a.shapes.num_rows, a.shapes.dim,
                      a.row_splits,  a.indices,         a.grad};
    if (attrs.has_weights) in.weights = a.weights;
    if (attrs.combiner == Combiner::kMax) in.argmax = a.argmax;
    TF_RETURN_IF_ERROR(PrepareParamsGrad(attrs, in, step.pool, &call));
    const SortedEntries& s = call.sorted;
    const int64_t dim = call.dim;
    if (a.params_grad != nullptr) {  // dense
      const int64_t num_rows = call.num_rows;
      if (dim == 0 || num_rows == 0) return OkStatus();
      T* out = a.params_grad->flat<T>().data();
      AdviseHugePages(out, num_rows * dim * static_cast<int64_t>(sizeof(T)));
      // Zero the untouched rows in parallel; the reduction writes the others.
      ZeroUntouchedRows(call.pool, s, num_rows, dim, out);
      call.ReduceAll([&](int64_t u, const auto* acc) {
        T* row = out + static_cast<int64_t>(s.keys[s.seg_starts[u]]) * dim;
        StoreRow(row, acc, dim);
      });
      return OkStatus();
    }
    Tensor* unique_ids = nullptr;
    Tensor* values = nullptr;
    TF_RETURN_IF_ERROR(AllocateDeduplicatedGrad(ctx, s.num_unique(), dim, &unique_ids, &values));
    WriteUniqueIds<Tindex>(s, unique_ids);
    if (dim == 0) return OkStatus();
    T* values_out = values->flat<T>().data();
    // Fresh [U, D] memory, first touched below: on 2 MiB pages a 40 MiB gradient
    // faults 20 times instead of 10,000 (huge_pages.h).
    AdviseHugePages(values_out, s.num_unique() * dim * static_cast<int64_t>(sizeof(T)));
    call.ReduceAll([&](int64_t u, const auto* acc) {
      T* row = values_out + u * dim;
      StoreRow(row, acc, dim);
    });
    return OkStatus();
  }
};

// ---------------------------------------------------------------------------
// Backward w.r.t. weights.
//   sum:   dw_j = <dy_b, e_j>
//   mean:  dw_j = <dy_b, e_j - out_b> / S,            S = sum_k w_k
//   sqrtn: dw_j = <dy_b, e_j> / S - w_j <dy_b, out_b> / S^2,  S = sqrt(sum w^2)
// with 0 for padding entries and for bags whose S is 0.

template <typename T, typename Tindex>
struct WeightsGradLaunch<CpuDevice, T, Tindex> {
  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const WeightsGradArgs& a,
                    const CpuStep& step) {
    using Acc = AccT<T>;
    const BagShapes& shapes = a.shapes;
    const int64_t dim = a.dim;
    const int64_t* splits = a.row_splits->flat<int64_t>().data();
    const Tindex* ids = a.indices->flat<Tindex>().data();
    thread::ThreadPool* pool = step.pool;
    CollapseToHugePages(*a.params);
    const T* dy_data = a.grad->flat<T>().data();
    const T* params_data = a.params->flat<T>().data();
    const T* w = a.weights->flat<T>().data();
    const T* out_data = a.output->flat<T>().data();
    T* dw = a.weights_grad->flat<T>().data();
    // Each block of bags checks its ids, then computes their weights' gradients.
    return ForValidatedBlocks(
        pool, splits, ids, shapes.num_bags, shapes.nnz, a.num_rows, attrs, dim,
        [&](int64_t begin, int64_t end) {
          for (int64_t b = begin; b < end; ++b) {
            const int64_t j0 = splits[b], j1 = splits[b + 1];
            const T* dy = dy_data + b * dim;
            const Acc scale = ComputeBagScale(ids, w, j0, j1, attrs);
            const Acc dy_dot_out =
                attrs.combiner == Combiner::kSum ? Acc(0) : Dot<Acc>(dy, out_data + b * dim, dim);
            for (int64_t j = j0; j < j1; ++j) {
              if (IsPadding(ids[j], attrs) || scale == Acc(0)) {
                dw[j] = T(0);
                continue;
              }
              if (j + kPrefetchDistance < j1 && !IsPadding(ids[j + kPrefetchDistance], attrs)) {
                PrefetchRow(params_data + static_cast<int64_t>(ids[j + kPrefetchDistance]) * dim,
                            dim);
              }
              const T* row = params_data + static_cast<int64_t>(ids[j]) * dim;
              const Acc dot = Dot<Acc>(dy, row, dim);
              dw[j] = static_cast<T>(WeightGradFromDot(attrs.combiner, dot, dy_dot_out, scale,
                                                       static_cast<Acc>(w[j])));
            }
          }
        });
  }
};

// ---------------------------------------------------------------------------
// Fused backward (weighted sum, mean, sqrtn): one pass over the entries sorted
// by id computes the params gradient of each unique row and, with that row
// loaded once, the weights gradient of each of its entries (formulas as in
// WeightsGradLaunch). Every entry belongs to exactly one segment, so each
// weights-gradient element is written by one thread: deterministic.

template <typename T, typename Tindex>
struct FusedGradLaunch<CpuDevice, T, Tindex> {
  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const FusedGradArgs& a,
                    const CpuStep& step) {
    using Acc = AccT<T>;
    ParamsGradCall<T, Tindex> call;
    std::vector<Acc>& w_sorted = *ThreadScratch::Get().weights(static_cast<Acc*>(nullptr));
    TF_RETURN_IF_ERROR(PrepareParamsGrad(
        attrs,
        BackwardInputs{a.shapes, a.num_rows, a.dim, a.row_splits, a.indices, a.grad, a.weights},
        step.pool, &call, &w_sorted));
    const int64_t num_bags = call.shapes.num_bags;
    const int64_t nnz = call.shapes.nnz;
    const int64_t dim = call.dim;
    const SortedEntries& s = call.sorted;
    const int64_t num_unique = s.num_unique();

    std::vector<Acc> dy_dot_out;
    const T* dy_data = call.grad;
    BagDyDotOut(call.pool, attrs.combiner, call.splits, num_bags, dim, dy_data,
                a.output->flat<T>().data(), &dy_dot_out);

    Tensor* params_grad = a.params_grad;
    if (!a.dense) {
      Tensor* unique_ids = nullptr;
      TF_RETURN_IF_ERROR(AllocateDeduplicatedGrad(ctx, num_unique, dim, &unique_ids, &params_grad));
      WriteUniqueIds<Tindex>(s, unique_ids);
    }
    const int64_t grad_rows = a.dense ? call.num_rows : num_unique;
    T* values = params_grad->flat<T>().data();
    T* dw = a.weights_grad->flat<T>().data();
    // Padding entries (in no segment) keep a zero weights gradient.
    std::fill(dw, dw + nnz, T(0));
    // Fresh memory, dense [N, D] or deduplicated [U, D], first touched below.
    AdviseHugePages(values, grad_rows * dim * static_cast<int64_t>(sizeof(T)));
    if (a.dense && dim > 0) ZeroUntouchedRows(call.pool, s, grad_rows, dim, values);
    CollapseToHugePages(*a.params);
    const T* params_data = a.params->flat<T>().data();
    const int64_t* seg_starts = s.seg_starts.data();
    const uint64_t* keys = s.keys.data();
    const bool dense = a.dense;
    // Each segment's table row is prefetched `rows_ahead` segments ahead (the
    // rows are read in id order, scattered over the table).
    const int64_t rows_ahead = RowsInFlight(dim * static_cast<int64_t>(sizeof(T)));
    ForBalancedBlocks(call.pool, seg_starts, num_unique, dim, [&](int64_t begin, int64_t end) {
      std::vector<Acc> acc(dim);
      for (int64_t u = begin; u < end; ++u) {
        if (u + rows_ahead < end) {
          PrefetchRow(params_data + static_cast<int64_t>(keys[seg_starts[u + rows_ahead]]) * dim,
                      dim);
        }
        const int64_t id = static_cast<int64_t>(keys[seg_starts[u]]);
        ReduceWeightedSegment(s, u, dy_data, params_data + id * dim, call.coef.data(),
                              w_sorted.data(), call.scales.data(), dy_dot_out.data(),
                              attrs.combiner, dim, acc.data(), dw);
        StoreRow(values + (dense ? id : u) * dim, acc.data(), dim);
      }
    });
    return OkStatus();
  }
};

namespace {

TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GatherReduceSumGrad", GatherReduceSumGradOp, false)
TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GatherReduceSumDenseGrad", GatherReduceSumGradOp, true)
TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GatherReduceSumWeightsGrad", GatherReduceSumWeightsGradOp,
                             false)
TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>ResourceGatherReduceSumWeightsGrad",
                             GatherReduceSumWeightsGradOp, true)
TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GatherReduceSumFusedGrad", GatherReduceSumFusedGradOp, false)
TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>ResourceGatherReduceSumFusedGrad", GatherReduceSumFusedGradOp,
                             true)

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow
