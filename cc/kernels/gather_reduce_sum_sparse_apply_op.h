// The OpKernel of GatherReduceSumSparseApply (the params gradient of a batch
// of bags reduced per distinct row and an optimizer step applied to those rows
// in place), written once for both devices (device_op_kernel.h). Under the
// variables' exclusive locks the op runs the checks shared by both devices
// (gather_reduce_sum_kernels.h), allocates the weights gradient and calls
//   SparseApplyLaunch<Device, T, Tindex>::Run(ctx, attrs, args, step),
// which the CPU kernel (gather_reduce_sum_sparse_apply_cpu.cc) and the GPU
// glue (gather_reduce_sum_kernels_gpu.cc) specialise and register.

#ifndef TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_SPARSE_APPLY_OP_H_
#define TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_SPARSE_APPLY_OP_H_

#include <cstdint>
#include <type_traits>

#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// What the op computes from, and into. The variables (and their tensors) are
// the op's only while it holds their locks.
struct SparseApplyArgs : WeightsGradInputs {
  // learning_rate and epsilon, read as AccT<T> (float or double: exact here).
  double lr = 0;
  double eps = 0;
  Var* params_var = nullptr;       // [N, D] of T (its tensor is `params`)
  Var* acc_var = nullptr;          // [N] (row-wise) or [N, D] of AccT<T>; null for sgd
  const Tensor* argmax = nullptr;  // [B, D] for max, else [0, D]
  Tensor* weights_grad = nullptr;  // weights' shape with weights, else [0]
};

// The host-side checks of the inputs with the locked variables
// (ValidateSparseApplyInputs), and the inputs; leaves weights_grad to the op.
template <typename T>
Status GetSparseApplyArgs(OpKernelContext* ctx, const SparseApplyAttrs& attrs, Var* params_var,
                          Var* acc_var, SparseApplyArgs* a) {
  const Tensor& params = *params_var->tensor();
  AccT<T> lr, eps;
  TF_RETURN_IF_ERROR(ValidateSparseApplyInputs<AccT<T>>(
      ctx, params, acc_var != nullptr ? acc_var->tensor() : nullptr, attrs, &a->shapes, &lr, &eps));
  SetWeightsGradInputs(ctx, params, a);
  a->lr = lr;
  a->eps = eps;
  a->params_var = params_var;
  a->acc_var = acc_var;
  a->argmax = &ctx->input(6);
  return OkStatus();
}

template <typename Device, typename T, typename Tindex>
struct SparseApplyLaunch;

template <typename Device, typename T, typename Tindex>
class GatherReduceSumSparseApplyOp
    : public DeviceOpKernel<Device, GatherReduceSumSparseApplyOp<Device, T, Tindex>> {
 public:
  using Acc = AccT<T>;
  using Launch = SparseApplyLaunch<Device, T, Tindex>;

  explicit GatherReduceSumSparseApplyOp(OpKernelConstruction* ctx)
      : DeviceOpKernel<Device, GatherReduceSumSparseApplyOp>(ctx) {
    OP_REQUIRES_OK(ctx, GetSparseApplyAttrs(ctx, DataTypeToEnum<T>::value,
                                            DataTypeToEnum<Acc>::value, &attrs_));
  }

  template <typename Step>
  Status ComputeWith(OpKernelContext* ctx, const Step& step) {
    return WithLockedSparseApplyVariablesStatus<T, Acc>(
        ctx, attrs_, [&](Var* params_var, Var* acc_var) -> Status {
          SparseApplyArgs a;
          TF_RETURN_IF_ERROR(GetSparseApplyArgs<T>(ctx, attrs_, params_var, acc_var, &a));
          if constexpr (std::is_same_v<Device, GpuDevice>) {
            TF_RETURN_IF_ERROR(GpuParamsGradSizeLimits(a.shapes));
          }
          // The weights gradient has the weights' shape ([0] without weights).
          TF_RETURN_IF_ERROR(ctx->allocate_output(
              0, attrs_.bag.has_weights ? a.weights->shape() : TensorShape({0}), &a.weights_grad));
          return Launch::Run(ctx, attrs_, a, step);
        });
  }

 private:
  SparseApplyAttrs attrs_;
};

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_SPARSE_APPLY_OP_H_
