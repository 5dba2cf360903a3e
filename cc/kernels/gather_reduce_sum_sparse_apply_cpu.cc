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
    TF_RETURN_IF_ERROR(ValidateRowSplits(splits, num_bags, nnz));
    const Tindex* ids = a.indices->flat<Tindex>().data();
    thread::ThreadPool* pool = step.pool;
    TF_RETURN_IF_ERROR(ValidateIndices(pool, ids, nnz, num_rows, attrs));

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
    std::vector<Acc> scales;
    if (!is_max) {
      ComputeBagScales(pool, ids, w, splits, num_bags, attrs, &scales);
    }
    const T* dy_data = a.grad->flat<T>().data();
    // <dy_b, out_b> per bag, for the weights gradient of mean and sqrtn.
    std::vector<Acc> dy_dot_out;
    if (attrs.has_weights && attrs.combiner != Combiner::kSum) {
      dy_dot_out.assign(num_bags, Acc(0));
      const T* out_data = a.output->flat<T>().data();
      ForBalancedBlocks(pool, splits, num_bags, dim, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          dy_dot_out[b] = Dot<Acc>(dy_data + b * dim, out_data + b * dim, dim);
        }
      });
    }
    const int32* argmax_data = is_max ? a.argmax->flat<int32>().data() : nullptr;
    const int64_t num_unique = s.num_unique();
    const int64_t num_sorted = static_cast<int64_t>(s.bags.size());
    const RowOptimizer optimizer = sparse_attrs.optimizer;
    const Acc lr = static_cast<Acc>(a.lr);
    const Acc eps = static_cast<Acc>(a.eps);
    ForBalancedBlocks(pool, s.seg_starts.data(), num_unique, dim, [&](int64_t begin, int64_t end) {
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
          // dy_dot_out is empty for sum, which does not read it.
          const Acc dot_out = attrs.combiner == Combiner::kSum ? Acc(0) : dy_dot_out[b];
          dw[j] = static_cast<T>(WeightGrad(attrs.combiner, dot, dot_out, scale, wj));
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

#define TF_TTEMB_REGISTER(T, Tindex)                                                \
  TF_TTEMB_REGISTER_CPU_BAG_KERNEL("TfTtemb>GatherReduceSumSparseApply", T, Tindex, \
                                   GatherReduceSumSparseApplyOp<CpuDevice, T, Tindex>)
TF_TTEMB_FOR_CPU_BAG_TYPES(TF_TTEMB_REGISTER)
#undef TF_TTEMB_REGISTER

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow
