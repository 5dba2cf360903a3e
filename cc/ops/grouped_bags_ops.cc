// Op registrations for the grouped_bags family: many features' bags, each feature
// looking up its own table, turned into one batch of bags over one flat table, so
// that one gather_reduce_sum call looks up every feature (GroupedEmbeddingBag).
//
// The features' tables are stacked in one flat table: feature t's table holds rows
// [row_offsets[t], row_offsets[t] + num_rows[t]) of it (features may share a table:
// equal offsets). The input holds every feature's bags, feature after feature:
//   indices     N tensors of any shape, read flat and end to end: the nnz ids,
//               feature 0's, then feature 1's, ... (GroupedEmbeddingBag passes one
//               per feature, a dense [B, L] as it is: no reshape or concat op)
//   row_splits  [T * B + 1]  int64, bag b of feature t is bag t * B + b
//   weights     [nnz]        when has_weights, else an empty [0] tensor
// The output orders the bags example by example (bag b * T + t holds bag b of
// feature t), so that the lookup's [B * T, D] output is the [B, T * D]
// concatenation of the features' embeddings without a transpose.

#include "cc/ops/shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace tf_ttemb {

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
// same InvalidArgument. Entry positions (j above, `indices[j]` in errors) count over
// the N tensors read end to end.
REGISTER_OP("TfTtemb>GroupBags")
    .Input("indices: N * Tindices")     // nnz entries in all
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
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int num_parts;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &num_parts));
      // nnz: the parts' element counts summed, where every one is known.
      DimensionHandle nnz = c->MakeDim(0);
      for (int i = 0; i < num_parts; ++i) {
        TF_RETURN_IF_ERROR(c->Add(nnz, c->NumElements(c->input(i)), &nnz));
      }
      ShapeHandle row_splits, weights, indices = c->Vector(nnz);
      TF_RETURN_IF_ERROR(c->WithRank(c->input(num_parts), 1, &row_splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(num_parts + 1), 1, &weights));
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
    .SetShapeFn(ReportInputShape)
    .Doc("Raises the InvalidArgument a GroupBags report holds.");

#undef TF_TTEMB_GROUP_ATTRS

}  // namespace tf_ttemb
}  // namespace tensorflow
