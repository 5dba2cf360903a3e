// GPU OpKernels of the TT embedding family: TensorFlow glue around the CUDA
// launchers of cuda/tt_embedding_kernels.cuh (TTUniqueIds, TTRows,
// TTRowsGrad) and cuda/tt_update_kernels.cuh (TTCacheCount). The OpKernels
// are the ones written once for both devices (tt_embedding_op.h); this file
// specialises their Launch functors for GpuDevice and registers them.
//
// Every op
//   * checks shapes and host-resident inputs (table_splits), and the GPU
//     kernels' own limits, on the host with the validation shared with the
//     CPU kernels (tt_embedding_kernels.h): same checks, same messages, in
//     the same order;
//   * runs the launchers on the op's CUDA stream, with scratch from
//     allocate_temp sized by the launchers' size queries;
//   * for the ids it reads, has the launchers fill a TTReport
//     (cuda/common_types.h) from which the CPU kernel's InvalidArgument for the
//     first bad id is raised.
// TTRows is a synchronous OpKernel: it queues its work and returns, its report
// an output that TfTtemb>CheckTTRowsReport (registered here) raises from, so
// nothing downstream of the rows waits for the device. The others are
// AsyncOpKernels (DeviceOpKernel<GpuDevice>): they queue their work and finish
// from the device's EventMgr thread once the stream has run it
// (LaunchThenCheck), so no TensorFlow thread waits on the GPU; an op with
// nothing to check (TTCacheCount, empty inputs) finishes at once.
//
// Data-dependent output sizes. TensorFlow allocates an output before a kernel
// writes it, but U (TTUniqueIds) and n_k (TTRowsGrad) are only known on the
// device. Both ops finish in the report's check, which runs once the stream
// has run the first step, as TensorFlow core's GPU Unique does:
//   * TTUniqueIds: the launcher writes the sorted distinct ids into an
//     upper-bound buffer [nnz] and U into the report; the check sets the
//     output to the first U entries of that buffer (a Tensor slice, no copy).
//     slots [nnz] has a static size and is final.
//   * TTRowsGrad: LaunchRowsGradPrepare sorts the core rows and writes n_k
//     into the report; the check allocates the outputs [n_k] and
//     [n_k, width_k] and RowsGradCompute's float work buffer, sized by the same
//     report for these ids (not the upper bound for any num_ids ids: 0.6
//     instead of 8.2 GB in all at FBTT's shape and 1.24M ids), and queues
//     LaunchRowsGradCompute (Prepare's scratch, untouched in between).
// TTCacheCount reads nothing back: it queues the update under the variables'
// locks, as TensorFlow's own GPU variable updates do; later readers of the
// variables run on the same stream, after it.
//
// The suite runs these kernels through TensorFlow on an H200
// (../shared/tf_gpu/; BENCHMARKS.md).

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

#include "cc/kernels/check_report_op.h"
#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/gpu_kernel_util.h"
#include "cc/kernels/tt_embedding_kernels.h"
#include "cc/kernels/tt_embedding_op.h"
#include "cuda/tt_embedding_kernels.cuh"
#include "cuda/tt_update_kernels.cuh"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {
namespace tf_ttemb {
namespace {

// The CUDA launchers (namespace ::tf_ttemb::gpu, outside `tensorflow`).
namespace launchers = ::tf_ttemb::gpu;

// The factorisation in the launchers' form (ValidateGpuTTShape, in the kernel
// constructor, checked that they can take it).
launchers::TTProblem MakeTTProblem(const TTShape& s) {
  launchers::TTProblem p;
  p.num_cores = s.num_cores;
  p.num_tables = s.num_tables;
  for (int k = 0; k < s.num_cores; ++k) {
    p.p[k] = s.p[k];
    p.q[k] = s.q[k];
  }
  for (int k = 0; k <= s.num_cores; ++k) p.r[k] = s.r[k];
  return p;
}

// The op's CUDA stream, the launchers' report in device memory and its pinned
// host copy, and the call's scratch, for one op call. The call lives until the
// op finishes from the stream (ThenCheckReport), when everything queued that
// reads its host memory has run.
class TTGpuCall : public ReportCall<TTReport> {
 public:
  TTGpuCall() = default;
  TTGpuCall(const TTGpuCall&) = delete;
  TTGpuCall& operator=(const TTGpuCall&) = delete;

  // When Compute leaves early (an error) after queuing a copy from pinned
  // staging memory, waits for it: the staging buffer goes back to the pinned
  // allocator with this object and must not be reused while the copy reads it.
  ~TTGpuCall() {
    if (copy_pending_) cudaStreamSynchronize(stream_);
  }

  // A second device scratch (TTRowsGrad's work part), alive as long as this
  // call, like the first.
  Status AllocateWork(size_t bytes, void** work) {
    return AllocateDeviceScratch(ctx_, std::max<size_t>(1, bytes), &work_, work);
  }

  // Copies a host int64 tensor to a new device temporary, through pinned
  // memory (the copy is asynchronous; the staging buffer lives as long as
  // this call, which lasts until the stream has run the copy).
  Status CopyToDevice(const Tensor& host, Tensor* device) {
    const int64_t n = host.NumElements();
    TF_RETURN_IF_ERROR(AllocatePinnedWords(ctx_, n, &staging_));
    TF_RETURN_IF_ERROR(ctx_->allocate_temp(DT_INT64, TensorShape({n}), device));
    if (n == 0) return OkStatus();
    std::memcpy(staging_.flat<int64_t>().data(), host.flat<int64_t>().data(), n * sizeof(int64_t));
    copy_pending_ = true;
    return CudaStatus(
        cudaMemcpyAsync(device->flat<int64_t>().data(), staging_.flat<int64_t>().data(),
                        n * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
        "copy to the device");
  }

  // ReportCall::ThenCheckReport, noting that the stream has run the copies.
  static void ThenCheckReport(std::shared_ptr<TTGpuCall> call, ReportCheck check,
                              AsyncOpKernel::DoneCallback done) {
    TTGpuCall* raw = call.get();
    ReportCall::ThenCheckReport(
        std::move(call),
        [raw, check = std::move(check)](const TTReport& r) {
          raw->copy_pending_ = false;  // the stream has run the copies
          return check(r);
        },
        std::move(done));
  }

 private:
  Tensor work_;
  Tensor staging_;
  bool copy_pending_ = false;
};

// ---------------------------------------------------------------------------
// TTCacheCount

// Makes the variable's device buffer exclusively owned before the in-place
// update (a tensor read from it earlier may still share it): a device copy
// queued on the op's stream.
Status EnsureExclusiveOnGpu(OpKernelContext* ctx, cudaStream_t stream, Var* var) {
  Tensor* tensor = var->tensor();
  if (tensor->RefCountIsOne()) return OkStatus();
  Tensor copy;
  AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy, attr));
  if (tensor->TotalBytes() > 0) {
    TF_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(copy.data(), tensor->data(), tensor->TotalBytes(),
                                                  cudaMemcpyDeviceToDevice, stream),
                                  "copy of a variable"));
  }
  *tensor = copy;
  return OkStatus();
}

// The second step of TTRowsGrad, with the report of the first.
template <typename T>
Status RowsGradCompute(OpKernelContext* ctx, const TTShape& shape, const TTRowsGradArgs& a,
                       TTGpuCall* call, void* scratch, size_t scratch_bytes,
                       const TTReport& report) {
  using CT = typename CudaTypeOf<T>::type;
  const int num_cores = shape.num_cores;
  const int64_t num_ids = a.num_ids;
  TF_RETURN_IF_ERROR(GlobalIdsReportStatus(report, shape.num_ids()));
  // Checked after the ids, as the CPU kernel does (prepare does not read
  // grad).
  TF_RETURN_IF_ERROR(ValidateRowsGradShape(*a.grad, num_ids, shape));
  OpOutputList indices_out, values_out;
  TF_RETURN_IF_ERROR(ctx->output_list("core_grad_indices", &indices_out));
  TF_RETURN_IF_ERROR(ctx->output_list("core_grad_values", &values_out));
  const CT* core_ptrs[kMaxTTCores] = {};
  int64_t* index_ptrs[kMaxTTCores] = {};
  CT* value_ptrs[kMaxTTCores] = {};
  for (int k = 0; k < num_cores; ++k) {
    const int64_t count = report.core_rows[k];
    const int64_t core_rows = shape.num_tables * shape.p[k];
    if (count < 0 || count > std::min(num_ids, core_rows)) {
      return errors::Internal("tf_ttemb GPU TTRowsGrad: the device found ", count, " rows of core ",
                              k, " touched by ", num_ids, " ids");
    }
    Tensor* indices = nullptr;
    Tensor* values = nullptr;
    TF_RETURN_IF_ERROR(indices_out.allocate(k, TensorShape({count}), &indices));
    TF_RETURN_IF_ERROR(values_out.allocate(k, TensorShape({count, shape.width[k]}), &values));
    core_ptrs[k] = DevicePtr<T>(a.cores[k]);
    // Null where n_k == 0, which the launcher allows.
    index_ptrs[k] = count > 0 ? indices->flat<int64_t>().data() : nullptr;
    value_ptrs[k] = values->NumElements() > 0 ? DevicePtr<T>(values) : nullptr;
  }
  const launchers::TTProblem problem = MakeTTProblem(shape);
  const size_t work_bytes = launchers::RowsGradWorkBytes<CT>(problem, num_ids, &report);
  void* work = nullptr;
  TF_RETURN_IF_ERROR(call->AllocateWork(work_bytes, &work));
  // Queued after the outputs exist; the stream orders it before any reader.
  // The scratch is the prepare launch's, untouched since.
  return CudaStatus(launchers::LaunchRowsGradCompute<CT>(
                        problem, a.ids->flat<int64_t>().data(), num_ids,
                        /*num_ids=*/nullptr, core_ptrs, DevicePtr<T>(*a.grad), index_ptrs,
                        value_ptrs, /*core_dense=*/nullptr, scratch, scratch_bytes, &report, work,
                        work_bytes, call->stream()),
                    "TTRowsGrad compute");
}

}  // namespace

// ---------------------------------------------------------------------------
// TTUniqueIds

// U is known only on the device: the launch is queued, and once the stream
// has run it the report's check (on the EventMgr thread) sets the output to
// the first U ids, as TensorFlow core's GPU Unique does.
template <typename Tindex>
struct UniqueIdsLaunch<GpuDevice, Tindex> {
  using Call = TTGpuCall;

  static Status Run(OpKernelContext* ctx, const UniqueIdsAttrs& attrs, const UniqueIdsArgs& a,
                    const GpuStep<TTGpuCall>& step) {
    const int64_t nnz = a.nnz;
    if (nnz == 0) {
      Tensor* unique = nullptr;
      return ctx->allocate_output(0, TensorShape({0}), &unique);
    }
    TTGpuCall* call = step.call;
    TF_RETURN_IF_ERROR(call->Init(ctx, /*with_report=*/true));
    Tensor device_splits;
    TF_RETURN_IF_ERROR(call->CopyToDevice(*a.table_splits, &device_splits));
    // Upper bound of the output; its first U entries become the output.
    Tensor unique_buffer;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({nnz}), &unique_buffer));
    launchers::UniqueIdsProblem p;
    p.nnz = nnz;
    p.num_tables = a.num_tables;
    p.num_embeddings = attrs.num_embeddings;
    p.stride = attrs.stride;
    p.has_padding_id = attrs.bag.has_padding_id;
    p.padding_id = attrs.bag.padding_id;
    const size_t scratch_bytes = launchers::UniqueIdsScratchBytes<Tindex>(p);
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(call->AllocateScratch(scratch_bytes, &scratch));
    TF_RETURN_IF_ERROR(
        CudaStatus(launchers::LaunchUniqueIds<Tindex>(
                       p, a.ids->flat<Tindex>().data(), device_splits.flat<int64_t>().data(),
                       unique_buffer.flat<int64_t>().data(), a.slots->flat<Tindex>().data(),
                       call->device_report(), scratch, scratch_bytes, call->stream()),
                   "TTUniqueIds launch"));
    *step.check = [ctx, nnz, unique_buffer, num_embeddings = attrs.num_embeddings,
                   bag = attrs.bag](const TTReport& report) -> Status {
      if (report.first_bad_index >= 0) {
        return BadIndexError(report.first_bad_index, report.bad_index_value, num_embeddings, bag);
      }
      const int64_t num_unique = report.num_unique;
      if (num_unique < 0 || num_unique > nnz) {
        return errors::Internal("tf_ttemb GPU TTUniqueIds: the device found ", num_unique,
                                " unique ids among ", nnz, " ids");
      }
      // A view of the buffer's first U ids: no copy (the buffer's tail stays
      // allocated as long as the output lives, at most 8 bytes per id).
      ctx->set_output(0, unique_buffer.Slice(0, num_unique));
      return OkStatus();
    };
    return OkStatus();
  }
};

// ---------------------------------------------------------------------------
// TTRows

// Synchronous: the rows and the ids' check are queued on the op's stream and the op
// returns, the check's findings in the `report` output (TfTtemb>CheckTTRowsReport
// raises from it), so the rows' consumers never wait for a round trip to the host.
// A bad id's row is computed from an id in range instead (the kernels' SafeId): no
// read is ever out of bounds.
template <typename T>
struct TTRowsLaunch<GpuDevice, T> {
  static constexpr int64_t kReportWords = kTTReportWords;

  static Status Run(OpKernelContext* ctx, const TTShape& shape, const TTRowsArgs& a) {
    using CT = typename CudaTypeOf<T>::type;
    const int64_t num_ids = a.num_ids;
    if (num_ids == 0) return OkStatus();

    cudaStream_t stream = nullptr;
    TF_RETURN_IF_ERROR(OpCudaStream(ctx, &stream));
    const launchers::TTProblem problem = MakeTTProblem(shape);
    const CT* core_ptrs[kMaxTTCores] = {};
    for (int k = 0; k < shape.num_cores; ++k) {
      core_ptrs[k] = DevicePtr<T>(a.cores[k]);
    }
    // TensorFlow's GPU allocator orders a temporary's reuse after the work queued on
    // the op's stream, so it may go back once queued.
    const size_t scratch_bytes = launchers::RowsScratchBytes<CT>(problem, num_ids);
    Tensor scratch_tensor;
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(
        AllocateDeviceScratch(ctx, std::max<size_t>(1, scratch_bytes), &scratch_tensor, &scratch));
    auto* report = reinterpret_cast<TTReport*>(a.report->flat<int64_t>().data());
    return CudaStatus(
        launchers::LaunchRows<CT>(problem, a.ids->flat<int64_t>().data(), num_ids,
                                  /*num_ids=*/nullptr, core_ptrs, DevicePtr<T>(a.rows), report,
                                  scratch, scratch_bytes, stream),
        "TTRows launch");
  }
};

// TfTtemb>CheckTTRowsReport on the GPU: finishes from the EventMgr once the stream has
// run TTRows (CheckReportGpuOp, check_report_op.h).
REGISTER_KERNEL_BUILDER(Name("TfTtemb>CheckTTRowsReport").Device(DEVICE_GPU),
                        CheckReportGpuOp<TTRowsReportTraits>);

// ---------------------------------------------------------------------------
// TTRowsGrad

// The cores' gradient sizes (the distinct prefixes n_k) are known only on the
// device: the index part is queued, and once the stream has run it the
// report's check (on the EventMgr thread) allocates the outputs and queues the
// float part (RowsGradCompute), as TensorFlow core's GPU Unique sizes its
// output.
template <typename T>
struct TTRowsGradLaunch<GpuDevice, T> {
  using Call = TTGpuCall;

  static Status Run(OpKernelContext* ctx, const TTShape& shape, const TTRowsGradArgs& a,
                    const GpuStep<TTGpuCall>& step) {
    using CT = typename CudaTypeOf<T>::type;
    const int num_cores = shape.num_cores;
    const int64_t num_ids = a.num_ids;
    if (num_ids == 0) {
      TF_RETURN_IF_ERROR(ValidateRowsGradShape(*a.grad, num_ids, shape));
      OpOutputList indices_out, values_out;
      TF_RETURN_IF_ERROR(ctx->output_list("core_grad_indices", &indices_out));
      TF_RETURN_IF_ERROR(ctx->output_list("core_grad_values", &values_out));
      for (int k = 0; k < num_cores; ++k) {
        Tensor* unused = nullptr;
        TF_RETURN_IF_ERROR(indices_out.allocate(k, TensorShape({0}), &unused));
        TF_RETURN_IF_ERROR(values_out.allocate(k, TensorShape({0, shape.width[k]}), &unused));
      }
      return OkStatus();
    }

    TTGpuCall* call = step.call;
    TF_RETURN_IF_ERROR(call->Init(ctx, /*with_report=*/true));
    // The index part now; the float work part once the report is back, sized
    // for these ids (the distinct prefixes), not for num_ids arbitrary ids.
    const launchers::TTProblem problem = MakeTTProblem(shape);
    const size_t scratch_bytes = launchers::RowsGradPrepareScratchBytes<CT>(problem, num_ids);
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(call->AllocateScratch(scratch_bytes, &scratch));
    TF_RETURN_IF_ERROR(CudaStatus(
        launchers::LaunchRowsGradPrepare<CT>(problem, a.ids->flat<int64_t>().data(), num_ids,
                                             /*num_ids=*/nullptr, call->device_report(), scratch,
                                             scratch_bytes, call->stream()),
        "TTRowsGrad prepare"));
    *step.check = [ctx, shape = &shape, a, call, scratch, scratch_bytes](const TTReport& report) {
      return RowsGradCompute<T>(ctx, *shape, a, call, scratch, scratch_bytes, report);
    };
    return OkStatus();
  }
};

// ---------------------------------------------------------------------------
// TTCacheCount: queued under the variables' locks (held by the op), nothing
// read back.

template <>
struct CacheCountLaunch<GpuDevice> {
  using Call = TTGpuCall;

  static Status Run(OpKernelContext* ctx, const CacheCountArgs& a, const GpuStep<TTGpuCall>& step) {
    const int64_t n = a.ids->NumElements();
    if (n == 0) return OkStatus();
    TF_RETURN_IF_ERROR(GpuIdsLimit("TTCacheCount", "ids", n));
    TTGpuCall* call = step.call;
    TF_RETURN_IF_ERROR(call->Init(ctx, /*with_report=*/false));
    TF_RETURN_IF_ERROR(EnsureExclusiveOnGpu(ctx, call->stream(), a.keys));
    TF_RETURN_IF_ERROR(EnsureExclusiveOnGpu(ctx, call->stream(), a.counts));
    // No bound on the ids is known here: the launcher sorts all 64 bits.
    constexpr int64_t kIdBound = 0;
    const size_t scratch_bytes = launchers::CacheCountScratchBytes(n, a.size, kIdBound);
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(call->AllocateScratch(scratch_bytes, &scratch));
    return CudaStatus(launchers::LaunchCacheCount(a.ids->flat<int64_t>().data(), n, kIdBound,
                                                  a.keys->tensor()->flat<int64_t>().data(),
                                                  a.counts->tensor()->flat<int64_t>().data(),
                                                  a.size, scratch, scratch_bytes, call->stream()),
                      "TTCacheCount launch");
  }
};

namespace {

// ---------------------------------------------------------------------------
// Registration: the dtypes of the CPU kernels. table_splits is read on the
// host; resource handles live in host memory.

#define TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU(Tindex)                \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTUniqueIds")              \
                              .Device(DEVICE_GPU)                  \
                              .HostMemory("table_splits")          \
                              .TypeConstraint<Tindex>("Tindices"), \
                          TTUniqueIdsOp<GpuDevice, Tindex>);
TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU(int32_t)
TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU(int64_t)
#undef TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU

TF_TTEMB_REGISTER_TT_ROWS(DEVICE_GPU, GpuDevice)

REGISTER_KERNEL_BUILDER(
    Name("TfTtemb>TTCacheCount").Device(DEVICE_GPU).HostMemory("keys").HostMemory("counts"),
    TTCacheCountOp<GpuDevice>);

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // GOOGLE_CUDA
