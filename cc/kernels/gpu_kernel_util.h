// Helpers shared by the GPU OpKernels of every op family
// (cc/kernels/*_kernels_gpu.cc): TensorFlow's tensor types seen as the CUDA
// types the cuda/ launchers take, CUDA errors as Status, the asynchronous
// finish of an op from its launchers' report, and DeviceOpKernel<GpuDevice>,
// the GPU side of device_op_kernel.h.

#ifndef TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_
#define TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_

#if GOOGLE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "cc/kernels/device_op_kernel.h"
#include "tensorflow/core/common_runtime/device/device_event_mgr.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/status.h"
#include "xla/stream_executor/activate_context.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

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

// The CUDA stream TensorFlow runs the op on.
inline Status OpCudaStream(OpKernelContext* ctx, cudaStream_t* stream) {
  const DeviceContext* device_context = ctx->op_device_context();
  if (device_context == nullptr || device_context->stream() == nullptr) {
    return errors::Internal("tf_ttemb: the op has no GPU stream");
  }
  *stream = static_cast<cudaStream_t>(device_context->stream()->platform_specific_handle().stream);
  if (*stream == nullptr) return errors::Internal("tf_ttemb: the op's stream has no CUDA handle");
  return OkStatus();
}

// Pinned host memory for `words` int64 words (a report the stream copies into).
inline Status AllocatePinnedWords(OpKernelContext* ctx, int64_t words, Tensor* host) {
  AllocatorAttributes pinned;
  pinned.set_on_host(true);
  pinned.set_gpu_compatible(true);
  return ctx->allocate_temp(DT_INT64, TensorShape({words}), host, pinned);
}

// Copies `words` to `device`, a new device temporary, on `stream` without
// waiting: through pinned staging memory, since from pageable memory
// cudaMemcpyAsync may wait for the stream. The staging tensor is held until the
// stream has run the copy (the device's EventMgr, as TensorFlow core's
// GpuDeviceArrayOnHost): freed at once, the pinned allocator could hand it to
// another op to write while the copy still reads it.
inline Status CopyWordsToDevice(OpKernelContext* ctx, cudaStream_t stream,
                                const std::vector<int64_t>& words, Tensor* device) {
  const int64_t n = static_cast<int64_t>(words.size());
  TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({n}), device));
  if (n == 0) return OkStatus();
  Tensor staging;
  TF_RETURN_IF_ERROR(AllocatePinnedWords(ctx, n, &staging));
  std::memcpy(staging.data(), words.data(), n * sizeof(int64_t));
  TF_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(device->data(), staging.data(), n * sizeof(int64_t),
                                                cudaMemcpyHostToDevice, stream),
                                "copy to the device"));
  const DeviceBase::AcceleratorDeviceInfo* info =
      ctx->device()->tensorflow_accelerator_device_info();
  if (info == nullptr || info->event_mgr == nullptr) {  // no event manager: wait here
    return CudaStatus(cudaStreamSynchronize(stream), "stream synchronization");
  }
  info->event_mgr->ThenExecute(ctx->op_device_context()->stream(), [staging]() {});
  return OkStatus();
}

// Device scratch of at least `bytes` bytes in `tensor` (the launchers align it).
// Freed when `tensor` goes: TensorFlow's allocator orders its reuse after the
// work already queued on the stream.
inline Status AllocateDeviceScratch(OpKernelContext* ctx, size_t bytes, Tensor* tensor,
                                    void** scratch) {
  if (bytes > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
    return errors::ResourceExhausted("tf_ttemb: scratch of ", bytes, " bytes is too large");
  }
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(DT_INT8, TensorShape({static_cast<int64_t>(bytes)}), tensor));
  *scratch = tensor->flat<int8>().data();
  return OkStatus();
}

// Finishes an AsyncOpKernel from its launchers' report without a TensorFlow
// thread waiting on the stream: queues the copy of the report (a Report in
// device memory) into the pinned host tensor `host` on `stream` and returns.
// Once the stream has run everything queued so far, `check` turns the report
// into the op's status (the CPU kernel's InvalidArgument, or OK) and `done`
// is called, on the device's EventMgr thread, as TensorFlow core's GPU Where
// and Unique finish. `check` runs with the device's context active, so it may
// also allocate outputs sized by the report and queue more work on `stream`
// (the second step of a deduplicated gradient, as Unique's GPU kernel does);
// that work runs before any consumer of the outputs, which TensorFlow queues
// on the same stream after `done`. `keep` (the call's temporaries) is
// released before `done`: TensorFlow's GPU allocator orders a freed buffer's
// next use after the work already queued on the stream.
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
  ::stream_executor::Stream* se_stream = ctx->op_device_context()->stream();
  auto finish = [ctx, se_stream, host, keep = std::move(keep), check = std::move(check),
                 done = std::move(done)]() mutable {
    Report report;
    std::memcpy(&report, host.data(), sizeof(report));
    Status status;
    {
      const std::unique_ptr<::stream_executor::ActivateContext> active =
          se_stream->parent()->Activate();
      status = check(report);
    }
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
  info->event_mgr->ThenExecute(se_stream, std::move(finish));
}

// One GPU op call's CUDA stream, its launchers' Report in device memory with its
// pinned host copy, and its device scratch. A family's Call (GpuCall, TTGpuCall)
// derives from it; the call lives until the op finishes from the stream
// (ThenCheckReport), when everything queued that reads its memory has run.
template <typename Report>
class ReportCall {
 public:
  using ReportCheck = std::function<Status(const Report&)>;

  // The op's stream, and with `with_report` the report's device and host words.
  Status Init(OpKernelContext* ctx, bool with_report = true) {
    ctx_ = ctx;
    TF_RETURN_IF_ERROR(OpCudaStream(ctx, &stream_));
    if (!with_report) return OkStatus();
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({kWords}), &device_report_));
    return AllocatePinnedWords(ctx, kWords, &host_report_);
  }

  cudaStream_t stream() const { return stream_; }

  Report* device_report() {
    return reinterpret_cast<Report*>(device_report_.flat<int64_t>().data());
  }

  // Device scratch of at least `bytes` bytes, and at least one (the launchers align it
  // and take a non-null pointer).
  Status AllocateScratch(size_t bytes, void** scratch) {
    return AllocateDeviceScratch(ctx_, std::max<size_t>(1, bytes), &scratch_, scratch);
  }

  // Copies the report to the host without waiting (tf_ttemb::ThenCheckReport): the
  // op's status is `check`'s and `done` is called once the stream has run what is
  // queued; the call (its report and temporaries) lives until then.
  static void ThenCheckReport(std::shared_ptr<ReportCall> call, ReportCheck check,
                              AsyncOpKernel::DoneCallback done) {
    OpKernelContext* ctx = call->ctx_;
    const cudaStream_t stream = call->stream_;
    const Tensor host = call->host_report_;
    const Report* report = call->device_report();
    ::tensorflow::tf_ttemb::ThenCheckReport<Report>(ctx, stream, host, report, std::move(call),
                                                    std::move(check), std::move(done));
  }

 protected:
  static_assert(sizeof(Report) % sizeof(int64_t) == 0,
                "a report must be a whole number of int64 words");
  static constexpr int64_t kWords = sizeof(Report) / sizeof(int64_t);

  OpKernelContext* ctx_ = nullptr;
  cudaStream_t stream_ = nullptr;

 private:
  Tensor device_report_;
  Tensor host_report_;
  Tensor scratch_;
};

// The GPU kernel of a TfTtemb>Check*Report op: copies the report input (written
// on the device by the op that produced it) to pinned host memory and finishes
// from the EventMgr once the stream has run that op, with the CPU kernel's
// InvalidArgument for what it holds. Traits give
//   using Report = ...; using Attrs = ...;
//   static Status GetAttrs(OpKernelConstruction*, Attrs*);
//   static Status Validate(const Tensor& report, bool* empty);  // empty: a CPU op's
//   static Status Check(const Report&, const Attrs&);
template <typename Traits>
class CheckReportGpuOp : public AsyncOpKernel {
 public:
  explicit CheckReportGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, Traits::GetAttrs(ctx, &attrs_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    using Report = typename Traits::Report;
    const Tensor& report = ctx->input(0);
    bool empty = false;
    OP_REQUIRES_OK_ASYNC(ctx, Traits::Validate(report, &empty), done);
    if (empty) {
      done();
      return;
    }
    cudaStream_t stream = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, OpCudaStream(ctx, &stream), done);
    Tensor host;
    constexpr int64_t kWords = sizeof(Report) / sizeof(int64_t);
    OP_REQUIRES_OK_ASYNC(ctx, AllocatePinnedWords(ctx, kWords, &host), done);
    const typename Traits::Attrs* attrs = &attrs_;  // the kernel outlives its calls
    ThenCheckReport<Report>(
        ctx, stream, host, reinterpret_cast<const Report*>(report.flat<int64_t>().data()),
        /*keep=*/nullptr, [attrs](const Report& r) { return Traits::Check(r, *attrs); },
        std::move(done));
  }

 private:
  typename Traits::Attrs attrs_;
};

// ComputeAsync of a GPU op: `launch(call, &check)` validates, allocates and
// queues the work on a new Call (GpuCall or TTGpuCall: one op call's stream,
// report and temporaries) and sets `check`, or returns an error (an
// AsyncOpKernel must not fail through OP_REQUIRES, which aborts the process
// there). The op then finishes from the stream (Call::ThenCheckReport, where
// `check` may also size outputs and queue a second step), so no TensorFlow
// thread waits on the GPU; an unset `check` (nothing queued that needs
// checking) finishes at once. A variable read in place is locked only while
// the work is queued: later writers run on the same compute stream, after it.
template <typename Call, typename Launch>
void LaunchThenCheck(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done, Launch launch) {
  auto call = std::make_shared<Call>();
  typename Call::ReportCheck check;
  OP_REQUIRES_OK_ASYNC(ctx, launch(call.get(), &check), done);
  if (!check) {
    done();
    return;
  }
  Call::ThenCheckReport(std::move(call), std::move(check), std::move(done));
}

// What a Launch<GpuDevice> runs with besides the context: the op call's Call
// (GpuCall or TTGpuCall: its stream, report and temporaries, alive until the
// op finishes) and the check LaunchThenCheck runs once the stream has run
// what the launch queued (unset: the op finishes at once).
template <typename Call>
struct GpuStep {
  Call* call = nullptr;
  typename Call::ReportCheck* check = nullptr;
};

// The GPU op of device_op_kernel.h: an AsyncOpKernel whose ComputeAsync is
// LaunchThenCheck over Op::ComputeWith, with the Call of Op::Launch
// (`using Call = ...;` in the GPU specialisation).
template <typename Op>
class DeviceOpKernel<GpuDevice, Op> : public AsyncOpKernel {
 public:
  explicit DeviceOpKernel(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) final {
    using Call = typename Op::Launch::Call;
    LaunchThenCheck<Call>(
        ctx, std::move(done), [this, ctx](Call* call, typename Call::ReportCheck* check) {
          return static_cast<Op*>(this)->ComputeWith(ctx, GpuStep<Call>{call, check});
        });
  }
};

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // GOOGLE_CUDA

#endif  // TF_TTEMB_CC_KERNELS_GPU_KERNEL_UTIL_H_
