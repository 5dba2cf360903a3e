// GPU OpKernels of the TT embedding family: TensorFlow glue around the CUDA
// launchers of cuda/tt_embedding_kernels.cuh (TTUniqueIds, TTRows,
// TTRowsGrad) and cuda/tt_update_kernels.cuh (TTCacheCount).
//
// Every kernel
//   * checks shapes and host-resident inputs (table_splits) on the host with
//     the validation shared with the CPU kernels (tt_embedding_kernels.h):
//     same checks, same messages, in the same order;
//   * runs the launchers on the op's CUDA stream, with scratch from
//     allocate_temp sized by the launchers' size queries;
//   * for the ops that read ids, copies the launchers' TTReport (16 int64
//     words) into pinned host memory and raises the CPU kernel's
//     InvalidArgument for the first bad id the device found. These ops are
//     AsyncOpKernels: they queue their work and finish from the device's
//     EventMgr thread once the stream has run it (LaunchThenCheck), so no
//     TensorFlow thread waits on the GPU.
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
//     [n_k, width_k] and Compute's float work buffer, sized by the same
//     report for these ids (not the upper bound for any num_ids ids: 0.6
//     instead of 8.2 GB in all at FBTT's shape and 1.24M ids), and queues
//     LaunchRowsGradCompute (Prepare's scratch, untouched in between).
// TTRows' output [U, D] has a static size: its check only checks the ids.
// TTCacheCount reads nothing back: it queues the update under the variables'
// locks, as TensorFlow's own GPU variable updates do; later readers of the
// variables run on the same stream, after it.
//
// `saved` on GPU: TTRows returns an empty `saved` (the contract allows it)
// and TTRowsGrad recomputes the partial products it needs, so it does not
// read `saved`: a saved tensor from a CPU TTRows gives the same gradient.
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

#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/gpu_kernel_util.h"
#include "cc/kernels/shape_util.h"
#include "cc/kernels/tt_embedding_kernels.h"
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

// The launchers sort and scan with int32 positions.
constexpr int64_t kMaxGpuIds = (int64_t{1} << 31) - 3;

Status GpuIdsLimit(const char* op, const char* what, int64_t count) {
  if (count > kMaxGpuIds) {
    return errors::InvalidArgument("the GPU kernel of ", op, " supports at most ", kMaxGpuIds, " ",
                                   what, ", got ", count);
  }
  return OkStatus();
}

// The factorisation in the launchers' form, with the GPU kernels' own limits
// (checked once, in the kernel constructor).
Status MakeTTProblem(const TTShape& s, launchers::TTProblem* p) {
  if (s.num_cores > launchers::kMaxTTCores) {
    return errors::InvalidArgument("the GPU TT kernels support at most ", launchers::kMaxTTCores,
                                   " cores, got num_cores = ", s.num_cores);
  }
  if (s.dim > (int64_t{1} << 31)) {
    return errors::InvalidArgument(
        "the GPU TT kernels support rows of at most 2^31 columns, got "
        "prod(q_shapes) = ",
        s.dim);
  }
  p->num_cores = s.num_cores;
  p->num_tables = s.num_tables;
  for (int k = 0; k < s.num_cores; ++k) {
    p->p[k] = s.p[k];
    p->q[k] = s.q[k];
  }
  for (int k = 0; k <= s.num_cores; ++k) p->r[k] = s.r[k];
  return OkStatus();
}

// The op's CUDA stream, the launchers' report in device memory and its pinned
// host copy, and the call's scratch, for one op call. The call lives until the
// op finishes from the stream (ThenCheckReport), when everything queued that
// reads its host memory has run.
class TTGpuCall {
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

  Status Init(OpKernelContext* ctx, bool with_report) {
    ctx_ = ctx;
    const DeviceContext* device_context = ctx->op_device_context();
    if (device_context == nullptr || device_context->stream() == nullptr) {
      return errors::Internal("tf_ttemb: the op has no GPU stream");
    }
    stream_ =
        static_cast<cudaStream_t>(device_context->stream()->platform_specific_handle().stream);
    if (stream_ == nullptr) {
      return errors::Internal("tf_ttemb: the op's stream has no CUDA handle");
    }
    if (!with_report) return OkStatus();
    const TensorShape report_shape({kReportWords});
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, report_shape, &device_report_));
    return ctx->allocate_temp(DT_INT64, report_shape, &host_report_, PinnedHost());
  }

  cudaStream_t stream() const { return stream_; }

  launchers::TTReport* device_report() {
    return reinterpret_cast<launchers::TTReport*>(device_report_.flat<int64_t>().data());
  }

  // Device scratch of at least `bytes` bytes (the launchers align it).
  Status AllocateScratch(size_t bytes, void** scratch) {
    return Allocate(bytes, &scratch_, scratch);
  }

  // A second device scratch (TTRowsGrad's work part), alive as long as this
  // call, like the first.
  Status AllocateWork(size_t bytes, void** work) { return Allocate(bytes, &work_, work); }

  // Copies a host int64 tensor to a new device temporary, through pinned
  // memory (the copy is asynchronous; the staging buffer lives as long as
  // this call, which lasts until the stream has run the copy).
  Status CopyToDevice(const Tensor& host, Tensor* device) {
    const int64_t n = host.NumElements();
    TF_RETURN_IF_ERROR(ctx_->allocate_temp(DT_INT64, TensorShape({n}), &staging_, PinnedHost()));
    TF_RETURN_IF_ERROR(ctx_->allocate_temp(DT_INT64, TensorShape({n}), device));
    if (n == 0) return OkStatus();
    std::memcpy(staging_.flat<int64_t>().data(), host.flat<int64_t>().data(), n * sizeof(int64_t));
    copy_pending_ = true;
    return CudaStatus(
        cudaMemcpyAsync(device->flat<int64_t>().data(), staging_.flat<int64_t>().data(),
                        n * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
        "copy to the device");
  }

  // Reads the report back without waiting (tf_ttemb::ThenCheckReport): the
  // op's status is `check`'s and `done` is called once the stream has run what is queued;
  // the call (report, scratch, staging) lives until then.
  using ReportCheck = std::function<Status(const launchers::TTReport&)>;
  static void ThenCheckReport(std::shared_ptr<TTGpuCall> call, ReportCheck check,
                              AsyncOpKernel::DoneCallback done) {
    OpKernelContext* ctx = call->ctx_;
    const cudaStream_t stream = call->stream_;
    const Tensor host = call->host_report_;
    const launchers::TTReport* report = call->device_report();
    TTGpuCall* raw = call.get();
    ::tensorflow::tf_ttemb::ThenCheckReport<launchers::TTReport>(
        ctx, stream, host, report, std::move(call),
        [raw, check = std::move(check)](const launchers::TTReport& r) {
          raw->copy_pending_ = false;  // the stream has run the copies
          return check(r);
        },
        std::move(done));
  }

 private:
  Status Allocate(size_t bytes, Tensor* tensor, void** ptr) {
    if (bytes > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
      return errors::ResourceExhausted("tf_ttemb: scratch of ", bytes, " bytes is too large");
    }
    TF_RETURN_IF_ERROR(
        ctx_->allocate_temp(DT_INT8, TensorShape({std::max<int64_t>(1, bytes)}), tensor));
    *ptr = tensor->flat<int8>().data();
    return OkStatus();
  }

  static AllocatorAttributes PinnedHost() {
    AllocatorAttributes pinned;
    pinned.set_on_host(true);
    pinned.set_gpu_compatible(true);
    return pinned;
  }

  static_assert(sizeof(launchers::TTReport) % sizeof(int64_t) == 0,
                "TTReport must be a whole number of int64 words");
  static constexpr int64_t kReportWords = sizeof(launchers::TTReport) / sizeof(int64_t);

  OpKernelContext* ctx_ = nullptr;
  cudaStream_t stream_ = nullptr;
  Tensor device_report_;
  Tensor host_report_;
  Tensor scratch_;
  Tensor work_;
  Tensor staging_;
  bool copy_pending_ = false;
};

// The CPU kernels' error for a bad global id of TTRows / TTRowsGrad.
Status GlobalIdsReportStatus(const launchers::TTReport& r, const TTShape& shape) {
  if (r.first_bad_index >= 0) {
    return GlobalIdError(r.first_bad_index, r.bad_index_value, shape.num_ids());
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------
// TTUniqueIds

// U is known only on the device: the launch is queued, and once the stream
// has run it the report's check (on the EventMgr thread) sets the output to
// the first U ids, as TensorFlow core's GPU Unique does.
template <typename Tindex>
class TTUniqueIdsGpuOp : public LaunchThenCheckOp<TTGpuCall, TTUniqueIdsGpuOp<Tindex>> {
 public:
  explicit TTUniqueIdsGpuOp(OpKernelConstruction* ctx)
      : LaunchThenCheckOp<TTGpuCall, TTUniqueIdsGpuOp<Tindex>>(ctx) {
    OP_REQUIRES_OK(ctx, GetUniqueIdsAttrs(ctx, &attrs_));
  }

  Status Launch(OpKernelContext* ctx, TTGpuCall* call, TTGpuCall::ReportCheck* check) {
    const Tensor& ids = ctx->input(0);
    const Tensor& splits = ctx->input(1);  // host memory
    TF_RETURN_IF_ERROR(ValidateUniqueIdsInputs(ids, splits, attrs_));
    const int64_t nnz = ids.NumElements();
    const int64_t num_tables = splits.NumElements() - 1;
    TF_RETURN_IF_ERROR(GpuIdsLimit("TTUniqueIds", "ids", nnz));
    // The launcher's bound on global ids (the CPU check allows 2^62 itself).
    if (attrs_.stride > ((int64_t{1} << 62) - 1) / num_tables) {
      return errors::InvalidArgument("num_tables * stride is too large for the GPU kernel: ",
                                     num_tables, " * ", attrs_.stride, " >= 2^62");
    }
    Tensor* slots = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, ids.shape(), &slots));
    if (nnz == 0) {
      Tensor* unique = nullptr;
      return ctx->allocate_output(0, TensorShape({0}), &unique);
    }

    TF_RETURN_IF_ERROR(call->Init(ctx, /*with_report=*/true));
    Tensor device_splits;
    TF_RETURN_IF_ERROR(call->CopyToDevice(splits, &device_splits));
    // Upper bound of the output; its first U entries become the output.
    Tensor unique_buffer;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({nnz}), &unique_buffer));
    launchers::UniqueIdsProblem p;
    p.nnz = nnz;
    p.num_tables = num_tables;
    p.num_embeddings = attrs_.num_embeddings;
    p.stride = attrs_.stride;
    p.has_padding_id = attrs_.bag.has_padding_id;
    p.padding_id = attrs_.bag.padding_id;
    const size_t scratch_bytes = launchers::UniqueIdsScratchBytes<Tindex>(p);
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(call->AllocateScratch(scratch_bytes, &scratch));
    TF_RETURN_IF_ERROR(
        CudaStatus(launchers::LaunchUniqueIds<Tindex>(
                       p, ids.flat<Tindex>().data(), device_splits.flat<int64_t>().data(),
                       unique_buffer.flat<int64_t>().data(), slots->flat<Tindex>().data(),
                       call->device_report(), scratch, scratch_bytes, call->stream()),
                   "TTUniqueIds launch"));
    *check = [this, ctx, nnz, unique_buffer](const launchers::TTReport& report) -> Status {
      if (report.first_bad_index >= 0) {
        return BadIndexError(report.first_bad_index, report.bad_index_value, attrs_.num_embeddings,
                             attrs_.bag);
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

 private:
  UniqueIdsAttrs attrs_;
};

// ---------------------------------------------------------------------------
// TTRows

// Host checks shared by TTRows and TTRowsGrad: the cores' shapes, then the
// ids' shape and count, in the CPU kernels' order.
Status ValidateRowsInputs(OpKernelContext* ctx, const TTShape& shape, const char* op,
                          OpInputList* cores) {
  TF_RETURN_IF_ERROR(ctx->input_list("cores", cores));
  for (int k = 0; k < shape.num_cores; ++k) {
    TF_RETURN_IF_ERROR(ValidateCore((*cores)[k], k, shape));
  }
  const Tensor& ids = ctx->input(0);
  TF_RETURN_IF_ERROR(ValidateGlobalIdsShape(ids));
  return GpuIdsLimit(op, "ids", ids.NumElements());
}

// Asynchronous (the output's shape is known on the host): the op finishes
// from the stream when the report has come back (TTGpuCall::ThenCheckReport).
template <typename T>
class TTRowsGpuOp : public LaunchThenCheckOp<TTGpuCall, TTRowsGpuOp<T>> {
 public:
  using CT = typename CudaTypeOf<T>::type;

  explicit TTRowsGpuOp(OpKernelConstruction* ctx)
      : LaunchThenCheckOp<TTGpuCall, TTRowsGpuOp<T>>(ctx) {
    OP_REQUIRES_OK(ctx, GetTTShape(ctx, &shape_));
    OP_REQUIRES_OK(ctx, MakeTTProblem(shape_, &problem_));
  }

  Status Launch(OpKernelContext* ctx, TTGpuCall* call_ptr, TTGpuCall::ReportCheck* check) {
    TTGpuCall& call = *call_ptr;
    OpInputList cores;
    TF_RETURN_IF_ERROR(ValidateRowsInputs(ctx, shape_, "TTRows", &cores));
    const Tensor& ids = ctx->input(0);
    const int64_t num_ids = ids.NumElements();
    Tensor* rows = nullptr;
    TensorShape rows_shape;
    TF_RETURN_IF_ERROR(
        MatrixShape("rows [num_ids, prod(q_shapes)]", num_ids, shape_.dim, &rows_shape));
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, rows_shape, &rows));
    Tensor* saved = nullptr;  // never produced on GPU (see the top comment)
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({0}), &saved));
    if (num_ids == 0) return OkStatus();

    TF_RETURN_IF_ERROR(call.Init(ctx, /*with_report=*/true));
    const CT* core_ptrs[launchers::kMaxTTCores] = {};
    for (int k = 0; k < shape_.num_cores; ++k) {
      core_ptrs[k] = DevicePtr<T>(cores[k]);
    }
    const size_t scratch_bytes = launchers::RowsScratchBytes<CT>(problem_, num_ids);
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(call.AllocateScratch(scratch_bytes, &scratch));
    TF_RETURN_IF_ERROR(CudaStatus(
        launchers::LaunchRows<CT>(problem_, ids.flat<int64_t>().data(), num_ids,
                                  /*num_ids=*/nullptr, core_ptrs, DevicePtr<T>(rows),
                                  call.device_report(), scratch, scratch_bytes, call.stream()),
        "TTRows launch"));
    *check = [this](const launchers::TTReport& report) {
      return GlobalIdsReportStatus(report, shape_);
    };
    return OkStatus();
  }

 private:
  TTShape shape_;
  launchers::TTProblem problem_;
};

// ---------------------------------------------------------------------------
// TTRowsGrad

// The cores' gradient sizes (the distinct prefixes n_k) are known only on the
// device: the index part is queued, and once the stream has run it the
// report's check (on the EventMgr thread) allocates the outputs and queues the
// float part, as TensorFlow core's GPU Unique sizes its output.
template <typename T>
class TTRowsGradGpuOp : public LaunchThenCheckOp<TTGpuCall, TTRowsGradGpuOp<T>> {
 public:
  using CT = typename CudaTypeOf<T>::type;

  explicit TTRowsGradGpuOp(OpKernelConstruction* ctx)
      : LaunchThenCheckOp<TTGpuCall, TTRowsGradGpuOp<T>>(ctx) {
    OP_REQUIRES_OK(ctx, GetTTShape(ctx, &shape_));
    OP_REQUIRES_OK(ctx, MakeTTProblem(shape_, &problem_));
  }

  Status Launch(OpKernelContext* ctx, TTGpuCall* call, TTGpuCall::ReportCheck* check) {
    const int num_cores = shape_.num_cores;
    OpInputList cores;
    TF_RETURN_IF_ERROR(ValidateRowsInputs(ctx, shape_, "TTRowsGrad", &cores));
    const Tensor& ids = ctx->input(0);
    const Tensor& grad = ctx->input(1 + num_cores);
    const int64_t num_ids = ids.NumElements();
    // Input 2 + num_cores (`saved`) is not read: see the top comment.
    if (num_ids == 0) {
      TF_RETURN_IF_ERROR(ValidateRowsGradShape(grad, num_ids, shape_));
      OpOutputList indices_out, values_out;
      TF_RETURN_IF_ERROR(ctx->output_list("core_grad_indices", &indices_out));
      TF_RETURN_IF_ERROR(ctx->output_list("core_grad_values", &values_out));
      for (int k = 0; k < num_cores; ++k) {
        Tensor* unused = nullptr;
        TF_RETURN_IF_ERROR(indices_out.allocate(k, TensorShape({0}), &unused));
        TF_RETURN_IF_ERROR(values_out.allocate(k, TensorShape({0, shape_.width[k]}), &unused));
      }
      return OkStatus();
    }

    TF_RETURN_IF_ERROR(call->Init(ctx, /*with_report=*/true));
    // The index part now; the float work part once the report is back, sized
    // for these ids (the distinct prefixes), not for num_ids arbitrary ids.
    const size_t scratch_bytes = launchers::RowsGradPrepareScratchBytes<CT>(problem_, num_ids);
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(call->AllocateScratch(scratch_bytes, &scratch));
    TF_RETURN_IF_ERROR(CudaStatus(
        launchers::LaunchRowsGradPrepare<CT>(problem_, ids.flat<int64_t>().data(), num_ids,
                                             /*num_ids=*/nullptr, call->device_report(), scratch,
                                             scratch_bytes, call->stream()),
        "TTRowsGrad prepare"));
    *check = [this, ctx, call, num_ids, scratch, scratch_bytes](const launchers::TTReport& report) {
      return Compute(ctx, call, num_ids, scratch, scratch_bytes, report);
    };
    return OkStatus();
  }

 private:
  // The second step, with the report of the first.
  Status Compute(OpKernelContext* ctx, TTGpuCall* call, int64_t num_ids, void* scratch,
                 size_t scratch_bytes, const launchers::TTReport& report) {
    const int num_cores = shape_.num_cores;
    TF_RETURN_IF_ERROR(GlobalIdsReportStatus(report, shape_));
    const Tensor& grad = ctx->input(1 + num_cores);
    // Checked after the ids, as the CPU kernel does (prepare does not read
    // grad).
    TF_RETURN_IF_ERROR(ValidateRowsGradShape(grad, num_ids, shape_));
    OpInputList cores;
    TF_RETURN_IF_ERROR(ctx->input_list("cores", &cores));
    OpOutputList indices_out, values_out;
    TF_RETURN_IF_ERROR(ctx->output_list("core_grad_indices", &indices_out));
    TF_RETURN_IF_ERROR(ctx->output_list("core_grad_values", &values_out));
    const CT* core_ptrs[launchers::kMaxTTCores] = {};
    int64_t* index_ptrs[launchers::kMaxTTCores] = {};
    CT* value_ptrs[launchers::kMaxTTCores] = {};
    for (int k = 0; k < num_cores; ++k) {
      const int64_t count = report.core_rows[k];
      const int64_t core_rows = shape_.num_tables * shape_.p[k];
      if (count < 0 || count > std::min(num_ids, core_rows)) {
        return errors::Internal("tf_ttemb GPU TTRowsGrad: the device found ", count,
                                " rows of core ", k, " touched by ", num_ids, " ids");
      }
      Tensor* indices = nullptr;
      Tensor* values = nullptr;
      TF_RETURN_IF_ERROR(indices_out.allocate(k, TensorShape({count}), &indices));
      TF_RETURN_IF_ERROR(values_out.allocate(k, TensorShape({count, shape_.width[k]}), &values));
      core_ptrs[k] = DevicePtr<T>(cores[k]);
      // Null where n_k == 0, which the launcher allows.
      index_ptrs[k] = count > 0 ? indices->flat<int64_t>().data() : nullptr;
      value_ptrs[k] = values->NumElements() > 0 ? DevicePtr<T>(values) : nullptr;
    }
    const size_t work_bytes = launchers::RowsGradWorkBytes<CT>(problem_, num_ids, &report);
    void* work = nullptr;
    TF_RETURN_IF_ERROR(call->AllocateWork(work_bytes, &work));
    // Queued after the outputs exist; the stream orders it before any reader.
    // The scratch is the prepare launch's, untouched since.
    return CudaStatus(launchers::LaunchRowsGradCompute<CT>(
                          problem_, ctx->input(0).flat<int64_t>().data(), num_ids,
                          /*num_ids=*/nullptr, core_ptrs, DevicePtr<T>(grad), index_ptrs,
                          value_ptrs, /*core_dense=*/nullptr, scratch, scratch_bytes, &report, work,
                          work_bytes, call->stream()),
                      "TTRowsGrad compute");
  }

  TTShape shape_;
  launchers::TTProblem problem_;
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

class TTCacheCountGpuOp : public OpKernel {
 public:
  explicit TTCacheCountGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(2);
    OP_REQUIRES_OK(ctx, ValidateCacheCountIds(ids));
    core::RefCountPtr<Var> keys_var, counts_var;
    OP_REQUIRES_OK(ctx, LookupCacheTables(ctx, &keys_var, &counts_var));
    mutex_lock keys_lock(*keys_var->mu());
    mutex_lock counts_lock(*counts_var->mu());
    OP_REQUIRES_OK(ctx, ValidateCacheTableSizes(keys_var.get(), counts_var.get()));
    const int64_t size = keys_var->tensor()->NumElements();
    const int64_t n = ids.NumElements();
    if (size == 0 || n == 0) return;
    OP_REQUIRES_OK(ctx, GpuIdsLimit("TTCacheCount", "ids", n));

    TTGpuCall call;
    OP_REQUIRES_OK(ctx, call.Init(ctx, /*with_report=*/false));
    OP_REQUIRES_OK(ctx, EnsureExclusiveOnGpu(ctx, call.stream(), keys_var.get()));
    OP_REQUIRES_OK(ctx, EnsureExclusiveOnGpu(ctx, call.stream(), counts_var.get()));
    // No bound on the ids is known here: the launcher sorts all 64 bits.
    constexpr int64_t kIdBound = 0;
    const size_t scratch_bytes = launchers::CacheCountScratchBytes(n, size, kIdBound);
    void* scratch = nullptr;
    OP_REQUIRES_OK(ctx, call.AllocateScratch(scratch_bytes, &scratch));
    OP_REQUIRES_OK(
        ctx, CudaStatus(launchers::LaunchCacheCount(ids.flat<int64_t>().data(), n, kIdBound,
                                                    keys_var->tensor()->flat<int64_t>().data(),
                                                    counts_var->tensor()->flat<int64_t>().data(),
                                                    size, scratch, scratch_bytes, call.stream()),
                        "TTCacheCount launch"));
  }
};

// ---------------------------------------------------------------------------
// Registration: the dtypes of the CPU kernels. table_splits is read on the
// host; resource handles live in host memory.

#define TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU(Tindex)                \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTUniqueIds")              \
                              .Device(DEVICE_GPU)                  \
                              .HostMemory("table_splits")          \
                              .TypeConstraint<Tindex>("Tindices"), \
                          TTUniqueIdsGpuOp<Tindex>);
TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU(int32_t)
TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU(int64_t)
#undef TF_TTEMB_REGISTER_TT_UNIQUE_IDS_GPU

#define TF_TTEMB_REGISTER_TT_ROWS_GPU(T)                                                        \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTRows").Device(DEVICE_GPU).TypeConstraint<T>("T"),     \
                          TTRowsGpuOp<T>);                                                      \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTRowsGrad").Device(DEVICE_GPU).TypeConstraint<T>("T"), \
                          TTRowsGradGpuOp<T>);
TF_TTEMB_REGISTER_TT_ROWS_GPU(Eigen::half)
TF_TTEMB_REGISTER_TT_ROWS_GPU(bfloat16)
TF_TTEMB_REGISTER_TT_ROWS_GPU(float)
TF_TTEMB_REGISTER_TT_ROWS_GPU(double)
#undef TF_TTEMB_REGISTER_TT_ROWS_GPU

REGISTER_KERNEL_BUILDER(
    Name("TfTtemb>TTCacheCount").Device(DEVICE_GPU).HostMemory("keys").HostMemory("counts"),
    TTCacheCountGpuOp);

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // GOOGLE_CUDA
