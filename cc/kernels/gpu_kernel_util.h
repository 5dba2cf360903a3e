// Helpers shared by the GPU OpKernels of every op family
// (cc/kernels/*_kernels_gpu.cc): TensorFlow's tensor types seen as the CUDA
// types the cuda/ launchers take, and CUDA errors as Status.

#ifndef TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_
#define TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_

#if GOOGLE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// TensorFlow's half types and the CUDA types the launchers take have the
// same layout; data pointers are reinterpreted.
template <typename T>
struct CudaTypeOf {
  using type = T;
};
template <>
struct CudaTypeOf<Eigen::half> {
  using type = __half;
};
template <>
struct CudaTypeOf<bfloat16> {
  using type = __nv_bfloat16;
};
static_assert(sizeof(Eigen::half) == sizeof(__half) &&
                  alignof(Eigen::half) == alignof(__half),
              "Eigen::half and __half must have the same layout");
static_assert(sizeof(bfloat16) == sizeof(__nv_bfloat16) &&
                  alignof(bfloat16) == alignof(__nv_bfloat16),
              "bfloat16 and __nv_bfloat16 must have the same layout");

template <typename T>
const typename CudaTypeOf<T>::type* DevicePtr(const Tensor& t) {
  return reinterpret_cast<const typename CudaTypeOf<T>::type*>(
      t.flat<T>().data());
}
template <typename T>
typename CudaTypeOf<T>::type* DevicePtr(Tensor* t) {
  return reinterpret_cast<typename CudaTypeOf<T>::type*>(t->flat<T>().data());
}

// A launcher's CUDA error as an Internal status naming the step.
inline Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return OkStatus();
  return errors::Internal("tf_ttemb GPU ", what, " failed: ",
                          cudaGetErrorName(err), " (", cudaGetErrorString(err),
                          ")");
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // GOOGLE_CUDA

#endif  // TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_
