// GPU OpKernels of the gather_reduce_sum family: TensorFlow glue around the
// CUDA launchers of cuda/gather_reduce_sum_kernels.cuh. The OpKernels are the
// ones written once for both devices (gather_reduce_sum_{forward,backward,
// sparse_apply}_op.h); this file specialises their Launch functors for
// GpuDevice and registers them, and holds CheckBagReport's GPU kernel.
//
// Every op checks shapes on the host with the validation shared with the CPU
// kernels (same messages) and its Launch runs the launchers on the op's CUDA
// stream, with scratch from allocate_temp sized by the launchers' size
// queries. What the device finds wrong in the ids and row_splits goes to a
// DeviceReport (cuda/common_types.h) that becomes the CPU kernel's
// InvalidArgument (ReportStatus):
//   * the forward (ForwardLaunch<GpuDevice>) is synchronous and never waits:
//     its report is an output, raised from by CheckBagReport, which the Python
//     wrapper adds beside it, so the output's consumers do not wait for it;
//   * the others are AsyncOpKernels (DeviceOpKernel<GpuDevice>) that copy
//     their report to pinned host memory and finish from the device's EventMgr
//     thread once the stream has run their work (LaunchThenCheck): no
//     TensorFlow thread waits on the GPU. The deduplicated params gradients
//     and the sparse apply's row-wise Adagrad on wide rows size their outputs
//     or temporaries ([U], [U, D]) there and queue their second step, as
//     TensorFlow core's GPU Unique does.
//
// The sparse apply reduces and updates the rows in one launcher
// (LaunchParamsGradApply), or for row-wise Adagrad on wide rows reduces into
// a [U, D] temporary and then runs LaunchApplyRows
// (cuda/gather_reduce_sum_update_kernels.cuh). The suite runs these kernels
// through TensorFlow on an H200 (../shared/tf_gpu/; BENCHMARKS.md).

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
#include "cc/kernels/gather_reduce_sum_backward_op.h"
#include "cc/kernels/gather_reduce_sum_forward_op.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/gather_reduce_sum_sparse_apply_op.h"
#include "cc/kernels/gpu_kernel_util.h"
#include "cuda/gather_reduce_sum_kernels.cuh"
#include "cuda/gather_reduce_sum_update_kernels.cuh"
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

// `data` for an output with elements, else a non-null placeholder: the
// params-grad launcher tells the output form from which pointers are set and
// writes nothing to an empty output.
template <typename P>
P* NonEmptyOr(P* data, int64_t num_elements, void* placeholder) {
  return num_elements > 0 ? data : static_cast<P*>(placeholder);
}

launchers::BagProblem MakeProblem(const BagAttrs& attrs, const BagShapes& shapes, int64_t num_rows,
                                  int64_t dim) {
  launchers::BagProblem p;
  static_cast<BagAttrs&>(p) = attrs;
  p.num_rows = num_rows;
  p.dim = dim;
  p.num_bags = shapes.num_bags;
  p.nnz = shapes.nnz;
  return p;
}

// The op's CUDA stream, the launchers' DeviceReport in device memory and its pinned
// host copy, and the call's scratch, for one Compute call (ReportCall).
class GpuCall : public ReportCall<DeviceReport> {
 public:
  // Init, and the scratch every launch of the call takes: `scratch_bytes` bytes,
  // a launcher's *ScratchBytes query.
  Status Start(OpKernelContext* ctx, size_t scratch_bytes) {
    TF_RETURN_IF_ERROR(Init(ctx));
    scratch_bytes_ = scratch_bytes;
    return AllocateScratch(scratch_bytes, &scratch_ptr_);
  }
  void* scratch() const { return scratch_ptr_; }
  size_t scratch_bytes() const { return scratch_bytes_; }

  // A small device buffer standing in for outputs without elements (see
  // NonEmptyOr); never written.
  Status AllocatePlaceholder(void** placeholder) {
    TF_RETURN_IF_ERROR(ctx_->allocate_temp(DT_INT64, TensorShape({2}), &placeholder_));
    *placeholder = placeholder_.flat<int64_t>().data();
    return OkStatus();
  }

 private:
  void* scratch_ptr_ = nullptr;
  size_t scratch_bytes_ = 0;
  Tensor placeholder_;
};

// The launchers' U (distinct non-padding ids) as read back in the report,
// checked against what it can be.
Status NumUnique(const DeviceReport& report, const BagShapes& shapes, int64_t num_rows,
                 int64_t* num_unique) {
  *num_unique = report.num_unique;
  if (*num_unique < 0 || *num_unique > std::min(shapes.nnz, num_rows)) {
    return errors::Internal("tf_ttemb GPU params grad: the device found ", *num_unique,
                            " unique ids among ", shapes.nnz, " indices");
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------
// Forward (GatherReduceSum, ResourceGatherReduceSum).

}  // namespace

// The GPU forward: queues the id and row_splits checks and the forward on the
// op's stream and returns without waiting; the findings go to the `report`
// output, which CheckBagReport (below) raises from, off the path of the
// output's consumers. Bad ids are skipped, never read.
template <typename T, typename Tindex>
struct ForwardLaunch<GpuDevice, T, Tindex> {
  static constexpr int64_t kReportWords = kDeviceReportWords;

  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const ForwardArgs& a) {
    using CT = typename CudaTypeOf<T>::type;
    const bool is_max = attrs.combiner == Combiner::kMax;
    // argmax holds int32 positions inside a bag; the CPU kernel checks each
    // bag's length, which the GPU kernel cannot see on the host.
    if (is_max && a.shapes.nnz > std::numeric_limits<int32>::max()) {
      return errors::InvalidArgument(
          "combiner 'max' on GPU supports at most 2^31 - 1 indices, got ", a.shapes.nnz);
    }
    cudaStream_t stream = nullptr;
    TF_RETURN_IF_ERROR(OpCudaStream(ctx, &stream));
    const launchers::BagProblem p = MakeProblem(attrs, a.shapes, a.num_rows, a.dim);
    const size_t scratch_bytes = launchers::ForwardScratchBytes<CT>(p);
    // Freed on return: TensorFlow's allocator orders its reuse after the queued work.
    Tensor scratch_tensor;
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(AllocateDeviceScratch(ctx, scratch_bytes, &scratch_tensor, &scratch));
    const CT* weights = attrs.has_weights ? DevicePtr<T>(*a.weights) : nullptr;
    int32* argmax = is_max ? a.argmax->flat<int32>().data() : nullptr;
    auto* report = reinterpret_cast<DeviceReport*>(a.report->flat<int64_t>().data());
    return CudaStatus(launchers::LaunchForward<CT, Tindex>(
                          p, DevicePtr<T>(*a.params), a.indices->flat<Tindex>().data(),
                          a.row_splits->flat<int64_t>().data(), weights, DevicePtr<T>(a.output),
                          argmax, report, scratch, scratch_bytes, stream),
                      "gather_reduce_sum forward launch");
  }
};

namespace {

// TfTtemb>CheckBagReport on the GPU: copies the forward's report to pinned host
// memory and finishes from the EventMgr once the stream has run the forward
// (ThenCheckReport), with the CPU kernel's InvalidArgument for what it holds
// (check_report_op.h).
REGISTER_KERNEL_BUILDER(Name("TfTtemb>CheckBagReport").Device(DEVICE_GPU),
                        CheckReportGpuOp<BagReportTraits>);

// ---------------------------------------------------------------------------
// Gradient w.r.t. params (GatherReduceSumGrad, GatherReduceSumDenseGrad).

// The device pointers of a params gradient's inputs.
template <typename T, typename Tindex>
struct ParamsGradPointers {
  using CT = typename CudaTypeOf<T>::type;
  const CT* grad = nullptr;         // [B, D]
  const Tindex* ids = nullptr;      // [nnz]
  const int64_t* splits = nullptr;  // [B + 1]
  const CT* weights = nullptr;      // [nnz] or null
  const int32* argmax = nullptr;    // [B, D] for max, else null
  bool is_max = false;
  bool argmax_empty = true;

  ParamsGradPointers(const BagAttrs& attrs, const ParamsGradArgs& a)
      : grad(DevicePtr<T>(*a.grad)),
        ids(a.indices->flat<Tindex>().data()),
        splits(a.row_splits->flat<int64_t>().data()),
        weights(attrs.has_weights ? DevicePtr<T>(*a.weights) : nullptr),
        argmax(attrs.combiner == Combiner::kMax ? a.argmax->flat<int32>().data() : nullptr),
        is_max(attrs.combiner == Combiner::kMax),
        argmax_empty(a.argmax->NumElements() == 0) {}

  // The argmax pointer for the reduce launch, which needs a non-null one for
  // max even when argmax has no elements.
  const int32* ArgmaxOr(void* placeholder) const {
    return is_max && argmax_empty ? static_cast<const int32*>(placeholder) : argmax;
  }
};

}  // namespace

// Deduplicated form: unique_indices [U] ascending, values [U, D]. U is known
// only on the device: Prepare is queued, and once the stream has run it the
// report's check (on the EventMgr thread) allocates the outputs at U and
// queues the reduction, as TensorFlow core's GPU Unique sizes its output. No
// TensorFlow thread waits on the stream. Dense form: params_grad [N, D], of a
// size known on the host: both steps are queued at once and the report is
// read once, after both.
template <typename T, typename Tindex>
struct ParamsGradLaunch<GpuDevice, T, Tindex> {
  using Call = GpuCall;

  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const ParamsGradArgs& a,
                    const GpuStep<GpuCall>& step) {
    using CT = typename CudaTypeOf<T>::type;
    GpuCall* call = step.call;
    const ParamsGradPointers<T, Tindex> in(attrs, a);
    const bool dense = a.params_grad != nullptr;
    const launchers::BagProblem p =
        MakeProblem(attrs, a.shapes.bags, a.shapes.num_rows, a.shapes.dim);
    TF_RETURN_IF_ERROR(call->Start(
        ctx, launchers::ParamsGradScratchBytes<CT, Tindex>(p, dense, /*fuse_weights_grad=*/false)));
    // Prepare always runs: it checks the ids and row_splits.
    TF_RETURN_IF_ERROR(CudaStatus(
        launchers::LaunchParamsGradPrepare<CT, Tindex>(
            p, in.ids, in.splits, in.weights, call->device_report(), dense,
            /*fuse_weights_grad=*/false, call->scratch(), call->scratch_bytes(), call->stream()),
        "gather_reduce_sum params grad prepare"));
    if (dense) {
      if (a.params_grad->NumElements() > 0) {
        void* placeholder = nullptr;
        TF_RETURN_IF_ERROR(call->AllocatePlaceholder(&placeholder));
        // Safe whatever the ids hold: the launchers never read out of bounds.
        TF_RETURN_IF_ERROR(
            CudaStatus(launchers::LaunchParamsGradReduce<CT, Tindex>(
                           p, in.grad, in.ArgmaxOr(placeholder), /*unique_ids=*/nullptr,
                           /*values=*/nullptr, DevicePtr<T>(a.params_grad), /*fusion=*/nullptr,
                           call->scratch(), call->scratch_bytes(), call->stream()),
                       "gather_reduce_sum params grad reduce"));
      }
      *step.check = [attrs](const DeviceReport& report) { return ReportStatus(report, attrs); };
      return OkStatus();
    }
    const ParamsGradShapes shapes = a.shapes;
    *step.check = [attrs, ctx, call, in, p, shapes](const DeviceReport& report) -> Status {
      TF_RETURN_IF_ERROR(ReportStatus(report, attrs));
      int64_t num_unique = 0;
      TF_RETURN_IF_ERROR(NumUnique(report, shapes.bags, shapes.num_rows, &num_unique));
      Tensor* unique_ids = nullptr;
      Tensor* values = nullptr;
      TF_RETURN_IF_ERROR(
          AllocateDeduplicatedGrad(ctx, num_unique, shapes.dim, &unique_ids, &values));
      if (num_unique == 0) return OkStatus();
      void* placeholder = nullptr;
      TF_RETURN_IF_ERROR(call->AllocatePlaceholder(&placeholder));
      return CudaStatus(launchers::LaunchParamsGradReduce<CT, Tindex>(
                            p, in.grad, in.ArgmaxOr(placeholder), unique_ids->flat<Tindex>().data(),
                            NonEmptyOr(DevicePtr<T>(values), values->NumElements(), placeholder),
                            /*dense=*/nullptr, /*fusion=*/nullptr, call->scratch(),
                            call->scratch_bytes(), call->stream()),
                        "gather_reduce_sum params grad reduce");
    };
    return OkStatus();
  }
};

// ---------------------------------------------------------------------------
// Gradient w.r.t. the weights (GatherReduceSumWeightsGrad,
// ResourceGatherReduceSumWeightsGrad): one launch, then the report's check.

template <typename T, typename Tindex>
struct WeightsGradLaunch<GpuDevice, T, Tindex> {
  using Call = GpuCall;

  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const WeightsGradArgs& a,
                    const GpuStep<GpuCall>& step) {
    using CT = typename CudaTypeOf<T>::type;
    GpuCall* call = step.call;
    const launchers::BagProblem p = MakeProblem(attrs, a.shapes, a.num_rows, a.dim);
    TF_RETURN_IF_ERROR(call->Start(ctx, launchers::WeightsGradScratchBytes<CT>(p)));
    TF_RETURN_IF_ERROR(CudaStatus(
        launchers::LaunchWeightsGrad<CT, Tindex>(
            p, DevicePtr<T>(*a.grad), DevicePtr<T>(*a.params), a.indices->flat<Tindex>().data(),
            a.row_splits->flat<int64_t>().data(), DevicePtr<T>(*a.weights), DevicePtr<T>(*a.output),
            DevicePtr<T>(a.weights_grad), call->device_report(), call->scratch(),
            call->scratch_bytes(), call->stream()),
        "gather_reduce_sum weights grad launch"));
    *step.check = [attrs](const DeviceReport& report) { return ReportStatus(report, attrs); };
    return OkStatus();
  }
};

// ---------------------------------------------------------------------------
// Fused params + weights gradient (GatherReduceSumFusedGrad,
// ResourceGatherReduceSumFusedGrad): the params-gradient launches with the
// weights gradient fused into the reduction (each table row read once per
// distinct id).
//
// The dense form queues both steps at once; the deduplicated form queues
// Prepare, and the report's check sizes the outputs at U and queues the
// reduction (ParamsGradLaunch's way). A variable's lock is held while work is
// queued; the deduplicated form's reduction, queued later, reads the table
// through a reference that keeps its buffer: a writer in between copies the
// buffer first (TensorFlow's copy-on-write of a shared variable buffer), so
// the reduction sees the rows as Prepare did.

template <typename T, typename Tindex>
struct FusedGradLaunch<GpuDevice, T, Tindex> {
  using Call = GpuCall;

  static Status Run(OpKernelContext* ctx, const BagAttrs& attrs, const FusedGradArgs& a,
                    const GpuStep<GpuCall>& step) {
    using CT = typename CudaTypeOf<T>::type;
    GpuCall* call = step.call;
    const bool dense = a.dense;
    const launchers::BagProblem p = MakeProblem(attrs, a.shapes, a.num_rows, a.dim);
    TF_RETURN_IF_ERROR(call->Start(
        ctx, launchers::ParamsGradScratchBytes<CT, Tindex>(p, dense, /*fuse_weights_grad=*/true)));
    TF_RETURN_IF_ERROR(CudaStatus(
        launchers::LaunchParamsGradPrepare<CT, Tindex>(
            p, a.indices->flat<Tindex>().data(), a.row_splits->flat<int64_t>().data(),
            DevicePtr<T>(*a.weights), call->device_report(), dense,
            /*fuse_weights_grad=*/true, call->scratch(), call->scratch_bytes(), call->stream()),
        "gather_reduce_sum fused grad prepare"));
    // Queues the reduction into outputs 0 (unique ids; [0] when dense) and 1.
    auto reduce = [call, p, dense, grad = DevicePtr<T>(*a.grad), output = DevicePtr<T>(*a.output),
                   weights = DevicePtr<T>(*a.weights), weights_grad = DevicePtr<T>(a.weights_grad),
                   table = *a.params](Tensor* unique_ids, Tensor* params_grad) -> Status {
      const launchers::WeightsGradFusion<CT> fusion{DevicePtr<T>(table), output, weights,
                                                    weights_grad};
      void* placeholder = nullptr;
      TF_RETURN_IF_ERROR(call->AllocatePlaceholder(&placeholder));
      CT* grad_out = NonEmptyOr(DevicePtr<T>(params_grad), params_grad->NumElements(), placeholder);
      Tindex* ids_out = dense ? nullptr
                              : NonEmptyOr(unique_ids->flat<Tindex>().data(),
                                           unique_ids->NumElements(), placeholder);
      // Safe whatever the ids hold: the launchers never read out of bounds.
      return CudaStatus(launchers::LaunchParamsGradReduce<CT, Tindex>(
                            p, grad, /*argmax=*/nullptr, ids_out, dense ? nullptr : grad_out,
                            dense ? grad_out : nullptr, &fusion, call->scratch(),
                            call->scratch_bytes(), call->stream()),
                        "gather_reduce_sum fused grad reduce");
    };
    if (dense) {
      TF_RETURN_IF_ERROR(reduce(a.unique_ids, a.params_grad));
      *step.check = [attrs](const DeviceReport& report) { return ReportStatus(report, attrs); };
      return OkStatus();
    }
    *step.check = [attrs, ctx, shapes = a.shapes, num_rows = a.num_rows, dim = a.dim,
                   reduce = std::move(reduce)](const DeviceReport& report) -> Status {
      TF_RETURN_IF_ERROR(ReportStatus(report, attrs));
      int64_t num_unique = 0;
      TF_RETURN_IF_ERROR(NumUnique(report, shapes, num_rows, &num_unique));
      Tensor* unique_ids = nullptr;
      Tensor* params_grad = nullptr;
      TF_RETURN_IF_ERROR(AllocateDeduplicatedGrad(ctx, num_unique, dim, &unique_ids, &params_grad));
      return reduce(unique_ids, params_grad);
    };
    return OkStatus();
  }
};

namespace {

// ---------------------------------------------------------------------------
// Backward with the optimizer fused in (GatherReduceSumSparseApply): under the
// variables' exclusive locks, Prepare sorts the entries and checks the ids and
// row_splits, and LaunchParamsGradApply reduces each distinct row's gradient
// and updates the row (and its accumulator) in place where the sum is
// complete, with the weights gradient from the rows as they were. On bad ids
// or row_splits Prepare leaves the launches after it no segment to reduce, so
// no row is written, and the report's check raises the CPU kernel's error once
// the stream has run: the op queues its work and returns (an AsyncOpKernel),
// as TensorFlow's own GPU scatter updates do. All run on the op's stream, so
// later readers of the variable see the update.
//
// Row-wise Adagrad on rows wider than one column chunk needs the whole row's
// sum of squares first: its sums go to a [U, D] temporary that LaunchApplyRows
// applies. U is known only on the device, so that form queues Prepare alone;
// the report's check (on the EventMgr thread, no TensorFlow thread waiting)
// takes the variables' locks again, checks the variables anew (another op may
// have replaced them in between; Prepare read neither), sizes the temporary
// at U and queues the reduction and the update under those locks, so that the
// update is ordered with every other writer and reader of the variables as if
// the whole op ran at that moment.

// EnsureExclusiveBuffer's copy for device memory, on the op's stream.
Status EnsureExclusiveDeviceBuffer(OpKernelContext* ctx, Var* var, cudaStream_t stream) {
  return EnsureExclusiveBuffer(ctx, var, [stream](void* dst, const void* src, size_t bytes) {
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                      "copy of a shared variable buffer");
  });
}

// What both forms of the update write and read, with the variables' buffers
// made exclusively owned (under the variables' locks, on the op's stream).
template <typename T>
struct SparseUpdateTarget {
  using CT = typename CudaTypeOf<T>::type;
  using Acc = AccT<T>;
  CT* table = nullptr;                      // [N, D], updated in place
  Acc* state = nullptr;                     // [N] or [N, D], or null for sgd
  launchers::WeightsGradFusion<CT> fusion;  // set with weights
  const int32* argmax = nullptr;            // [B, D] for max, else null
  void* placeholder = nullptr;              // see NonEmptyOr
  launchers::RowUpdate<Acc> update;

  Status Init(OpKernelContext* ctx, const SparseApplyAttrs& attrs, const SparseApplyArgs& a,
              GpuCall* call) {
    TF_RETURN_IF_ERROR(EnsureExclusiveDeviceBuffer(ctx, a.params_var, call->stream()));
    if (a.acc_var != nullptr) {
      TF_RETURN_IF_ERROR(EnsureExclusiveDeviceBuffer(ctx, a.acc_var, call->stream()));
    }
    table = DevicePtr<T>(a.params_var->tensor());
    state = a.acc_var != nullptr ? a.acc_var->tensor()->flat<Acc>().data() : nullptr;
    TF_RETURN_IF_ERROR(call->AllocatePlaceholder(&placeholder));
    const CT* weights = attrs.bag.has_weights ? DevicePtr<T>(*a.weights) : nullptr;
    fusion = {table, DevicePtr<T>(*a.output), weights, DevicePtr<T>(a.weights_grad)};
    if (attrs.bag.combiner == Combiner::kMax) {
      argmax = a.argmax->NumElements() > 0 ? a.argmax->flat<int32>().data()
                                           : static_cast<const int32*>(placeholder);
    }
    update.optimizer = attrs.optimizer;
    update.learning_rate = static_cast<Acc>(a.lr);
    update.epsilon = static_cast<Acc>(a.eps);
    update.num_rows = a.num_rows;
    update.dim = a.dim;
    return OkStatus();
  }

  const launchers::WeightsGradFusion<CT>* Fusion(const SparseApplyAttrs& attrs) const {
    return attrs.bag.has_weights ? &fusion : nullptr;
  }
};

}  // namespace

template <typename T, typename Tindex>
struct SparseApplyLaunch<GpuDevice, T, Tindex> {
  using Call = GpuCall;
  using CT = typename CudaTypeOf<T>::type;
  using Acc = AccT<T>;

  static Status Run(OpKernelContext* ctx, const SparseApplyAttrs& attrs, const SparseApplyArgs& a,
                    const GpuStep<GpuCall>& step) {
    GpuCall* call = step.call;
    const BagAttrs& bag = attrs.bag;
    const bool fuse = bag.has_weights;  // max takes no weights
    const launchers::BagProblem p = MakeProblem(bag, a.shapes, a.num_rows, a.dim);
    TF_RETURN_IF_ERROR(
        call->Start(ctx, launchers::ParamsGradScratchBytes<CT, Tindex>(p, /*dense=*/false, fuse)));
    TF_RETURN_IF_ERROR(CudaStatus(
        launchers::LaunchParamsGradPrepare<CT, Tindex>(
            p, a.indices->flat<Tindex>().data(), a.row_splits->flat<int64_t>().data(),
            fuse ? DevicePtr<T>(*a.weights) : nullptr, call->device_report(),
            /*dense=*/false, fuse, call->scratch(), call->scratch_bytes(), call->stream()),
        "gather_reduce_sum sparse apply prepare"));
    *step.check = [bag](const DeviceReport& report) { return ReportStatus(report, bag); };
    if (a.shapes.nnz == 0) return OkStatus();
    if (a.dim == 0) {
      if (!fuse) return OkStatus();
      return CudaStatus(
          cudaMemsetAsync(a.weights_grad->data(), 0, a.weights_grad->TotalBytes(), call->stream()),
          "zeroing the weights gradient");
    }
    if (launchers::ApplyFusesIntoReduce<CT>(p, attrs.optimizer)) {
      // Each row's sum updates the row where it is reduced: no [U, D] temporary.
      SparseUpdateTarget<T> target;
      TF_RETURN_IF_ERROR(target.Init(ctx, attrs, a, call));
      return CudaStatus(
          launchers::LaunchParamsGradApply<CT, Tindex>(
              p, DevicePtr<T>(*a.grad), target.argmax, target.update, target.table, target.state,
              target.Fusion(attrs), call->scratch(), call->scratch_bytes(), call->stream()),
          "gather_reduce_sum sparse apply");
    }
    *step.check = [ctx, attrs, call, p, shapes = a.shapes,
                   weights_grad = a.weights_grad](const DeviceReport& report) -> Status {
      TF_RETURN_IF_ERROR(ReportStatus(report, attrs.bag));
      int64_t num_unique = 0;
      TF_RETURN_IF_ERROR(NumUnique(report, shapes, p.num_rows, &num_unique));
      return WithLockedSparseApplyVariablesStatus<T, Acc>(
          ctx, attrs, [&](Var* params_var, Var* acc_var) -> Status {
            SparseApplyArgs now;
            TF_RETURN_IF_ERROR(GetSparseApplyArgs<T>(ctx, attrs, params_var, acc_var, &now));
            if (now.num_rows != p.num_rows || now.dim != p.dim) {
              return errors::FailedPrecondition(
                  "the params variable changed shape from [", p.num_rows, ", ", p.dim, "] to [",
                  now.num_rows, ", ", now.dim, "] while GatherReduceSumSparseApply ran on the GPU");
            }
            now.weights_grad = weights_grad;
            return ReduceThenApply(ctx, attrs, now, p, call, num_unique);
          });
    };
    return OkStatus();
  }

 private:
  // Row-wise Adagrad on rows cut into column chunks, under the variables'
  // locks: the sums of the U rows into a [U, D] temporary, then
  // LaunchApplyRows.
  static Status ReduceThenApply(OpKernelContext* ctx, const SparseApplyAttrs& attrs,
                                const SparseApplyArgs& a, const launchers::BagProblem& p,
                                GpuCall* call, int64_t num_unique) {
    SparseUpdateTarget<T> target;
    TF_RETURN_IF_ERROR(target.Init(ctx, attrs, a, call));
    // Freed on return: TensorFlow's allocator orders their reuse after the queued work.
    Tensor unique_ids, values;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(DataTypeToEnum<Tindex>::value, TensorShape({num_unique}), &unique_ids));
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(DataTypeToEnum<T>::value, TensorShape({num_unique, a.dim}), &values));
    Tindex* ids_out = NonEmptyOr(unique_ids.flat<Tindex>().data(), num_unique, target.placeholder);
    CT* values_out = NonEmptyOr(DevicePtr<T>(&values), values.NumElements(), target.placeholder);
    TF_RETURN_IF_ERROR(CudaStatus(launchers::LaunchParamsGradReduce<CT, Tindex>(
                                      p, DevicePtr<T>(*a.grad), target.argmax, ids_out, values_out,
                                      /*dense=*/nullptr, target.Fusion(attrs), call->scratch(),
                                      call->scratch_bytes(), call->stream()),
                                  "gather_reduce_sum sparse apply reduce"));
    return CudaStatus(
        launchers::LaunchApplyRows<CT, Acc, Tindex>(target.update, ids_out, values_out, num_unique,
                                                    target.table, target.state, call->stream()),
        "gather_reduce_sum sparse apply update");
  }
};

namespace {

// ---------------------------------------------------------------------------
// Registration: the dtypes of the CPU kernels. num_rows is read on the host;
// a resource handle always lives in host memory.

// The GPU kernel builder of `op` for values T and indices Tindex.
#define TF_TTEMB_GPU_BAG_KERNEL(op, T, Tindex) \
  Name(op).Device(DEVICE_GPU).TypeConstraint<T>("T").TypeConstraint<Tindex>("Tindices")

// Registers TfTtemb>`name` (params a tensor) and TfTtemb>Resource`name` (params a
// variable) as Kernel<GpuDevice, T, Tindex, ParamsFromResource>.
#define TF_TTEMB_REGISTER_GPU_WITH_RESOURCE(name, Kernel, T, Tindex)                    \
  REGISTER_KERNEL_BUILDER(TF_TTEMB_GPU_BAG_KERNEL("TfTtemb>" name, T, Tindex),          \
                          Kernel<GpuDevice, T, Tindex, false>);                         \
  REGISTER_KERNEL_BUILDER(                                                              \
      TF_TTEMB_GPU_BAG_KERNEL("TfTtemb>Resource" name, T, Tindex).HostMemory("params"), \
      Kernel<GpuDevice, T, Tindex, true>);

#define TF_TTEMB_REGISTER_GPU(T, Tindex)                                                           \
  TF_TTEMB_REGISTER_GPU_WITH_RESOURCE("GatherReduceSum", GatherReduceSumOp, T, Tindex)             \
  TF_TTEMB_REGISTER_GPU_WITH_RESOURCE("GatherReduceSumWeightsGrad", GatherReduceSumWeightsGradOp,  \
                                      T, Tindex)                                                   \
  TF_TTEMB_REGISTER_GPU_WITH_RESOURCE("GatherReduceSumFusedGrad", GatherReduceSumFusedGradOp, T,   \
                                      Tindex)                                                      \
  REGISTER_KERNEL_BUILDER(                                                                         \
      TF_TTEMB_GPU_BAG_KERNEL("TfTtemb>GatherReduceSumGrad", T, Tindex).HostMemory("num_rows"),    \
      GatherReduceSumGradOp<GpuDevice, T, Tindex, /*Dense=*/false>);                               \
  REGISTER_KERNEL_BUILDER(TF_TTEMB_GPU_BAG_KERNEL("TfTtemb>GatherReduceSumDenseGrad", T, Tindex)   \
                              .HostMemory("num_rows"),                                             \
                          GatherReduceSumGradOp<GpuDevice, T, Tindex, /*Dense=*/true>);            \
  REGISTER_KERNEL_BUILDER(TF_TTEMB_GPU_BAG_KERNEL("TfTtemb>GatherReduceSumSparseApply", T, Tindex) \
                              .HostMemory("params")                                                \
                              .HostMemory("learning_rate")                                         \
                              .HostMemory("epsilon")                                               \
                              .HostMemory("accumulators"),                                         \
                          GatherReduceSumSparseApplyOp<GpuDevice, T, Tindex>);

#define TF_TTEMB_REGISTER_GPU_ALL_INDICES(T) \
  TF_TTEMB_REGISTER_GPU(T, int32)            \
  TF_TTEMB_REGISTER_GPU(T, int64_t)

TF_TTEMB_REGISTER_GPU_ALL_INDICES(Eigen::half)
TF_TTEMB_REGISTER_GPU_ALL_INDICES(bfloat16)
TF_TTEMB_REGISTER_GPU_ALL_INDICES(float)
TF_TTEMB_REGISTER_GPU_ALL_INDICES(double)

#undef TF_TTEMB_REGISTER_GPU_ALL_INDICES
#undef TF_TTEMB_REGISTER_GPU
#undef TF_TTEMB_REGISTER_GPU_WITH_RESOURCE
#undef TF_TTEMB_GPU_BAG_KERNEL

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // GOOGLE_CUDA
