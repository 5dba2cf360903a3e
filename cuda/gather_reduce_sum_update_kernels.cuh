// CUDA kernel of GatherReduceSumSparseApply's update step: an optimizer
// applied in place to the distinct rows of a table, given each row's summed
// gradient. The reduction itself (sort by id, segmented sum in a fixed order)
// is LaunchParamsGradPrepare / LaunchParamsGradReduce of
// gather_reduce_sum_kernels.cuh; the TF GPU OpKernel
// (cc/kernels/gather_reduce_sum_kernels_gpu.cc) runs the three in a row on the
// op's stream. No TensorFlow headers.
//
// With lr, eps and g = grad[u] (the row's summed gradient), for row r = rows[u]:
//   kSgd:            w[r] -= lr * g
//   kRowwiseAdagrad: a[r] += mean(g^2) (a: [N]);     w[r] -= lr g / (sqrt(a[r]) + eps)
//   kAdagrad:        a[r] += g^2 (a: [N, D]);        w[r] -= lr g / (sqrt(a[r]) + eps)
// as the CPU kernel computes it (cc/kernels/gather_reduce_sum_kernels.cc): in
// Acc (float for half types and float, double for double), the row rounded to
// T once when stored; a zero denominator leaves the row (element) unchanged.
// mean(g^2) sums each lane's elements in column order, then the 32 lanes in a
// fixed butterfly: bitwise deterministic, though not the CPU's summation order.
//
// The launcher runs only on `stream`, allocates nothing, never reads or
// writes out of bounds (rows outside [0, num_rows) are skipped) and returns
// cudaSuccess, cudaErrorInvalidValue for arguments it cannot take, or the
// launch's error. The rows must be distinct (each row is owned by one warp).
//
// Supported (T, Acc): (__half, float), (__nv_bfloat16, float), (float, float),
// (double, double). Tindex: int32_t, int64_t.

#ifndef TF_TTEMB_CUDA_GATHER_REDUCE_SUM_UPDATE_KERNELS_CUH_
#define TF_TTEMB_CUDA_GATHER_REDUCE_SUM_UPDATE_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common_types.h"

namespace tf_ttemb {
namespace gpu {

template <typename Acc>
struct RowUpdate {
  RowOptimizer optimizer = RowOptimizer::kSgd;
  Acc learning_rate = Acc(0);
  Acc epsilon = Acc(0);
  int64_t num_rows = 0;  // N
  int64_t dim = 0;       // D
};

#if defined(__CUDACC__)
// The rules above on one element, in Acc, for the kernels that apply them
// (LaunchApplyRows, and LaunchParamsGradApply of gather_reduce_sum_kernels.cuh).
// Each returns the element's new value w; `a` is the element's accumulator.
template <typename Acc>
__device__ __forceinline__ Acc SgdElement(const RowUpdate<Acc>& up, Acc w, Acc g) {
  return w - up.learning_rate * g;
}
template <typename Acc>
__device__ __forceinline__ Acc AdagradElement(const RowUpdate<Acc>& up, Acc w, Acc g, Acc* a) {
  const Acc sum = *a + g * g;
  *a = sum;
  const Acc denominator = sqrt(sum) + up.epsilon;
  return denominator == Acc(0) ? w : w - up.learning_rate * g / denominator;  // 0: g is 0
}
// Row-wise Adagrad: the row's step lr / (sqrt(a) + eps) from its updated
// accumulator a, 0 for a zero denominator (then g is 0); each element then
// takes RowwiseElement.
template <typename Acc>
__device__ __forceinline__ Acc RowwiseStep(const RowUpdate<Acc>& up, Acc a) {
  const Acc denominator = sqrt(a) + up.epsilon;
  return denominator == Acc(0) ? Acc(0) : up.learning_rate / denominator;
}
template <typename Acc>
__device__ __forceinline__ Acc RowwiseElement(Acc step, Acc w, Acc g) {
  return w - step * g;
}
#endif  // defined(__CUDACC__)

template <typename T, typename Acc, typename Tindex>
cudaError_t LaunchApplyRows(const RowUpdate<Acc>& update,
                            const Tindex* rows,  // [num_unique], distinct
                            const T* grad,       // [num_unique, D]
                            int64_t num_unique,
                            T* table,          // [N, D], updated in place
                            Acc* accumulator,  // [N] / [N, D], or null for kSgd
                            cudaStream_t stream);

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_GATHER_REDUCE_SUM_UPDATE_KERNELS_CUH_
