// CUDA kernels of the gather_reduce_sum family (EmbeddingBag) behind plain
// launcher functions. No TensorFlow headers: the TF GPU OpKernels
// (cc/kernels/gather_reduce_sum_kernels_gpu.cc) and the ctypes harness
// (python/gpu_harness/gpu_harness_capi.cu) both call these.
//
// Inputs are the CSR form of a batch of bags (see cc/ops/gather_reduce_sum_ops.cc):
//   params  [N, D]   ids [nnz]   splits [B + 1] (int64)   weights [nnz] or null
// Semantics are the CPU kernel's: padding entries are skipped everywhere;
// mean divides by sum(w) (count when unweighted), sqrtn by sqrt(sum(w^2)); a
// zero denominator or a bag without non-padding entries gives zeros; max takes
// the first entry of the bag on ties and argmax holds the position inside the
// bag (-1 for a bag without entries). Half types accumulate in float32.
//
// Every launcher
//   * runs only on `stream` and allocates nothing: it takes caller-provided
//     device scratch of at least the bytes its *ScratchBytes function returns
//     (256-byte aligned);
//   * never reads out of bounds, whatever the ids and splits hold: bad ids are
//     skipped and bag ranges are clamped to [0, nnz];
//   * reports what it found wrong in a DeviceReport in device memory, which the
//     caller copies back (one small asynchronous copy) and turns into the same
//     InvalidArgument messages as the CPU kernel;
//   * returns cudaSuccess, cudaErrorInvalidValue for arguments it cannot take,
//     or the first CUDA error of its launches.
// Results are bitwise deterministic: every reduction runs in a fixed order
// that depends only on the shapes, never on timing (no float atomics).
//
// Supported T: __half, __nv_bfloat16, float, double. Tindex: int32_t, int64_t.

#ifndef TF_TTEMB_CUDA_GATHER_REDUCE_SUM_KERNELS_CUH_
#define TF_TTEMB_CUDA_GATHER_REDUCE_SUM_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common_types.h"
#include "cuda/gather_reduce_sum_update_kernels.cuh"

namespace tf_ttemb {
namespace gpu {

// Sizes and attributes of one call: the op's BagOptions (combiner, has_weights,
// has_padding_id, padding_id; cuda/common_types.h) and the sizes.
struct BagProblem : ::tf_ttemb::BagOptions {
  int64_t num_rows = 0;  // N
  int64_t dim = 0;       // D
  int64_t num_bags = 0;  // B
  int64_t nnz = 0;
};

// The DeviceReport (cuda/common_types.h): what the device found, in device
// memory; every finding is -1 when unset, and the header (num_rows, nnz,
// num_bags) is the call's. The checks a caller makes, in the CPU kernel's
// order (cc/kernels ReportStatus):
//   first_split != 0       -> row_splits[0] = first_split must be 0
//   first_bad_split >= 0   -> row_splits must be non-decreasing
//   last_split != nnz      -> row_splits[B] = last_split must equal nnz
//   first_bad_index >= 0   -> indices[first_bad_index] = bad_index_value is not in [0, N)

// ---------------------------------------------------------------------------
// Forward: out[b] = combine over the bag's entries. argmax is written for kMax.
template <typename T>
size_t ForwardScratchBytes(const BagProblem& p);

template <typename T, typename Tindex>
cudaError_t LaunchForward(const BagProblem& p,
                          const T* params,        // [N, D]
                          const Tindex* ids,      // [nnz]
                          const int64_t* splits,  // [B + 1]
                          const T* weights,       // [nnz] or null
                          T* out,                 // [B, D]
                          int32_t* argmax,        // [B, D] for kMax, else null
                          DeviceReport* report,   // [1], device
                          void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Gradient w.r.t. params, in two launches so that the caller can size the
// deduplicated output:
//   1. LaunchParamsGradPrepare sorts the (id, position) pairs of the valid
//      entries by id and finds the segments of equal ids; report->num_unique
//      holds U once the stream has run it. Where the report holds a problem
//      (bad ids or row_splits), it leaves the launches after it no segment,
//      so they write nothing (no output row, no table row in step 3).
//   2. LaunchParamsGradReduce reduces each segment in float (double for
//      double) in position order and writes either the deduplicated form
//      (unique_ids [U] ascending, values [U, D]) or the dense form [N, D].
//      The dense form needs no read-back of U. Segments longer than a fixed
//      length are split into pieces whose partial sums are combined in piece
//      order. Optionally it also writes the gradient w.r.t. the weights
//      (WeightsGradFusion), reading each params row once per unique id.
// The same scratch (sized for the same problem and flags) must be passed to
// both, untouched in between.

template <typename T>
struct WeightsGradFusion {
  const T* params;   // [N, D]
  const T* output;   // [B, D] forward output (needed by kMean and kSqrtn)
  const T* weights;  // [nnz]
  T* weights_grad;   // [nnz]
};

template <typename T, typename Tindex>
size_t ParamsGradScratchBytes(const BagProblem& p, bool dense, bool fuse_weights_grad);

template <typename T, typename Tindex>
cudaError_t LaunchParamsGradPrepare(const BagProblem& p,
                                    const Tindex* ids,      // [nnz]
                                    const int64_t* splits,  // [B + 1]
                                    const T* weights,       // [nnz] or null
                                    DeviceReport* report,   // [1], device
                                    bool dense, bool fuse_weights_grad, void* scratch,
                                    size_t scratch_bytes, cudaStream_t stream);

template <typename T, typename Tindex>
cudaError_t LaunchParamsGradReduce(const BagProblem& p,
                                   const T* grad,          // [B, D]
                                   const int32_t* argmax,  // [B, D] for kMax, else null
                                   Tindex* unique_ids,     // [U] (deduplicated form) or null
                                   T* values,              // [U, D] (deduplicated form) or null
                                   T* dense,               // [N, D] (dense form) or null
                                   const WeightsGradFusion<T>* fusion,  // host struct or null
                                   void* scratch, size_t scratch_bytes, cudaStream_t stream);

// 3. LaunchParamsGradApply (GatherReduceSumSparseApply) is step 2 in the
//    deduplicated form with an optimizer step in place of the output: where
//    a distinct row's summed gradient g would be written, table[row] (and its
//    accumulator) is updated with g by the rules of
//    gather_reduce_sum_update_kernels.cuh, taken in AccT<T> on the unrounded
//    sum, so the [U, D] gradient is never stored. With a fusion, whose params
//    must be `table`, the weights gradient is computed from the rows as they
//    were: a row is read and written by the one group that reduces it. On
//    bad ids or row_splits step 1 leaves it nothing to update, so the caller
//    may queue it at once and check step 1's report when the stream has run.
//    Row-wise Adagrad needs a whole row's sum of squares in one group: where
//    ApplyFusesIntoReduce is false (rows cut into several column chunks), the
//    caller reduces with LaunchParamsGradReduce and applies with
//    LaunchApplyRows. The same scratch as step 2 (dense = false).
template <typename T>
bool ApplyFusesIntoReduce(const BagProblem& p, RowOptimizer optimizer);

template <typename T, typename Tindex>
cudaError_t LaunchParamsGradApply(const BagProblem& p,
                                  const T* grad,          // [B, D]
                                  const int32_t* argmax,  // [B, D] for kMax, else null
                                  const RowUpdate<AccT<T>>& update,
                                  T* table,              // [N, D], updated in place
                                  AccT<T>* accumulator,  // [N] / [N, D], or null for kSgd
                                  const WeightsGradFusion<T>* fusion,  // host struct or null
                                  void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Gradient w.r.t. the weights (kSum, kMean, kSqrtn), on its own:
//   sum:   dw_j = <dy_b, e_j>
//   mean:  dw_j = (<dy_b, e_j> - <dy_b, out_b>) / S,        S = sum_k w_k
//   sqrtn: dw_j = <dy_b, e_j> / S - w_j <dy_b, out_b> / S^2, S = sqrt(sum_k w_k^2)
// with 0 for padding entries and for bags whose S is 0.
template <typename T>
size_t WeightsGradScratchBytes(const BagProblem& p);

template <typename T, typename Tindex>
cudaError_t LaunchWeightsGrad(const BagProblem& p,
                              const T* grad,          // [B, D]
                              const T* params,        // [N, D]
                              const Tindex* ids,      // [nnz]
                              const int64_t* splits,  // [B + 1]
                              const T* weights,       // [nnz]
                              const T* output,        // [B, D] forward output
                              T* weights_grad,        // [nnz]
                              DeviceReport* report,   // [1], device
                              void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_GATHER_REDUCE_SUM_KERNELS_CUH_
