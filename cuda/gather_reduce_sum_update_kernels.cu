// The optimizer step of GatherReduceSumSparseApply on the GPU. See the header
// for the contract.
//
// Thread mapping: one warp per listed row u (grid-stride over the rows); lane
// l handles columns l, l + 32, l + 64, ... of the row, so each step of the
// warp reads and writes 32 consecutive elements (coalesced).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/gather_reduce_sum_update_kernels.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

constexpr int kWarpsPerBlock = kBlock / 32;
constexpr int64_t kMaxBlocks = 65535;

template <typename T, typename Acc, typename Tindex>
__global__ void __launch_bounds__(kBlock)
    ApplyRowsKernel(const RowUpdate<Acc> up,
                    const Tindex* __restrict__ rows,  // [U]
                    const T* __restrict__ grad,       // [U, D]
                    int64_t num_unique,
                    T* __restrict__ table,            // [N, D]
                    Acc* __restrict__ accumulator) {  // [N] / [N, D] / null
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t dim = up.dim;
  for (int64_t u = warp; u < num_unique; u += warps) {
    const int64_t r = static_cast<int64_t>(rows[u]);
    if (r < 0 || r >= up.num_rows) continue;  // uniform across the warp
    const T* g = grad + u * dim;
    T* w = table + r * dim;
    switch (up.optimizer) {
      case RowOptimizer::kSgd:
        for (int64_t d = lane; d < dim; d += 32) {
          w[d] = FromAcc<T>(SgdElement(up, ToAcc(w[d]), ToAcc(g[d])));
        }
        break;
      case RowOptimizer::kRowwiseAdagrad: {
        Acc square_sum = Acc(0);
        for (int64_t d = lane; d < dim; d += 32) {
          const Acc x = ToAcc(g[d]);
          square_sum += x * x;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
          square_sum += __shfl_xor_sync(0xffffffffu, square_sum, offset);
        }
        const Acc a = accumulator[r] + square_sum / static_cast<Acc>(dim);
        __syncwarp();
        if (lane == 0) accumulator[r] = a;
        const Acc step = RowwiseStep(up, a);
        for (int64_t d = lane; d < dim; d += 32) {
          w[d] = FromAcc<T>(RowwiseElement(step, ToAcc(w[d]), ToAcc(g[d])));
        }
        break;
      }
      case RowOptimizer::kAdagrad: {
        Acc* a = accumulator + r * dim;
        for (int64_t d = lane; d < dim; d += 32) {
          w[d] = FromAcc<T>(AdagradElement(up, ToAcc(w[d]), ToAcc(g[d]), a + d));
        }
        break;
      }
    }
  }
}

}  // namespace

template <typename T, typename Acc, typename Tindex>
cudaError_t LaunchApplyRows(const RowUpdate<Acc>& update, const Tindex* rows, const T* grad,
                            int64_t num_unique, T* table, Acc* accumulator, cudaStream_t stream) {
  if (num_unique < 0 || update.num_rows < 0 || update.dim < 0 ||
      (update.optimizer != RowOptimizer::kSgd && accumulator == nullptr && num_unique > 0)) {
    return cudaErrorInvalidValue;
  }
  if (num_unique == 0 || update.dim == 0 || update.num_rows == 0) return cudaSuccess;
  if (rows == nullptr || grad == nullptr || table == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks =
      std::min<int64_t>((num_unique + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
  ApplyRowsKernel<T, Acc, Tindex><<<static_cast<int>(blocks), kBlock, 0, stream>>>(
      update, rows, grad, num_unique, table, accumulator);
  return cudaGetLastError();
}

#define TTEMB_INSTANTIATE(T, Acc, Tindex)                                                    \
  template cudaError_t LaunchApplyRows<T, Acc, Tindex>(const RowUpdate<Acc>&, const Tindex*, \
                                                       const T*, int64_t, T*, Acc*, cudaStream_t);
#define TTEMB_INSTANTIATE_T(T)           \
  TTEMB_INSTANTIATE(T, AccT<T>, int32_t) \
  TTEMB_INSTANTIATE(T, AccT<T>, int64_t)

TTEMB_FOR_EACH_VALUE_TYPE(TTEMB_INSTANTIATE_T)

#undef TTEMB_INSTANTIATE_T
#undef TTEMB_INSTANTIATE

}  // namespace gpu
}  // namespace tf_ttemb
