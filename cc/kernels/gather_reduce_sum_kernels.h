// Shared pieces of the gather_reduce_sum kernels: attrs and validation (the GPU kernels' own
// size limits included). Used by the OpKernels written once for both devices
// (gather_reduce_sum_*_op.h), the CPU kernels and the GPU op glue, so that both devices reject bad
// input with the same messages.

#ifndef TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_KERNELS_H_
#define TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/common_types.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// Attributes common to every op of the family (combiner, weights, padding id),
// parsed once in the kernel constructor; the launchers take the same struct.
using BagAttrs = ::tf_ttemb::BagOptions;

Status ParseCombiner(const std::string& name, Combiner* combiner);
Status GetBagAttrs(OpKernelConstruction* ctx, BagAttrs* attrs);
// GetBagAttrs for the ops that need weights (the weights gradients): an error
// naming `op` when has_weights is false.
Status GetWeightedBagAttrs(OpKernelConstruction* ctx, const char* op, BagAttrs* attrs);

// Shapes of the CSR inputs. `num_bags` and `nnz` are set on success.
struct BagShapes {
  int64_t num_bags = 0;
  int64_t nnz = 0;
};
Status ValidateBagShapes(const Tensor& indices, const Tensor& row_splits, const Tensor& weights,
                         const BagAttrs& attrs, BagShapes* shapes);
Status ValidateParamsShape(const Tensor& params);

// The forward's host-side checks (params, the CSR inputs, and an output
// [num_bags, D] that a tensor can hold); sets `shapes` and `output_shape`.
Status ValidateForwardInputs(const Tensor& params, const Tensor& indices, const Tensor& row_splits,
                             const Tensor& weights, const BagAttrs& attrs, BagShapes* shapes,
                             TensorShape* output_shape);

// Content checks of host-resident row_splits: row_splits[0] == 0,
// non-decreasing, row_splits[B] == nnz.
Status ValidateRowSplits(const int64_t* row_splits, int64_t num_bags, int64_t nnz);

// The messages of ValidateRowSplits, one per rule, also raised by the GPU
// kernels from their device-side checks.
Status RowSplitsStartError(int64_t first_split);
Status RowSplitsOrderError(int64_t bag, int64_t next_split, int64_t split);
Status RowSplitsEndError(int64_t num_bags, int64_t last_split, int64_t nnz);

// What a device report (DeviceReport or GroupReport, cuda/common_types.h, which name
// their row_splits words alike) found wrong in row_splits, as the errors above, in the
// order the CPU kernels check: the first split, the order, the last split.
template <typename Report>
Status RowSplitsReportStatus(const Report& r) {
  if (r.first_split != 0) return RowSplitsStartError(r.first_split);
  if (r.first_bad_split >= 0) {
    return RowSplitsOrderError(r.first_bad_split, r.bad_split_value, r.bad_split_prev);
  }
  if (r.last_split != r.nnz) return RowSplitsEndError(r.num_bags, r.last_split, r.nnz);
  return OkStatus();
}

// The message for an id outside [0, num_rows) that is not the padding id.
Status BadIndexError(int64_t position, int64_t value, int64_t num_rows, const BagAttrs& attrs);

// The CPU kernel's error for the first problem a GPU op's report holds, in the
// CPU kernel's order (row_splits, then ids), or OK; worded from the report's own
// header (num_rows, nnz, num_bags).
Status ReportStatus(const DeviceReport& report, const BagAttrs& attrs);

// CheckBagReport's attrs (the padding id, which the bad-id message names).
Status GetReportAttrs(OpKernelConstruction* ctx, BagAttrs* attrs);

// CheckBagReport's input: empty (a CPU forward's; sets *empty) or one DeviceReport.
Status ValidateReportInput(const Tensor& report, bool* empty);

// Host-side shape checks of the params-gradient ops (inputs grad [B, D],
// indices, row_splits, weights, argmax, num_rows in host memory).
struct ParamsGradShapes {
  BagShapes bags;
  int64_t num_rows = 0;
  int64_t dim = 0;
};
Status ValidateParamsGradInputs(OpKernelContext* ctx, const BagAttrs& attrs,
                                ParamsGradShapes* shapes);

// The sizes the GPU params-gradient launchers take (the sort and the segment
// bookkeeping use int32 positions); checked by the GPU ops only.
Status GpuParamsGradSizeLimits(const BagShapes& shapes);

// Host-side shape checks of the ops taking (grad [B, D], params [N, D],
// indices, row_splits, weights [nnz], output [B, D]) as inputs 0..5 (the
// weights gradient and the fused gradient); `params` is passed separately
// because the Resource* variants read it from a variable.
Status ValidateWeightsGradInputs(OpKernelContext* ctx, const Tensor& params, const BagAttrs& attrs,
                                 BagShapes* shapes);

// Those inputs as the kernels read them, with the shapes
// ValidateWeightsGradInputs found.
struct WeightsGradInputs {
  BagShapes shapes;
  int64_t num_rows = 0;
  int64_t dim = 0;
  const Tensor* grad = nullptr;        // [B, D]
  const Tensor* params = nullptr;      // [N, D]: a variable's only while its lock is held
  const Tensor* indices = nullptr;     // nnz ids, any shape (read flat)
  const Tensor* row_splits = nullptr;  // [B + 1]
  const Tensor* weights = nullptr;     // nnz weights, any shape (read flat)
  const Tensor* output = nullptr;      // [B, D], the forward's
};

// Sets `inputs` but its shapes from inputs 0 and 2..5 and `params` (checked).
void SetWeightsGradInputs(OpKernelContext* ctx, const Tensor& params, WeightsGradInputs* inputs);

// Looks up the variable behind resource input `input` and checks that it is
// initialized and holds `dtype`; `what` names it in the errors ("params",
// "accumulator").
Status LookupTypedVariable(OpKernelContext* ctx, int input, DataType dtype, const char* what,
                           core::RefCountPtr<Var>* variable);

// The params variable of a Resource* op (resource input `input`, holding T).
template <typename T>
Status LookupVariable(OpKernelContext* ctx, int input, core::RefCountPtr<Var>* variable) {
  return LookupTypedVariable(ctx, input, DataTypeToEnum<T>::value, "params", variable);
}

template <typename Tindex>
inline bool IsPadding(Tindex id, const BagAttrs& attrs) {
  return attrs.has_padding_id && static_cast<int64_t>(id) == attrs.padding_id;
}

// Calls compute(params) with the table of input `input`: the tensor itself,
// or, for the Resource* ops (FromResource), the variable's tensor read in
// place under the variable's shared lock, held until compute returns.
// Returns compute's status, or the variable lookup's error.
template <typename T, bool FromResource, typename Compute>
Status WithParamsStatus(OpKernelContext* ctx, int input, Compute compute) {
  if (!FromResource) return compute(ctx->input(input));
  core::RefCountPtr<Var> variable;
  TF_RETURN_IF_ERROR(LookupVariable<T>(ctx, input, &variable));
  tf_shared_lock lock(*variable->mu());
  return compute(*variable->tensor());
}

// ---------------------------------------------------------------------------
// GatherReduceSumSparseApply: the pieces shared by the CPU kernel and the GPU
// glue (attrs, variable lookup and locking, host-side checks), so that both
// devices take the same inputs and reject bad ones with the same messages.

const char* RowOptimizerName(RowOptimizer optimizer);

// Attrs of the op, parsed once in the kernel constructor: the bag attrs, the
// optimizer, its accumulator count and Tacc (which must be `acc_type`, the
// accumulation type of the params dtype).
struct SparseApplyAttrs {
  BagAttrs bag;
  RowOptimizer optimizer = RowOptimizer::kSgd;
};
Status GetSparseApplyAttrs(OpKernelConstruction* ctx, DataType params_type, DataType acc_type,
                           SparseApplyAttrs* attrs);

// The host-side checks of the op's inputs (shapes, learning_rate, epsilon, the
// accumulator's shape) with the variables' tensors; sets `shapes`, `lr` and
// `eps`. learning_rate and epsilon are host tensors on both devices.
template <typename Acc>
Status ValidateSparseApplyInputs(OpKernelContext* ctx, const Tensor& params,
                                 const Tensor* accumulator, const SparseApplyAttrs& attrs,
                                 BagShapes* shapes, Acc* lr, Acc* eps);

// Makes the variable's buffer exclusively owned before an in-place update: a
// tensor read from it earlier (a dense read outside copy-on-read mode) may
// still share it, and must keep the old values. `copy(dst, src, bytes)` copies
// the buffer on the variable's device.
Status EnsureExclusiveBuffer(OpKernelContext* ctx, Var* var,
                             const std::function<Status(void*, const void*, size_t)>& copy);
// EnsureExclusiveBuffer for a variable in host memory.
Status EnsureExclusiveHostBuffer(OpKernelContext* ctx, Var* var);

// Looks up the params variable (input 1, holding T) and, for the optimizers
// with state, the accumulator (input 9, holding Acc); locks both exclusively,
// in address order so that two ops locking the same pair cannot deadlock, and
// returns compute(params_var, acc_var) (acc_var null for sgd), called under
// the locks.

template <typename T, typename Acc, typename Compute>
Status WithLockedSparseApplyVariablesStatus(OpKernelContext* ctx, const SparseApplyAttrs& attrs,
                                            Compute compute) {
  core::RefCountPtr<Var> params_var;
  TF_RETURN_IF_ERROR(LookupVariable<T>(ctx, 1, &params_var));
  core::RefCountPtr<Var> acc_var;
  if (attrs.optimizer != RowOptimizer::kSgd) {
    TF_RETURN_IF_ERROR(
        LookupTypedVariable(ctx, 9, DataTypeToEnum<Acc>::value, "accumulator", &acc_var));
    if (acc_var.get() == params_var.get()) {
      return errors::InvalidArgument("the accumulator must be another variable than params");
    }
  }
  mutex* first = params_var->mu();
  mutex* second = acc_var ? acc_var->mu() : nullptr;
  if (second != nullptr && second < first) std::swap(first, second);
  mutex_lock first_lock(*first);
  std::optional<mutex_lock> second_lock;
  if (second != nullptr) second_lock.emplace(*second);
  return compute(params_var.get(), acc_var.get());
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_KERNELS_H_
