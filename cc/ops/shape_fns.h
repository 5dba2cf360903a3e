// Shape-function pieces shared by the op families' registrations (cc/ops/*_ops.cc):
// the bag inputs every bag op takes, and the report input of the Check*Report ops.

#ifndef TF_TTEMB_CC_OPS_SHAPE_FNS_H_
#define TF_TTEMB_CC_OPS_SHAPE_FNS_H_

#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// The bag inputs at `first` (indices [nnz]), first + 1 (row_splits) and first + 2
// (weights [nnz], or [0] without the has_weights attr): checks their ranks and returns
// indices' shape, merged with weights' when has_weights, and row_splits'.
inline Status BagVectorShapes(InferenceContext* c, int first, ShapeHandle* indices,
                              ShapeHandle* row_splits) {
  ShapeHandle weights;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(first), 1, indices));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(first + 1), 1, row_splits));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(first + 2), 1, &weights));
  bool has_weights;
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
  if (has_weights) TF_RETURN_IF_ERROR(c->Merge(*indices, weights, indices));
  return OkStatus();
}

// Shape function of the TfTtemb>Check*Report ops: input 0 is a report, [0] (a CPU
// op's) or the report's int64 words; no outputs.
inline Status ReportInputShape(InferenceContext* c) {
  ShapeHandle report;
  return c->WithRank(c->input(0), 1, &report);
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_OPS_SHAPE_FNS_H_
