// The type every CUDA kernel of the package sums T in, and the conversions to
// and from it: float for __half, __nv_bfloat16 and float, double for double
// (half types accumulate in float32). Shared by the gather_reduce_sum and TT
// kernels; the device functions exist only for nvcc. No TensorFlow headers.

#ifndef TF_TTEMB_CUDA_ACCUMULATE_CUH_
#define TF_TTEMB_CUDA_ACCUMULATE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tf_ttemb {
namespace gpu {

template <typename T>
struct AccumulatorOf {
  using type = float;
};
template <>
struct AccumulatorOf<double> {
  using type = double;
};
template <typename T>
using AccT = typename AccumulatorOf<T>::type;

#if defined(__CUDACC__)
__device__ __forceinline__ float ToAcc(float x) { return x; }
__device__ __forceinline__ double ToAcc(double x) { return x; }
__device__ __forceinline__ float ToAcc(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToAcc(__nv_bfloat16 x) { return __bfloat162float(x); }

// Rounds to nearest even.
template <typename T>
__device__ __forceinline__ T FromAcc(AccT<T> x);
template <>
__device__ __forceinline__ float FromAcc<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ double FromAcc<double>(double x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromAcc<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromAcc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
#endif  // defined(__CUDACC__)

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_ACCUMULATE_CUH_
