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

// The bag inputs at `first` (indices, any shape, read flat: nnz ids), first + 1
// (row_splits [B + 1]) and first + 2 (weights, read flat: nnz of them with the
// has_weights attr, else ignored): checks row_splits' rank and returns indices' shape,
// merged with weights' when has_weights and both are vectors, and row_splits'. (The
// kernels check that weights has nnz elements whatever its shape.)
inline Status BagVectorShapes(InferenceContext* c, int first, ShapeHandle* indices,
                              ShapeHandle* row_splits) {
  *indices = c->input(first);
  const ShapeHandle weights = c->input(first + 2);
  TF_RETURN_IF_ERROR(c->WithRank(c->input(first + 1), 1, row_splits));
  bool has_weights;
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
  if (has_weights && c->RankKnown(*indices) && c->Rank(*indices) == 1 && c->RankKnown(weights) &&
      c->Rank(weights) == 1) {
    TF_RETURN_IF_ERROR(c->Merge(*indices, weights, indices));
  }
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
