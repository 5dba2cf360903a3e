// The attrs and validation of the gather_reduce_sum family (EmbeddingBag),
// shared by the CPU kernels (gather_reduce_sum_{forward,backward,sparse_apply}_cpu.cc)
// and the GPU glue (gather_reduce_sum_kernels_gpu.cc), so that both parse the
// same attrs and reject bad input with the same messages.

#include "cc/kernels/gather_reduce_sum_kernels.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "cc/kernels/shape_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace tf_ttemb {

// ---------------------------------------------------------------------------
// Attributes and validation (shared with the GPU glue).

namespace {

// The attrs' spellings of the enums' values, in value order (0, 1, ...).
constexpr const char* kCombinerNames[] = {"sum", "mean", "sqrtn", "max"};
constexpr const char* kRowOptimizerNames[] = {"sgd", "rowwise_adagrad", "adagrad"};

// Parses the `attr` attr's value `name` as one of `names` (the spellings of Enum's
// values); an error quoting every choice otherwise.
template <typename Enum, size_t N>
Status ParseChoice(const char* attr, const std::string& name, const char* const (&names)[N],
                   Enum* value) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) {
      *value = static_cast<Enum>(i);
      return OkStatus();
    }
  }
  std::string choices;
  for (size_t i = 0; i < N; ++i) absl::StrAppend(&choices, i > 0 ? ", '" : "'", names[i], "'");
  return errors::InvalidArgument(attr, " must be one of ", choices, ", got '", name, "'");
}

}  // namespace

Status ParseCombiner(const std::string& name, Combiner* combiner) {
  return ParseChoice("combiner", name, kCombinerNames, combiner);
}

Status GetBagAttrs(OpKernelConstruction* ctx, BagAttrs* attrs) {
  std::string combiner;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiner", &combiner));
  TF_RETURN_IF_ERROR(ParseCombiner(combiner, &attrs->combiner));
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_weights", &attrs->has_weights));
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_padding_id", &attrs->has_padding_id));
  TF_RETURN_IF_ERROR(ctx->GetAttr("padding_id", &attrs->padding_id));
  if (attrs->has_weights && attrs->combiner == Combiner::kMax) {
    return errors::InvalidArgument("combiner 'max' does not take weights");
  }
  return OkStatus();
}

Status GetWeightedBagAttrs(OpKernelConstruction* ctx, const char* op, BagAttrs* attrs) {
  TF_RETURN_IF_ERROR(GetBagAttrs(ctx, attrs));
  if (!attrs->has_weights) {
    return errors::InvalidArgument(op, " needs has_weights = true");
  }
  return OkStatus();
}

Status ValidateParamsShape(const Tensor& params) {
  return CheckRank(params, 2, "params must be a matrix [N, D]");
}

Status ValidateBagShapes(const Tensor& indices, const Tensor& row_splits, const Tensor& weights,
                         const BagAttrs& attrs, BagShapes* shapes) {
  // indices and weights are read flat (row-major), whatever their shapes.
  TF_RETURN_IF_ERROR(CheckSplitsShape(
      row_splits, 1, "row_splits must be a vector [B + 1] with at least 1 element"));
  shapes->nnz = indices.NumElements();
  shapes->num_bags = row_splits.NumElements() - 1;
  if (attrs.has_weights && weights.NumElements() != shapes->nnz) {
    return errors::InvalidArgument("weights has ", weights.NumElements(),
                                   " entries but indices has ", shapes->nnz);
  }
  return OkStatus();
}

Status RowSplitsStartError(int64_t first_split) {
  return errors::InvalidArgument("row_splits[0] = ", first_split, " must be 0");
}

Status RowSplitsOrderError(int64_t bag, int64_t next_split, int64_t split) {
  return errors::InvalidArgument("row_splits must be non-decreasing: row_splits[", bag + 1,
                                 "] = ", next_split, " < row_splits[", bag, "] = ", split);
}

Status RowSplitsEndError(int64_t num_bags, int64_t last_split, int64_t nnz) {
  return errors::InvalidArgument("row_splits[", num_bags, "] = ", last_split,
                                 " must equal the number of indices (", nnz, ")");
}

Status ValidateRowSplits(const int64_t* row_splits, int64_t num_bags, int64_t nnz) {
  if (row_splits[0] != 0) return RowSplitsStartError(row_splits[0]);
  for (int64_t b = 0; b < num_bags; ++b) {
    if (row_splits[b + 1] < row_splits[b]) {
      return RowSplitsOrderError(b, row_splits[b + 1], row_splits[b]);
    }
  }
  if (row_splits[num_bags] != nnz) {
    return RowSplitsEndError(num_bags, row_splits[num_bags], nnz);
  }
  return OkStatus();
}

Status ValidateForwardInputs(const Tensor& params, const Tensor& indices, const Tensor& row_splits,
                             const Tensor& weights, const BagAttrs& attrs, BagShapes* shapes,
                             TensorShape* output_shape) {
  TF_RETURN_IF_ERROR(ValidateParamsShape(params));
  TF_RETURN_IF_ERROR(ValidateBagShapes(indices, row_splits, weights, attrs, shapes));
  return MatrixShape("output [num_bags, D]", shapes->num_bags, params.dim_size(1), output_shape);
}

Status ValidateWeightsGradInputs(OpKernelContext* ctx, const Tensor& params, const BagAttrs& attrs,
                                 BagShapes* shapes) {
  TF_RETURN_IF_ERROR(ValidateParamsShape(params));
  TF_RETURN_IF_ERROR(ValidateBagShapes(ctx->input(2), ctx->input(3), ctx->input(4), attrs, shapes));
  const TensorShape bag_shape({shapes->num_bags, params.dim_size(1)});
  const Tensor& grad = ctx->input(0);
  const Tensor& output = ctx->input(5);
  if (grad.shape() != bag_shape) {
    return errors::InvalidArgument("grad must have shape ", bag_shape.DebugString(), ", got ",
                                   grad.shape().DebugString());
  }
  if (output.shape() != bag_shape) {
    return errors::InvalidArgument("output must have shape ", bag_shape.DebugString(), ", got ",
                                   output.shape().DebugString());
  }
  return OkStatus();
}

void SetWeightsGradInputs(OpKernelContext* ctx, const Tensor& params, WeightsGradInputs* inputs) {
  inputs->num_rows = params.dim_size(0);
  inputs->dim = params.dim_size(1);
  inputs->grad = &ctx->input(0);
  inputs->params = &params;
  inputs->indices = &ctx->input(2);
  inputs->row_splits = &ctx->input(3);
  inputs->weights = &ctx->input(4);
  inputs->output = &ctx->input(5);
}

Status ValidateParamsGradInputs(OpKernelContext* ctx, const BagAttrs& attrs,
                                ParamsGradShapes* shapes) {
  const Tensor& grad = ctx->input(0);
  const Tensor& argmax = ctx->input(4);
  const Tensor& num_rows = ctx->input(5);
  TF_RETURN_IF_ERROR(CheckRank(grad, 2, "grad must be a matrix [B, D]"));
  if (!TensorShapeUtils::IsScalar(num_rows.shape())) {
    return errors::InvalidArgument("num_rows must be a scalar, got shape ",
                                   num_rows.shape().DebugString());
  }
  shapes->num_rows = num_rows.scalar<int64_t>()();
  if (shapes->num_rows < 0) {
    return errors::InvalidArgument("num_rows = ", shapes->num_rows, " must be >= 0");
  }
  TF_RETURN_IF_ERROR(
      ValidateBagShapes(ctx->input(1), ctx->input(2), ctx->input(3), attrs, &shapes->bags));
  const int64_t num_bags = shapes->bags.num_bags;
  shapes->dim = grad.dim_size(1);
  TensorShape dense_shape;  // a table [num_rows, D] that a tensor can hold
  TF_RETURN_IF_ERROR(
      MatrixShape("params_grad [num_rows, D]", shapes->num_rows, shapes->dim, &dense_shape));
  if (grad.dim_size(0) != num_bags) {
    return errors::InvalidArgument("grad has ", grad.dim_size(0), " rows but row_splits describes ",
                                   num_bags, " bags");
  }
  const int64_t argmax_rows = attrs.combiner == Combiner::kMax ? num_bags : 0;
  if (argmax.dims() != 2 || argmax.dim_size(0) != argmax_rows ||
      (argmax_rows > 0 && argmax.dim_size(1) != shapes->dim)) {
    return errors::InvalidArgument("argmax must have shape [", argmax_rows, ", ", shapes->dim,
                                   "], got ", argmax.shape().DebugString());
  }
  return OkStatus();
}

Status GpuParamsGradSizeLimits(const BagShapes& shapes) {
  if (shapes.nnz >= std::numeric_limits<int32>::max() - 1) {
    return errors::InvalidArgument(
        "the GPU params gradient supports fewer than 2^31 - 2 indices, got ", shapes.nnz);
  }
  if (shapes.num_bags >= std::numeric_limits<int32>::max()) {
    return errors::InvalidArgument(
        "the GPU params gradient supports fewer than 2^31 - 1 bags, got ", shapes.num_bags);
  }
  return OkStatus();
}

Status BadIndexError(int64_t position, int64_t value, int64_t num_rows, const BagAttrs& attrs) {
  if (attrs.has_padding_id) {
    return errors::InvalidArgument("indices[", position, "] = ", value, " is not in [0, ", num_rows,
                                   ") and is not padding_id (", attrs.padding_id, ")");
  }
  return errors::InvalidArgument("indices[", position, "] = ", value, " is not in [0, ", num_rows,
                                 ")");
}

Status ReportStatus(const DeviceReport& r, const BagAttrs& attrs) {
  TF_RETURN_IF_ERROR(RowSplitsReportStatus(r));
  if (r.first_bad_index >= 0) {
    return BadIndexError(r.first_bad_index, r.bad_index_value, r.num_rows, attrs);
  }
  return OkStatus();
}

Status GetReportAttrs(OpKernelConstruction* ctx, BagAttrs* attrs) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_padding_id", &attrs->has_padding_id));
  return ctx->GetAttr("padding_id", &attrs->padding_id);
}

Status ValidateReportInput(const Tensor& report, bool* empty) {
  *empty = report.NumElements() == 0;
  if (*empty || (report.dims() == 1 && report.NumElements() == kDeviceReportWords)) {
    return OkStatus();
  }
  return errors::InvalidArgument("report must be empty or hold ", kDeviceReportWords,
                                 " words, got shape ", report.shape().DebugString());
}

const char* RowOptimizerName(RowOptimizer optimizer) {
  return kRowOptimizerNames[static_cast<int>(optimizer)];
}

Status GetSparseApplyAttrs(OpKernelConstruction* ctx, DataType params_type, DataType acc_type,
                           SparseApplyAttrs* attrs) {
  TF_RETURN_IF_ERROR(GetBagAttrs(ctx, &attrs->bag));
  std::string name;
  TF_RETURN_IF_ERROR(ctx->GetAttr("optimizer", &name));
  TF_RETURN_IF_ERROR(ParseChoice("optimizer", name, kRowOptimizerNames, &attrs->optimizer));
  int num_accumulators = 0;
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_accumulators", &num_accumulators));
  const int expected = attrs->optimizer == RowOptimizer::kSgd ? 0 : 1;
  if (num_accumulators != expected) {
    return errors::InvalidArgument("optimizer '", name, "' takes ", expected,
                                   " accumulator variable(s), got ", num_accumulators);
  }
  DataType tacc;
  TF_RETURN_IF_ERROR(ctx->GetAttr("Tacc", &tacc));
  if (tacc != acc_type) {
    return errors::InvalidArgument("learning_rate, epsilon and the accumulator must be ",
                                   DataTypeString(acc_type), " for params of type ",
                                   DataTypeString(params_type), ", got ", DataTypeString(tacc));
  }
  return OkStatus();
}

Status LookupTypedVariable(OpKernelContext* ctx, int input, DataType dtype, const char* what,
                           core::RefCountPtr<Var>* variable) {
  TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input), variable));
  if ((*variable)->tensor()->dtype() != dtype) {
    return errors::InvalidArgument(what, " variable has dtype ",
                                   DataTypeString((*variable)->tensor()->dtype()),
                                   " but the op expects ", DataTypeString(dtype));
  }
  if (!(*variable)->is_initialized) {
    return errors::FailedPrecondition(what, " variable is not initialized");
  }
  return OkStatus();
}

template <typename Acc>
Status ValidateSparseApplyInputs(OpKernelContext* ctx, const Tensor& params,
                                 const Tensor* accumulator, const SparseApplyAttrs& attrs,
                                 BagShapes* shapes, Acc* lr, Acc* eps) {
  TF_RETURN_IF_ERROR(ValidateWeightsGradInputs(ctx, params, attrs.bag, shapes));
  const Tensor& argmax = ctx->input(6);
  const Tensor& learning_rate = ctx->input(7);
  const Tensor& epsilon = ctx->input(8);
  const int64_t num_rows = params.dim_size(0);
  const int64_t dim = params.dim_size(1);
  const int64_t argmax_rows = attrs.bag.combiner == Combiner::kMax ? shapes->num_bags : 0;
  if (argmax.dims() != 2 || argmax.dim_size(0) != argmax_rows ||
      (argmax_rows != 0 && argmax.dim_size(1) != dim)) {
    return errors::InvalidArgument("argmax must have shape [", argmax_rows, ", ", dim, "], got ",
                                   argmax.shape().DebugString());
  }
  if (!TensorShapeUtils::IsScalar(learning_rate.shape())) {
    return errors::InvalidArgument("learning_rate must be a scalar, got shape ",
                                   learning_rate.shape().DebugString());
  }
  if (!TensorShapeUtils::IsScalar(epsilon.shape())) {
    return errors::InvalidArgument("epsilon must be a scalar, got shape ",
                                   epsilon.shape().DebugString());
  }
  *lr = learning_rate.scalar<Acc>()();
  *eps = epsilon.scalar<Acc>()();
  if (!std::isfinite(*lr)) {
    return errors::InvalidArgument("learning_rate = ", *lr, " must be finite");
  }
  if (!std::isfinite(*eps) || *eps < Acc(0)) {
    return errors::InvalidArgument("epsilon = ", *eps, " must be finite and >= 0");
  }
  if (accumulator != nullptr) {
    const TensorShape expected = attrs.optimizer == RowOptimizer::kRowwiseAdagrad
                                     ? TensorShape({num_rows})
                                     : TensorShape({num_rows, dim});
    if (accumulator->shape() != expected) {
      return errors::InvalidArgument("accumulator must have shape ", expected.DebugString(),
                                     " for optimizer '", RowOptimizerName(attrs.optimizer),
                                     "' and params of shape ", params.shape().DebugString(),
                                     ", got ", accumulator->shape().DebugString());
    }
  }
  return OkStatus();
}

Status EnsureExclusiveBuffer(OpKernelContext* ctx, Var* var,
                             const std::function<Status(void*, const void*, size_t)>& copy) {
  Tensor* tensor = var->tensor();
  if (tensor->RefCountIsOne()) return OkStatus();
  Tensor copied;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copied));
  TF_RETURN_IF_ERROR(copy(copied.data(), tensor->data(), tensor->TotalBytes()));
  *tensor = copied;
  return OkStatus();
}

Status EnsureExclusiveHostBuffer(OpKernelContext* ctx, Var* var) {
  return EnsureExclusiveBuffer(ctx, var, [](void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return OkStatus();
  });
}

template Status ValidateSparseApplyInputs<float>(OpKernelContext*, const Tensor&, const Tensor*,
                                                 const SparseApplyAttrs&, BagShapes*, float*,
                                                 float*);
template Status ValidateSparseApplyInputs<double>(OpKernelContext*, const Tensor&, const Tensor*,
                                                  const SparseApplyAttrs&, BagShapes*, double*,
                                                  double*);

}  // namespace tf_ttemb
}  // namespace tensorflow
