// The OpKernels of the gather_reduce_sum gradients, each written once for both
// devices (device_op_kernel.h): the params gradient, deduplicated
// (GatherReduceSumGrad) or dense (GatherReduceSumDenseGrad), the weights
// gradient ((Resource)GatherReduceSumWeightsGrad) and both fused
// ((Resource)GatherReduceSumFusedGrad). An op parses its attrs once, runs the
// shape checks shared by both devices (gather_reduce_sum_kernels.h), allocates
// the outputs whose size the host knows and calls its Launch, which the CPU
// kernels (gather_reduce_sum_backward_cpu.cc) and the GPU glue
// (gather_reduce_sum_kernels_gpu.cc) specialise and register. The Launch
// checks the ids and row_splits where they live, and sizes the deduplicated
// outputs ([U], [U, D]) once U is known.
//
// Every Launch provides
//   static Status Run(OpKernelContext*, const BagAttrs&, const XxxArgs&, const Step&);
// with the Step of device_op_kernel.h (a GpuStep<Call> on the GPU, whose
// specialisation also names `using Call = ...;`).

#ifndef TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_BACKWARD_OP_H_
#define TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_BACKWARD_OP_H_

#include <cstdint>
#include <type_traits>

#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// Allocates a deduplicated params gradient as outputs 0 (unique ids [U]) and
// 1 (values [U, D]).
inline Status AllocateDeduplicatedGrad(OpKernelContext* ctx, int64_t num_unique, int64_t dim,
                                       Tensor** unique_ids, Tensor** values) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({num_unique}), unique_ids));
  return ctx->allocate_output(1, TensorShape({num_unique, dim}), values);
}

// ---------------------------------------------------------------------------
// Gradient w.r.t. params (GatherReduceSumGrad, GatherReduceSumDenseGrad).

struct ParamsGradArgs {
  ParamsGradShapes shapes;
  const Tensor* grad = nullptr;        // [B, D]
  const Tensor* indices = nullptr;     // [nnz]
  const Tensor* row_splits = nullptr;  // [B + 1]
  const Tensor* weights = nullptr;     // [nnz], or [0] without weights
  const Tensor* argmax = nullptr;      // [B, D] for max, else [0, D]
  // The dense form's output [num_rows, D]; null for the deduplicated form,
  // whose Launch allocates its outputs at U (AllocateDeduplicatedGrad).
  Tensor* params_grad = nullptr;
};

template <typename Device, typename T, typename Tindex>
struct ParamsGradLaunch;

// Dense: the output is params_grad [num_rows, D] (GatherReduceSumDenseGrad);
// otherwise unique_indices [U] ascending and values [U, D].
template <typename Device, typename T, typename Tindex, bool Dense>
class GatherReduceSumGradOp
    : public DeviceOpKernel<Device, GatherReduceSumGradOp<Device, T, Tindex, Dense>> {
 public:
  using Launch = ParamsGradLaunch<Device, T, Tindex>;

  explicit GatherReduceSumGradOp(OpKernelConstruction* ctx)
      : DeviceOpKernel<Device, GatherReduceSumGradOp>(ctx) {
    OP_REQUIRES_OK(ctx, GetBagAttrs(ctx, &attrs_));
  }

  template <typename Step>
  Status ComputeWith(OpKernelContext* ctx, const Step& step) {
    ParamsGradArgs a;
    TF_RETURN_IF_ERROR(ValidateParamsGradInputs(ctx, attrs_, &a.shapes));
    if constexpr (std::is_same_v<Device, GpuDevice>) {
      TF_RETURN_IF_ERROR(GpuParamsGradSizeLimits(a.shapes.bags));
    }
    a.grad = &ctx->input(0);
    a.indices = &ctx->input(1);
    a.row_splits = &ctx->input(2);
    a.weights = &ctx->input(3);
    a.argmax = &ctx->input(4);
    if (Dense) {
      TF_RETURN_IF_ERROR(
          ctx->allocate_output(0, TensorShape({a.shapes.num_rows, a.shapes.dim}), &a.params_grad));
    }
    return Launch::Run(ctx, attrs_, a, step);
  }

 private:
  BagAttrs attrs_;
};

// ---------------------------------------------------------------------------
// Gradient w.r.t. the weights ((Resource)GatherReduceSumWeightsGrad) and the
// fused params + weights gradient ((Resource)GatherReduceSumFusedGrad).
// Inputs 0..5: grad [B, D], params [N, D] (a tensor or a resource variable),
// indices, row_splits, weights [nnz], the forward's output [B, D].

struct WeightsGradArgs : WeightsGradInputs {
  Tensor* weights_grad = nullptr;  // of weights' shape
};

// The shape checks of inputs 0..5 (ValidateWeightsGradInputs), and the
// inputs; leaves weights_grad to the op.
inline Status GetWeightsGradArgs(OpKernelContext* ctx, const Tensor& params, const BagAttrs& attrs,
                                 WeightsGradArgs* a) {
  TF_RETURN_IF_ERROR(ValidateWeightsGradInputs(ctx, params, attrs, &a->shapes));
  SetWeightsGradInputs(ctx, params, a);
  return OkStatus();
}

struct FusedGradArgs : WeightsGradArgs {
  bool dense = false;  // the dense_grad attr
  // Outputs 0 and 1: in the dense form unique_ids [0] and params_grad
  // [num_rows, D]; null in the deduplicated form, whose Launch allocates them
  // at U (AllocateDeduplicatedGrad).
  Tensor* unique_ids = nullptr;
  Tensor* params_grad = nullptr;
};

template <typename Device, typename T, typename Tindex>
struct WeightsGradLaunch;
template <typename Device, typename T, typename Tindex>
struct FusedGradLaunch;

// The weights gradient alone (Fused = false: output 0 weights_grad, of weights' shape) or fused
// with the params gradient (Fused: outputs unique_indices, params_grad and
// weights_grad, GatherReduceSumFusedGradOp below). ParamsFromResource: params
// arrive as a resource variable, read in place under a shared lock held while the
// Launch runs (GPU: while it queues).
template <typename Device, typename T, typename Tindex, bool ParamsFromResource, bool Fused>
class GatherReduceSumWeightedGradOp
    : public DeviceOpKernel<
          Device, GatherReduceSumWeightedGradOp<Device, T, Tindex, ParamsFromResource, Fused>> {
 public:
  using Launch = std::conditional_t<Fused, FusedGradLaunch<Device, T, Tindex>,
                                    WeightsGradLaunch<Device, T, Tindex>>;
  using Args = std::conditional_t<Fused, FusedGradArgs, WeightsGradArgs>;

  explicit GatherReduceSumWeightedGradOp(OpKernelConstruction* ctx)
      : DeviceOpKernel<Device, GatherReduceSumWeightedGradOp>(ctx) {
    OP_REQUIRES_OK(
        ctx, GetWeightedBagAttrs(
                 ctx, Fused ? "GatherReduceSumFusedGrad" : "GatherReduceSumWeightsGrad", &attrs_));
    if (Fused) OP_REQUIRES_OK(ctx, ctx->GetAttr("dense_grad", &dense_grad_));
  }

  template <typename Step>
  Status ComputeWith(OpKernelContext* ctx, const Step& step) {
    return WithParamsStatus<T, ParamsFromResource>(ctx, 1, [&](const Tensor& params) -> Status {
      Args a;
      TF_RETURN_IF_ERROR(GetWeightsGradArgs(ctx, params, attrs_, &a));
      if constexpr (!Fused) {
        TF_RETURN_IF_ERROR(ctx->allocate_output(0, a.weights->shape(), &a.weights_grad));
      } else {
        if constexpr (std::is_same_v<Device, GpuDevice>) {
          TF_RETURN_IF_ERROR(GpuParamsGradSizeLimits(a.shapes));
        }
        a.dense = dense_grad_;
        TF_RETURN_IF_ERROR(ctx->allocate_output(2, a.weights->shape(), &a.weights_grad));
        if (dense_grad_) {
          TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({0}), &a.unique_ids));
          TF_RETURN_IF_ERROR(
              ctx->allocate_output(1, TensorShape({a.num_rows, a.dim}), &a.params_grad));
        }
      }
      return Launch::Run(ctx, attrs_, a, step);
    });
  }

 private:
  BagAttrs attrs_;
  bool dense_grad_ = false;  // Fused only
};

template <typename Device, typename T, typename Tindex, bool ParamsFromResource>
using GatherReduceSumWeightsGradOp =
    GatherReduceSumWeightedGradOp<Device, T, Tindex, ParamsFromResource, /*Fused=*/false>;
template <typename Device, typename T, typename Tindex, bool ParamsFromResource>
using GatherReduceSumFusedGradOp =
    GatherReduceSumWeightedGradOp<Device, T, Tindex, ParamsFromResource, /*Fused=*/true>;

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_BACKWARD_OP_H_
