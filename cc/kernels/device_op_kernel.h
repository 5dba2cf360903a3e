// The device tags and the OpKernel base of the package's ops, written once for
// both devices in TensorFlow core's way. An op is one class template
// XxxOp<Device, ...> deriving from DeviceOpKernel<Device, XxxOp<...>>: its
// constructor parses the attrs once; its public
//   template <typename Step> Status ComputeWith(OpKernelContext*, const Step&);
// runs the host-side checks shared by both devices, allocates the outputs
// whose size the host knows and returns
//   XxxLaunch<Device, ...>::Run(ctx, attrs, args, step),
// a functor that the device's source file specialises and registers the op
// with (*_cpu.cc for CpuDevice, *_gpu.cc for GpuDevice). The op names that
// functor `Launch`.
//
// DeviceOpKernel<CpuDevice, Op> (here) is an OpKernel whose Compute wraps
// ComputeWith in OP_REQUIRES_OK, with a CpuStep. DeviceOpKernel<GpuDevice, Op>
// (gpu_kernel_util.h, GPU sources only) is an AsyncOpKernel that runs it
// through LaunchThenCheck, with a GpuStep of Launch::Call.

#ifndef TF_TTEMB_CC_KERNELS_DEVICE_OP_KERNEL_H_
#define TF_TTEMB_CC_KERNELS_DEVICE_OP_KERNEL_H_

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/status.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {

// The devices an OpKernel of the package is instantiated for (the kernels use
// no Eigen expressions, so plain tags rather than Eigen's device types).
struct CpuDevice {};
struct GpuDevice {};

// What a Launch<CpuDevice> runs with besides the context: TF's CPU pool.
struct CpuStep {
  thread::ThreadPool* pool = nullptr;
};

template <typename Device, typename Op>
class DeviceOpKernel;

template <typename Op>
class DeviceOpKernel<CpuDevice, Op> : public OpKernel {
 public:
  explicit DeviceOpKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) final {
    const CpuStep step{ctx->device()->tensorflow_cpu_worker_threads()->workers};
    OP_REQUIRES_OK(ctx, static_cast<Op*>(this)->ComputeWith(ctx, step));
  }
};

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_DEVICE_OP_KERNEL_H_
