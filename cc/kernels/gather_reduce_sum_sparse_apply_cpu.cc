// CPU kernel of GatherReduceSumSparseApply (SparseApplyLaunch<CpuDevice> of
// gather_reduce_sum_sparse_apply_op.h's OpKernel, registered here): the params
// gradient of a batch of bags reduced per distinct row and an optimizer step
// applied to those rows in place, without a [U, D] gradient buffer.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/gather_reduce_sum_cpu.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/gather_reduce_sum_sparse_apply_op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace tf_ttemb {
namespace {

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

// Applies the optimizer to one row `row` [D] with its summed gradient `g` [D]
// and its accumulator (`a` [1] row-wise, [D] element-wise).
template <typename T, typename Acc>
void ApplyRow(RowOptimizer optimizer, Acc lr, Acc eps, const Acc* g, int64_t dim, T* row, Acc* a) {
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
        row[d] = static_cast<T>(static_cast<Acc>(row[d]) - lr * g[d] / denominator);
      }
      return;
  }
}

}  // namespace

template <typename T, typename Tindex>
struct SparseApplyLaunch<CpuDevice, T, Tindex> {
  static Status Run(OpKernelContext* ctx, const SparseApplyAttrs& sparse_attrs,
                    const SparseApplyArgs& a, const CpuStep& step) {
    using Acc = AccT<T>;
    const BagAttrs& attrs = sparse_attrs.bag;
    const int64_t num_bags = a.shapes.num_bags;
    const int64_t nnz = a.shapes.nnz;
    const int64_t num_rows = a.num_rows;
    const int64_t dim = a.dim;
    const bool is_max = attrs.combiner == Combiner::kMax;
    const int64_t* splits = a.row_splits->flat<int64_t>().data();
    const Tindex* ids = a.indices->flat<Tindex>().data();
    thread::ThreadPool* pool = step.pool;
    TF_RETURN_IF_ERROR(ValidateBags(pool, splits, ids, num_bags, nnz, num_rows, attrs));

    T* dw = a.weights_grad->flat<T>().data();
    if (attrs.has_weights) std::fill(dw, dw + nnz, T(0));
    if (nnz == 0 || dim == 0) return OkStatus();

    TF_RETURN_IF_ERROR(EnsureExclusiveHostBuffer(ctx, a.params_var));
    if (a.acc_var != nullptr) {
      TF_RETURN_IF_ERROR(EnsureExclusiveHostBuffer(ctx, a.acc_var));
    }
    CollapseToHugePages(*a.params_var->tensor());
    if (a.acc_var != nullptr) CollapseToHugePages(*a.acc_var->tensor());
    T* table = a.params_var->tensor()->flat<T>().data();
    Acc* state = a.acc_var != nullptr ? a.acc_var->tensor()->flat<Acc>().data() : nullptr;

    SortedEntries s;
    SortEntries(pool, ids, splits, num_bags, nnz, num_rows, attrs, &s);
    const T* w = attrs.has_weights ? a.weights->flat<T>().data() : nullptr;
    const T* dy_data = a.grad->flat<T>().data();
    // The terms of the backward: as the fused gradient's (weighted lookups)
    // and the params gradient's (the others).
    std::vector<Acc> scales, coef, w_sorted, dy_dot_out;
    if (!is_max) {
      ComputeBagScales(pool, ids, w, splits, num_bags, attrs, &scales);
      SortedCoefficients(pool, s, w, scales.data(), &coef, w != nullptr ? &w_sorted : nullptr);
    }
    if (w != nullptr) {
      BagDyDotOut(pool, attrs.combiner, splits, num_bags, dim, dy_data, a.output->flat<T>().data(),
                  &dy_dot_out);
    }
    const int32* argmax_data = is_max ? a.argmax->flat<int32>().data() : nullptr;
    const int64_t num_unique = s.num_unique();
    const RowOptimizer optimizer = sparse_attrs.optimizer;
    const Acc lr = static_cast<Acc>(a.lr);
    const Acc eps = static_cast<Acc>(a.eps);
    const int64_t rows_ahead = RowsInFlight(dim * static_cast<int64_t>(sizeof(T)));
    ForBalancedBlocks(pool, s.seg_starts.data(), num_unique, dim, [&](int64_t begin, int64_t end) {
      std::vector<Acc> g(dim);  // the row's gradient: this thread's scratch
      for (int64_t u = begin; u < end; ++u) {
        if (u + rows_ahead < end) {
          PrefetchRow(table + static_cast<int64_t>(s.keys[s.seg_starts[u + rows_ahead]]) * dim,
                      dim);
        }
        const int64_t id = static_cast<int64_t>(s.keys[s.seg_starts[u]]);
        T* row = table + id * dim;
        if (w != nullptr) {  // the weights gradient reads the row before its update
          ReduceWeightedSegment(s, u, dy_data, row, coef.data(), w_sorted.data(), scales.data(),
                                dy_dot_out.data(), attrs.combiner, dim, g.data(), dw);
        } else {
          ReduceSegment(s, u, dy_data, is_max ? nullptr : coef.data(), argmax_data, splits, dim,
                        g.data());
        }
        ApplyRow(optimizer, lr, eps, g.data(), dim, row,
                 state == nullptr                             ? nullptr
                 : optimizer == RowOptimizer::kRowwiseAdagrad ? state + id
                                                              : state + id * dim);
      }
    });
    return OkStatus();
  }
};

namespace {

TF_TTEMB_REGISTER_CPU_BAG_OP("TfTtemb>GatherReduceSumSparseApply", GatherReduceSumSparseApplyOp)

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow
