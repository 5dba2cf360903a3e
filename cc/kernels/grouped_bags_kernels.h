// The grouped_bags family (cc/ops/grouped_bags_ops.cc): the attrs, validation
// and messages shared by the CPU kernels (grouped_bags_kernels.cc) and the GPU
// glue (grouped_bags_kernels_gpu.cc), and GroupBagsOp, the one OpKernel of
// TfTtemb>GroupBags for both devices over GroupBagsLaunch<Device, T, Tindex>.

#ifndef TF_TTEMB_CC_KERNELS_GROUPED_BAGS_KERNELS_H_
#define TF_TTEMB_CC_KERNELS_GROUPED_BAGS_KERNELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cc/kernels/device_op_kernel.h"
#include "cuda/common_types.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// The per-feature attrs of GroupBags and CheckGroupReport, checked to be lists
// of one length (the number of features) with rows and offsets >= 0.
struct GroupAttrs {
  std::vector<int64_t> num_rows;
  std::vector<int64_t> row_offsets;
  std::vector<int64_t> padding_ids;
  std::vector<bool> has_padding_ids;
  std::vector<std::string> labels;
  bool has_weights = false;

  int64_t num_features() const { return static_cast<int64_t>(num_rows.size()); }
  bool IsPadding(int64_t feature, int64_t id) const {
    return has_padding_ids[feature] && id == padding_ids[feature];
  }
};

Status GetGroupAttrs(OpKernelConstruction* ctx, bool with_weights, GroupAttrs* attrs);

// GroupBags' inputs as checked on the host, and its outputs as allocated.
struct GroupArgs {
  int64_t nnz = 0;
  int64_t batch = 0;                   // B: bags per feature
  std::vector<const Tensor*> indices;  // the N parts, read flat and end to end
  std::vector<int64_t> part_starts;    // [N + 1]: entries [starts[p], starts[p + 1]) in part p
  const Tensor* row_splits = nullptr;  // [T * B + 1]
  const Tensor* weights = nullptr;     // [nnz] or [0]
  Tensor* group_indices = nullptr;     // [nnz] int64
  Tensor* group_row_splits = nullptr;  // [B * T + 1]
  Tensor* group_weights = nullptr;     // [nnz] or [0]
  Tensor* positions = nullptr;         // [nnz] or [0]
  Tensor* report = nullptr;            // [GroupBagsLaunch::kReportWords]
};

// Shapes of the inputs (args->indices, row_splits and weights set; sets nnz,
// part_starts and batch).
Status ValidateGroupInputs(const GroupAttrs& attrs, GroupArgs* args);

// The message for an id of `feature` outside its table that is not its padding id,
// `feature <label>: indices[5] = 9001 is not in [0, 4096)`; `position` is the
// entry's place among that feature's own ids.
Status GroupBadIndexError(const GroupAttrs& attrs, int64_t feature, int64_t position,
                          int64_t value);

// The CPU kernel's error for the first problem a GPU GroupBags report holds, or OK.
Status GroupReportStatus(const GroupReport& report, const GroupAttrs& attrs);

// CheckGroupReport's input: empty (a CPU GroupBags'; sets *empty) or one GroupReport.
Status ValidateGroupReportInput(const Tensor& report, bool* empty);

// GroupBagsLaunch<Device, T, Tindex> provides
//   static constexpr int64_t kReportWords;  // size of the `report` output
//   static Status Run(OpKernelContext*, const GroupAttrs&, const GroupArgs&);
// The CPU one raises errors itself (kReportWords = 0); the GPU one queues the
// work on the op's stream and returns, its findings in `report`.
template <typename Device, typename T, typename Tindex>
struct GroupBagsLaunch;

template <typename Device, typename T, typename Tindex>
class GroupBagsOp : public OpKernel {
 public:
  using Launch = GroupBagsLaunch<Device, T, Tindex>;

  explicit GroupBagsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetGroupAttrs(ctx, /*with_weights=*/true, &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    GroupArgs a;
    OpInputList indices;
    OP_REQUIRES_OK(ctx, ctx->input_list("indices", &indices));
    for (const Tensor& part : indices) a.indices.push_back(&part);
    OP_REQUIRES_OK(ctx, ctx->input("row_splits", &a.row_splits));
    OP_REQUIRES_OK(ctx, ctx->input("weights", &a.weights));
    OP_REQUIRES_OK(ctx, ValidateGroupInputs(attrs_, &a));
    const int64_t weighted = attrs_.has_weights ? a.nnz : 0;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({a.nnz}), &a.group_indices));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, a.row_splits->shape(), &a.group_row_splits));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({weighted}), &a.group_weights));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({weighted}), &a.positions));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({Launch::kReportWords}), &a.report));
    OP_REQUIRES_OK(ctx, Launch::Run(ctx, attrs_, a));
  }

 private:
  GroupAttrs attrs_;
};

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_GROUPED_BAGS_KERNELS_H_
