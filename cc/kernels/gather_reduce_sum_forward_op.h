// The forward OpKernel of the gather_reduce_sum family (GatherReduceSum,
// ResourceGatherReduceSum), written once for both devices in TensorFlow core's
// way: GatherReduceSumOp<Device, ...> reads the table, runs the host-side
// checks shared by both devices and allocates the outputs, then calls
// ForwardLaunch<Device, T, Tindex>::Run, which the CPU kernels
// (gather_reduce_sum_forward_cpu.cc) and the GPU glue
// (gather_reduce_sum_kernels_gpu.cc) specialise and register.
//
// ForwardLaunch<Device, T, Tindex> provides
//   static constexpr int64_t kReportWords;  // size of the `report` output
//   static Status Run(OpKernelContext*, const BagAttrs&, const ForwardArgs&);
// The CPU one checks the ids and row_splits itself (kReportWords = 0); the GPU
// one queues the checks and the forward on the op's stream and returns, the
// findings in `report`, which TfTtemb>CheckBagReport turns into the same
// InvalidArgument (cc/ops/gather_reduce_sum_ops.cc).

#ifndef TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_FORWARD_OP_H_
#define TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_FORWARD_OP_H_

#include <cstdint>

#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// What the forward computes from, and into: the inputs as checked on the host,
// and the outputs as allocated.
struct ForwardArgs {
  BagShapes shapes;
  int64_t num_rows = 0;
  int64_t dim = 0;
  const Tensor* params = nullptr;      // [N, D]
  const Tensor* indices = nullptr;     // [nnz]
  const Tensor* row_splits = nullptr;  // [B + 1]
  const Tensor* weights = nullptr;     // [nnz], or [0] without weights
  Tensor* output = nullptr;            // [B, D]
  Tensor* argmax = nullptr;            // [B, D] for max, else [0, D]
  Tensor* report = nullptr;            // [ForwardLaunch::kReportWords]
};

template <typename Device, typename T, typename Tindex>
struct ForwardLaunch;

// ParamsFromResource: params arrive as a resource variable, read in place
// under a shared lock instead of as a (possibly copied) tensor.
template <typename Device, typename T, typename Tindex, bool ParamsFromResource>
class GatherReduceSumOp : public OpKernel {
 public:
  using Launch = ForwardLaunch<Device, T, Tindex>;

  explicit GatherReduceSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetBagAttrs(ctx, &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, (WithParamsStatus<T, ParamsFromResource>(
                            ctx, 0, [&](const Tensor& params) { return Run(ctx, params); })));
  }

 private:
  Status Run(OpKernelContext* ctx, const Tensor& params) {
    ForwardArgs a;
    a.params = &params;
    a.indices = &ctx->input(1);
    a.row_splits = &ctx->input(2);
    a.weights = &ctx->input(3);
    TensorShape output_shape;
    TF_RETURN_IF_ERROR(ValidateForwardInputs(params, *a.indices, *a.row_splits, *a.weights, attrs_,
                                             &a.shapes, &output_shape));
    a.num_rows = params.dim_size(0);
    a.dim = params.dim_size(1);
    const bool is_max = attrs_.combiner == Combiner::kMax;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, output_shape, &a.output));
    TF_RETURN_IF_ERROR(
        ctx->allocate_output(1, TensorShape({is_max ? a.shapes.num_bags : 0, a.dim}), &a.argmax));
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, TensorShape({Launch::kReportWords}), &a.report));
    return Launch::Run(ctx, attrs_, a);
  }

  BagAttrs attrs_;
};

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GATHER_REDUCE_SUM_FORWARD_OP_H_
