// Helpers shared by the GPU OpKernels of every op family
// (cc/kernels/*_kernels_gpu.cc): TensorFlow's tensor types seen as the CUDA
// types the cuda/ launchers take, CUDA errors as Status, and the asynchronous
// finish of an op from its launchers' report.

#ifndef TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_
#define TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_

#if GOOGLE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <memory>
#include <utility>

#include "tensorflow/core/common_runtime/device/device_event_mgr.h"
#include "tensorflow/core/framework/op_kernel.h"
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
static_assert(sizeof(Eigen::half) == sizeof(__half) && alignof(Eigen::half) == alignof(__half),
              "Eigen::half and __half must have the same layout");
static_assert(sizeof(bfloat16) == sizeof(__nv_bfloat16) &&
                  alignof(bfloat16) == alignof(__nv_bfloat16),
              "bfloat16 and __nv_bfloat16 must have the same layout");

template <typename T>
const typename CudaTypeOf<T>::type* DevicePtr(const Tensor& t) {
  return reinterpret_cast<const typename CudaTypeOf<T>::type*>(t.flat<T>().data());
}
template <typename T>
typename CudaTypeOf<T>::type* DevicePtr(Tensor* t) {
  return reinterpret_cast<typename CudaTypeOf<T>::type*>(t->flat<T>().data());
}

// A launcher's CUDA error as an Internal status naming the step.
inline Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return OkStatus();
  return errors::Internal("tf_ttemb GPU ", what, " failed: ", cudaGetErrorName(err), " (",
                          cudaGetErrorString(err), ")");
}

// Finishes an AsyncOpKernel from its launchers' report without a TensorFlow
// thread waiting on the stream: queues the copy of the report (a Report in
// device memory) into the pinned host tensor `host` on `stream` and returns.
// Once the stream has run everything queued so far, `check` turns the report
// into the op's status (the CPU kernel's InvalidArgument, or OK) and `done`
// is called, on the device's EventMgr thread, as TensorFlow core's GPU Where
// and Unique finish. `keep` (the call's temporaries) is released before
// `done`.
template <typename Report>
void ThenCheckReport(OpKernelContext* ctx, cudaStream_t stream, Tensor host,
                     const Report* device_report, std::shared_ptr<void> keep,
                     std::function<Status(const Report&)> check, AsyncOpKernel::DoneCallback done) {
  const Status copied = CudaStatus(
      cudaMemcpyAsync(host.data(), device_report, sizeof(Report), cudaMemcpyDeviceToHost, stream),
      "copy of the device report");
  if (!copied.ok()) {
    ctx->SetStatus(copied);
    done();
    return;
  }
  auto finish = [ctx, host, keep = std::move(keep), check = std::move(check),
                 done = std::move(done)]() mutable {
    Report report;
    std::memcpy(&report, host.data(), sizeof(report));
    const Status status = check(report);
    if (!status.ok()) ctx->SetStatus(status);
    keep.reset();
    done();
  };
  const DeviceBase::AcceleratorDeviceInfo* info =
      ctx->device()->tensorflow_accelerator_device_info();
  if (info == nullptr || info->event_mgr == nullptr) {  // no event manager
    const Status synced = CudaStatus(cudaStreamSynchronize(stream), "stream synchronization");
    if (!synced.ok()) ctx->SetStatus(synced);
    finish();
    return;
  }
  info->event_mgr->ThenExecute(ctx->op_device_context()->stream(), std::move(finish));
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // GOOGLE_CUDA

#endif  // TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_
