// Shape checks shared by the CPU kernels and the GPU glue of every op family: an
// input's rank, and output shapes computed from inputs and attrs, checked before
// TensorShape sees them: a TensorShape whose element count overflows int64
// CHECK-fails (aborts the process), so every kernel that sizes an output from values
// a user controls builds it here and raises InvalidArgument instead.

#ifndef TF_TTEMB_CC_KERNELS_SHAPE_UTIL_H_
#define TF_TTEMB_CC_KERNELS_SHAPE_UTIL_H_

#include <cstdint>

#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// OK when `t` has rank `rank`, else InvalidArgument "<what>, got shape [...]", with
// `what` naming the input and the shape it must have ("params must be a matrix [N, D]").
inline Status CheckRank(const Tensor& t, int rank, const char* what) {
  if (t.dims() == rank) return OkStatus();
  return errors::InvalidArgument(what, ", got shape ", t.shape().DebugString());
}

// OK when `t` is a vector of at least `min_size` elements (row_splits and the like),
// else InvalidArgument "<what>, got shape [...]".
inline Status CheckSplitsShape(const Tensor& t, int64_t min_size, const char* what) {
  if (t.dims() == 1 && t.NumElements() >= min_size) return OkStatus();
  return errors::InvalidArgument(what, ", got shape ", t.shape().DebugString());
}

// The [rows, cols] shape of `what` (named in the error with its dims, e.g.
// "output [num_bags, D]").
inline Status MatrixShape(const char* what, int64_t rows, int64_t cols, TensorShape* shape) {
  int64_t elements = 0;
  if (rows < 0 || cols < 0 || __builtin_mul_overflow(rows, cols, &elements)) {
    return errors::InvalidArgument(what, " would have shape [", rows, ", ", cols,
                                   "]: more elements than a tensor can hold "
                                   "(2^63 - 1)");
  }
  *shape = TensorShape({rows, cols});
  return OkStatus();
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_SHAPE_UTIL_H_
