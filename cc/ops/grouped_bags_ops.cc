// Op registrations for the grouped_bags family: many features' bags, each feature
// looking up its own table, turned into one batch of bags over one flat table, so
// that one gather_reduce_sum call looks up every feature (GroupedEmbeddingBag).
//
// The features' tables are stacked in one flat table: feature t's table holds rows
// [row_offsets[t], row_offsets[t] + num_rows[t]) of it (features may share a table:
// equal offsets). The input holds every feature's bags, feature after feature:
//   indices     [nnz]        feature 0's ids, then feature 1's, ...
//   row_splits  [T * B + 1]  int64, bag b of feature t is bag t * B + b
//   weights     [nnz]        when has_weights, else an empty [0] tensor
// The output orders the bags example by example (bag b * T + t holds bag b of
// feature t), so that the lookup's [B * T, D] output is the [B, T * D]
// concatenation of the features' embeddings without a transpose.

#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace tf_ttemb {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

namespace {

// The number of features (the length of num_rows).
Status FeatureCount(InferenceContext* c, int64_t* features) {
  std::vector<int64_t> num_rows;
  TF_RETURN_IF_ERROR(c->GetAttr("num_rows", &num_rows));
  *features = static_cast<int64_t>(num_rows.size());
  return OkStatus();
}

// The inputs of ResourceGroupedGatherSum(Grad) from `params` (a resource whose
// handle data, when known, gives D) and `indices` (then row_splits, weights):
// checks their ranks, merges nnz with the weights' (has_weights), and returns
// B (from row_splits and the feature count, when known) and D.
Status GroupedSumInputShapes(InferenceContext* c, int params, int indices, DimensionHandle* batch,
                             DimensionHandle* dim) {
  ShapeHandle ids, row_splits, weights;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(indices), 1, &ids));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(indices + 1), 1, &row_splits));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(indices + 2), 1, &weights));
  bool has_weights;
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
  if (has_weights) TF_RETURN_IF_ERROR(c->Merge(ids, weights, &ids));
  int64_t features;
  TF_RETURN_IF_ERROR(FeatureCount(c, &features));
  *batch = c->UnknownDim();
  const DimensionHandle splits = c->Dim(row_splits, 0);
  if (c->ValueKnown(splits) && features > 0 && (c->Value(splits) - 1) % features == 0) {
    *batch = c->MakeDim((c->Value(splits) - 1) / features);
  }
  *dim = c->UnknownDim();
  const auto* handle_data = c->input_handle_shapes_and_types(params);
  if (handle_data != nullptr && handle_data->size() == 1) {
    ShapeHandle table;
    TF_RETURN_IF_ERROR(c->WithRank((*handle_data)[0].shape, 2, &table));
    *dim = c->Dim(table, 1);
  }
  return OkStatus();
}

}  // namespace

#define TF_TTEMB_GROUP_ATTRS                                       \
  Attr("num_rows: list(int) >= 1")    /* N_t, per feature */       \
      .Attr("row_offsets: list(int)") /* first row, per feature */ \
      .Attr("padding_ids: list(int)")                              \
      .Attr("has_padding_ids: list(bool)")                         \
      .Attr("labels: list(string)") /* the features' names, for errors */

// Checks every id against its own feature's table (a padding id of the feature
// maps to -1, which the lookup skips as its padding id) and reorders the bags
// example by example:
//   group_indices[i]  the flat table's row of entry i (int64), -1 for padding
//   group_row_splits  [B * T + 1]
//   group_weights     [nnz] (or [0]) reordered like the ids
//   positions[j]      where entry j of `indices` went ([nnz] with weights, else [0]):
//                     the weights' gradient is tf.gather(grad, positions)
// The CPU kernel raises InvalidArgument for bad row_splits or ids; the GPU kernel
// queues its work and returns without waiting, its findings in `report` (a
// GroupReport, cuda/common_types.h), which TfTtemb>CheckGroupReport raises as the
// same InvalidArgument.
REGISTER_OP("TfTtemb>GroupBags")
    .Input("indices: Tindices")         // [nnz]
    .Input("row_splits: int64")         // [T * B + 1]
    .Input("weights: T")                // [nnz] or [0]
    .Output("group_indices: int64")     // [nnz]
    .Output("group_row_splits: int64")  // [B * T + 1]
    .Output("group_weights: T")         // [nnz] or [0]
    .Output("positions: int64")         // [nnz] or [0]
    .Output("report: int64")            // [0] on the CPU; see CheckGroupReport
    .Attr("has_weights: bool")
    .TF_TTEMB_GROUP_ATTRS.Attr("T: {half, bfloat16, float, double}")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle indices, row_splits, weights;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &indices));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &row_splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &weights));
      bool has_weights;
      TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
      if (has_weights) TF_RETURN_IF_ERROR(c->Merge(indices, weights, &indices));
      c->set_output(0, indices);
      c->set_output(1, row_splits);
      c->set_output(2, has_weights ? indices : c->Vector(0));
      c->set_output(3, has_weights ? indices : c->Vector(0));
      c->set_output(4, c->Vector(c->UnknownDim()));
      return OkStatus();
    })
    .Doc("Every feature's bags, checked against its own table, as one batch of bags.");

// Raises the CPU kernel's InvalidArgument for what a GroupBags `report` holds
// (nothing for an empty report, as the CPU kernel returns). Stateful, so that a
// tf.function runs it though nothing consumes it.
REGISTER_OP("TfTtemb>CheckGroupReport")
    .Input("report: int64")
    .TF_TTEMB_GROUP_ATTRS.SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle report;
      return c->WithRank(c->input(0), 1, &report);
    })
    .Doc("Raises the InvalidArgument a GroupBags report holds.");

#define TF_TTEMB_GROUPED_SUM_ATTRS                                     \
  Attr("has_weights: bool")                                            \
      .TF_TTEMB_GROUP_ATTRS.Attr("T: {half, bfloat16, float, double}") \
      .Attr("Tindices: {int32, int64}")

// Combiner 'sum' of every feature's bags on the stacked table (a resource variable
// [N, D] of dtype T), in one op, from the input as GroupBags takes it (feature
// after feature): output[b, t * D : (t + 1) * D] is the weighted sum of the rows
// row_offsets[t] + id of feature t's bag b (a feature's padding id is skipped).
// CPU only: the CPU kernel keeps the input's order, table after table, where
// GroupBags + GatherReduceSum alternates between the tables at every bag
// (cc/kernels/grouped_sum_cpu.cc). Bad ids raise GroupBags' InvalidArgument.
REGISTER_OP("TfTtemb>ResourceGroupedGatherSum")
    .Input("params: resource")   // the stacked table
    .Input("indices: Tindices")  // [nnz]
    .Input("row_splits: int64")  // [T * B + 1]
    .Input("weights: T")         // [nnz] or [0]
    .Output("output: T")         // [B, T * D]
    .TF_TTEMB_GROUPED_SUM_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle batch, dim;
      TF_RETURN_IF_ERROR(GroupedSumInputShapes(c, 0, 1, &batch, &dim));
      int64_t features;
      TF_RETURN_IF_ERROR(FeatureCount(c, &features));
      DimensionHandle width;
      TF_RETURN_IF_ERROR(c->Multiply(dim, features, &width));
      c->set_output(0, c->Matrix(batch, width));
      return OkStatus();
    })
    .Doc("Every feature's sum bags on its own table of a stacked table, in one op.");

// The gradients of ResourceGroupedGatherSum from its upstream gradient `grad`
// [B, T * D]: the stacked table's, deduplicated (unique_rows ascending, values
// [U, D] the summed gradient of each row; deterministic), and the weights' (<grad
// slice, row> per entry, 0 for padding; [0] without weights).
REGISTER_OP("TfTtemb>ResourceGroupedGatherSumGrad")
    .Input("grad: T")              // [B, T * D]
    .Input("params: resource")     // the stacked table
    .Input("indices: Tindices")    // [nnz]
    .Input("row_splits: int64")    // [T * B + 1]
    .Input("weights: T")           // [nnz] or [0]
    .Output("unique_rows: int64")  // [U]
    .Output("values: T")           // [U, D]
    .Output("weights_grad: T")     // [nnz] or [0]
    .TF_TTEMB_GROUPED_SUM_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle batch, dim;
      TF_RETURN_IF_ERROR(GroupedSumInputShapes(c, 1, 2, &batch, &dim));
      ShapeHandle grad;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(grad, 0), batch, &batch));
      DimensionHandle unique = c->UnknownDim();
      c->set_output(0, c->Vector(unique));
      c->set_output(1, c->Matrix(unique, dim));
      bool has_weights;
      TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
      c->set_output(2, has_weights ? c->input(2) : c->Vector(0));
      return OkStatus();
    })
    .Doc("Gradients of ResourceGroupedGatherSum: the stacked table's deduplicated, weights'.");

#undef TF_TTEMB_GROUPED_SUM_ATTRS
#undef TF_TTEMB_GROUP_ATTRS

}  // namespace tf_ttemb
}  // namespace tensorflow
