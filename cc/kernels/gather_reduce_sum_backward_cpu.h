// The first steps of every CPU params gradient of gather_reduce_sum, shared by
// its kernels (gather_reduce_sum_backward_cpu.cc) and by TTRowsBagsGrad
// (tt_embedding_backward_cpu.cc), which reduces the same segments into the TT
// leaves' gradients instead of a table: the bags' checks, the entries sorted
// by id, the bags' scales and the sorted entries' coefficients.

#ifndef TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_BACKWARD_CPU_H_
#define TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_BACKWARD_CPU_H_

#include <cstdint>
#include <vector>

#include "cc/kernels/gather_reduce_sum_cpu.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {

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
  // The sorted entries and coefficients live in the thread's ThreadScratch.
  SortedEntries& sorted = ThreadScratch::Get().sorted;
  std::vector<Acc> scales;
  // [M] per sorted entry (SortedCoefficients); empty for max
  std::vector<Acc>& coef = *ThreadScratch::Get().coef(static_cast<Acc*>(nullptr));

  // Calls write(u, acc) for every unique id, in parallel over segments
  // balanced by entry count.
  template <typename Write>
  void ReduceAll(Write write) const {
    const int64_t num_unique = sorted.num_unique();
    ForBalancedBlocks(pool, sorted.seg_starts.data(), num_unique, dim,
                      [&](int64_t begin, int64_t end) {
                        std::vector<Acc> acc(dim);
                        for (int64_t u = begin; u < end; ++u) {
                          ReduceSegment(sorted, u, grad, argmax != nullptr ? nullptr : coef.data(),
                                        argmax, splits, dim, acc.data());
                          write(u, acc.data());
                        }
                      });
  }
};

// What a params gradient (and the fused gradient) reads: the bags' tensors.
struct BackwardInputs {
  BagShapes shapes;
  int64_t num_rows = 0;
  int64_t dim = 0;
  const Tensor* row_splits = nullptr;  // [B + 1]
  const Tensor* indices = nullptr;     // [nnz]
  const Tensor* grad = nullptr;        // [B, D]
  const Tensor* weights = nullptr;     // [nnz], or null without weights
  const Tensor* argmax = nullptr;      // [B, D] for max, else null
};

// The CPU checks of the ids and row_splits of a backward, then the entries
// sorted by id, the bags' scales and the sorted entries' coefficients (and,
// where `w_sorted` is given, their weights).
template <typename T, typename Tindex>
Status PrepareParamsGrad(const BagAttrs& attrs, const BackwardInputs& in, thread::ThreadPool* pool,
                         ParamsGradCall<T, Tindex>* call,
                         std::vector<AccT<T>>* w_sorted = nullptr) {
  call->shapes = in.shapes;
  call->num_rows = in.num_rows;
  call->dim = in.dim;
  const int64_t num_bags = call->shapes.num_bags;
  const int64_t nnz = call->shapes.nnz;
  call->splits = in.row_splits->flat<int64_t>().data();
  call->ids = in.indices->flat<Tindex>().data();
  call->pool = pool;
  TF_RETURN_IF_ERROR(
      ValidateBags(pool, call->splits, call->ids, num_bags, nnz, call->num_rows, attrs));
  call->grad = in.grad->flat<T>().data();
  call->weights = in.weights != nullptr ? in.weights->flat<T>().data() : nullptr;
  call->argmax = in.argmax != nullptr ? in.argmax->flat<int32>().data() : nullptr;
  SortEntries(call->pool, call->ids, call->splits, num_bags, nnz, call->num_rows, attrs,
              &call->sorted);
  if (call->argmax == nullptr) {
    ComputeBagScales(call->pool, call->ids, call->weights, call->splits, num_bags, attrs,
                     &call->scales);
    SortedCoefficients(call->pool, call->sorted, call->weights, call->scales.data(), &call->coef,
                       w_sorted);
  }
  return OkStatus();
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_BACKWARD_CPU_H_
