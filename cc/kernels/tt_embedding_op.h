// The OpKernels of the TT embedding family (TTUniqueIds, TTRows, TTRowsGrad,
// TTCacheCount), each written once for both devices (device_op_kernel.h; TTRows,
// which never waits for the device, as a plain OpKernel). An op parses its attrs
// once, runs the host-side checks shared by both devices
// (tt_embedding_kernels.h; the ids' values where they are host memory, on the
// CPU, and the GPU kernels' own limits on the GPU), allocates the outputs
// whose size the host knows and calls its Launch, which the CPU kernels
// (tt_embedding_cpu.h) and the GPU glue (tt_embedding_kernels_gpu.cc)
// specialise and register. Every Launch but TTRows' provides
//   static Status Run(OpKernelContext*, const Attrs&, const XxxArgs&, const Step&);
// (TTCacheCount's, which has no attrs, without them) with the Step of
// device_op_kernel.h (a GpuStep<Call> on the GPU, whose specialisation also
// names `using Call = ...;`).

#ifndef TF_TTEMB_CC_KERNELS_TT_EMBEDDING_OP_H_
#define TF_TTEMB_CC_KERNELS_TT_EMBEDDING_OP_H_

#include <cstdint>
#include <type_traits>

#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/shape_util.h"
#include "cc/kernels/tt_embedding_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// ---------------------------------------------------------------------------
// TTUniqueIds

struct UniqueIdsArgs {
  int64_t nnz = 0;
  int64_t num_tables = 0;
  const Tensor* ids = nullptr;           // [nnz] of Tindex
  const Tensor* table_splits = nullptr;  // [num_tables + 1], host memory
  Tensor* slots = nullptr;               // [nnz] of Tindex
};

template <typename Device, typename Tindex>
struct UniqueIdsLaunch;

template <typename Device, typename Tindex>
class TTUniqueIdsOp : public DeviceOpKernel<Device, TTUniqueIdsOp<Device, Tindex>> {
 public:
  using Launch = UniqueIdsLaunch<Device, Tindex>;

  explicit TTUniqueIdsOp(OpKernelConstruction* ctx) : DeviceOpKernel<Device, TTUniqueIdsOp>(ctx) {
    OP_REQUIRES_OK(ctx, GetUniqueIdsAttrs(ctx, &attrs_));
  }

  template <typename Step>
  Status ComputeWith(OpKernelContext* ctx, const Step& step) {
    UniqueIdsArgs a;
    a.ids = &ctx->input(0);
    a.table_splits = &ctx->input(1);
    TF_RETURN_IF_ERROR(ValidateUniqueIdsInputs(*a.ids, *a.table_splits, attrs_));
    a.nnz = a.ids->NumElements();
    a.num_tables = a.table_splits->NumElements() - 1;
    if constexpr (std::is_same_v<Device, GpuDevice>) {
      TF_RETURN_IF_ERROR(ValidateGpuUniqueIdsSizes(a.nnz, a.num_tables, attrs_));
    }
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, a.ids->shape(), &a.slots));
    return Launch::Run(ctx, attrs_, a, step);
  }

 private:
  UniqueIdsAttrs attrs_;
};

// ---------------------------------------------------------------------------
// TTRows, TTRowsGrad

// What both ops read: the cores and the global ids, checked (the cores'
// shapes, the ids' shape, and on the CPU their values; on the GPU their count,
// the device checking the values).
struct RowsArgs {
  OpInputList cores;            // [num_tables * p_k, r_k q_k r_{k+1}] each
  const Tensor* ids = nullptr;  // [num_ids] of int64
  int64_t num_ids = 0;
};

template <typename Device>
Status GetRowsArgs(OpKernelContext* ctx, const TTShape& shape, const char* op, RowsArgs* a) {
  TF_RETURN_IF_ERROR(ValidateRowsInputs(ctx, shape, &a->cores));
  a->ids = &ctx->input(0);
  a->num_ids = a->ids->NumElements();
  if constexpr (std::is_same_v<Device, GpuDevice>) {
    return GpuIdsLimit(op, "ids", a->num_ids);
  } else {
    return ValidateGlobalIdValues(*a->ids, shape);
  }
}

// The TT ops' attrs: the factorisation, with the GPU kernels' own limits on
// it checked in the constructor of a GPU op.
template <typename Device>
Status GetRowsAttrs(OpKernelConstruction* ctx, TTShape* shape) {
  TF_RETURN_IF_ERROR(GetTTShape(ctx, shape));
  if constexpr (std::is_same_v<Device, GpuDevice>) {
    return ValidateGpuTTShape(*shape);
  }
  return OkStatus();
}

struct TTRowsArgs : RowsArgs {
  Tensor* rows = nullptr;    // [num_ids, prod(q_shapes)]
  Tensor* report = nullptr;  // [TTRowsLaunch::kReportWords] (0 words: the CPU's)
};

// TTRowsLaunch<Device, T> provides
//   static constexpr int64_t kReportWords;  // size of the `report` output
//   static Status Run(OpKernelContext*, const TTShape&, const TTRowsArgs&);
// The CPU one checks the ids' values itself (kReportWords = 0); the
// GPU one queues the rows and the ids' check on the op's stream and returns, its
// findings in `report`, which TfTtemb>CheckTTRowsReport turns into the same
// InvalidArgument (cc/ops/tt_embedding_ops.cc).
template <typename Device, typename T>
struct TTRowsLaunch;

// Synchronous on both devices (the output's size is known on the host, and the GPU
// check is a separate op), as GatherReduceSum's forward is.
template <typename Device, typename T>
class TTRowsOp : public OpKernel {
 public:
  using Launch = TTRowsLaunch<Device, T>;

  explicit TTRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetRowsAttrs<Device>(ctx, &shape_));
  }

  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

 private:
  Status Run(OpKernelContext* ctx) {
    TTRowsArgs a;
    TF_RETURN_IF_ERROR(GetRowsArgs<Device>(ctx, shape_, "TTRows", &a));
    TensorShape rows_shape;
    TF_RETURN_IF_ERROR(
        MatrixShape("rows [num_ids, prod(q_shapes)]", a.num_ids, shape_.dim, &rows_shape));
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, rows_shape, &a.rows));
    // `saved` is empty on every device: TTRowsGrad recomputes the partial
    // products (the op's doc says why the output stays).
    Tensor* saved = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({0}), &saved));
    const int64_t report_words = a.num_ids > 0 ? Launch::kReportWords : 0;
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, TensorShape({report_words}), &a.report));
    return Launch::Run(ctx, shape_, a);
  }

  TTShape shape_;
};

// TTRowsGrad's inputs beyond the ids and cores: grad [num_ids, D] (its shape
// checked by the Launch, after the ids' values as the CPU kernel orders it).
// The `saved` input is not read (TTRows' output 1, always empty).
struct TTRowsGradArgs : RowsArgs {
  const Tensor* grad = nullptr;
};

template <typename Device, typename T>
struct TTRowsGradLaunch;

template <typename Device, typename T>
class TTRowsGradOp : public DeviceOpKernel<Device, TTRowsGradOp<Device, T>> {
 public:
  using Launch = TTRowsGradLaunch<Device, T>;

  explicit TTRowsGradOp(OpKernelConstruction* ctx) : DeviceOpKernel<Device, TTRowsGradOp>(ctx) {
    OP_REQUIRES_OK(ctx, GetRowsAttrs<Device>(ctx, &shape_));
  }

  template <typename Step>
  Status ComputeWith(OpKernelContext* ctx, const Step& step) {
    TTRowsGradArgs a;
    TF_RETURN_IF_ERROR(GetRowsArgs<Device>(ctx, shape_, "TTRowsGrad", &a));
    a.grad = &ctx->input(1 + shape_.num_cores);
    return Launch::Run(ctx, shape_, a, step);
  }

 private:
  TTShape shape_;
};

// TTRowsBagsGrad (CPU only): TTRowsGrad's ids and cores, and the bags whose
// gradient it takes: grad [B, D], slots [nnz] into ids (-1 = padding),
// row_splits [B + 1] and weights ([nnz], or [0] without them), their shapes
// checked; the slots' values are checked by the Launch.
struct TTRowsBagsGradArgs : RowsArgs {
  int64_t num_bags = 0;
  int64_t nnz = 0;
  const Tensor* grad = nullptr;
  const Tensor* slots = nullptr;
  const Tensor* row_splits = nullptr;
  const Tensor* weights = nullptr;
};

template <typename Device, typename T, typename Tindex>
struct TTRowsBagsGradLaunch;

template <typename Device, typename T, typename Tindex>
class TTRowsBagsGradOp : public DeviceOpKernel<Device, TTRowsBagsGradOp<Device, T, Tindex>> {
 public:
  using Launch = TTRowsBagsGradLaunch<Device, T, Tindex>;

  explicit TTRowsBagsGradOp(OpKernelConstruction* ctx)
      : DeviceOpKernel<Device, TTRowsBagsGradOp>(ctx) {
    OP_REQUIRES_OK(ctx, GetRowsAttrs<Device>(ctx, &shape_));
    OP_REQUIRES_OK(ctx, GetRowsBagsGradAttrs(ctx, &bag_attrs_));
  }

  template <typename Step>
  Status ComputeWith(OpKernelContext* ctx, const Step& step) {
    TTRowsBagsGradArgs a;
    TF_RETURN_IF_ERROR(GetRowsArgs<Device>(ctx, shape_, "TTRowsBagsGrad", &a));
    TF_RETURN_IF_ERROR(ValidateRowsBagsGradShapes(ctx, shape_, bag_attrs_, &a.num_bags, &a.nnz));
    const int first = 1 + shape_.num_cores;
    a.grad = &ctx->input(first);
    a.slots = &ctx->input(first + 1);
    a.row_splits = &ctx->input(first + 2);
    a.weights = &ctx->input(first + 3);
    return Launch::Run(ctx, shape_, bag_attrs_, a, step);
  }

 private:
  TTShape shape_;
  BagAttrs bag_attrs_;
};

// Registers TTRows and TTRowsGrad on `device` (DEVICE_CPU or DEVICE_GPU, with
// `D` its tag) for every value type; the device's source file uses it once.
#define TF_TTEMB_REGISTER_TT_ROWS_OF(device, D, T)                                          \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTRows").Device(device).TypeConstraint<T>("T"),     \
                          TTRowsOp<D, T>);                                                  \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTRowsGrad").Device(device).TypeConstraint<T>("T"), \
                          TTRowsGradOp<D, T>);
#define TF_TTEMB_REGISTER_TT_ROWS(device, D)               \
  TF_TTEMB_REGISTER_TT_ROWS_OF(device, D, Eigen::half)     \
  TF_TTEMB_REGISTER_TT_ROWS_OF(device, D, Eigen::bfloat16) \
  TF_TTEMB_REGISTER_TT_ROWS_OF(device, D, float)           \
  TF_TTEMB_REGISTER_TT_ROWS_OF(device, D, double)

// ---------------------------------------------------------------------------
// TTCacheCount

// The op's inputs, with both variables locked exclusively and of one size
// (`size` > 0 slots).
struct CacheCountArgs {
  Var* keys = nullptr;    // [size] of int64
  Var* counts = nullptr;  // [size] of int64
  int64_t size = 0;
  const Tensor* ids = nullptr;  // [n] of int64
};

template <typename Device>
struct CacheCountLaunch;

template <typename Device>
class TTCacheCountOp : public DeviceOpKernel<Device, TTCacheCountOp<Device>> {
 public:
  using Launch = CacheCountLaunch<Device>;

  explicit TTCacheCountOp(OpKernelConstruction* ctx)
      : DeviceOpKernel<Device, TTCacheCountOp>(ctx) {}

  template <typename Step>
  Status ComputeWith(OpKernelContext* ctx, const Step& step) {
    CacheCountArgs a;
    a.ids = &ctx->input(2);
    TF_RETURN_IF_ERROR(ValidateCacheCountIds(*a.ids));
    core::RefCountPtr<Var> keys_var, counts_var;
    TF_RETURN_IF_ERROR(LookupCacheTables(ctx, &keys_var, &counts_var));
    mutex_lock keys_lock(*keys_var->mu());
    mutex_lock counts_lock(*counts_var->mu());
    TF_RETURN_IF_ERROR(ValidateCacheTableSizes(keys_var.get(), counts_var.get()));
    a.keys = keys_var.get();
    a.counts = counts_var.get();
    a.size = a.keys->tensor()->NumElements();
    if (a.size == 0) return OkStatus();
    return Launch::Run(ctx, a, step);
  }
};

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_TT_EMBEDDING_OP_H_
