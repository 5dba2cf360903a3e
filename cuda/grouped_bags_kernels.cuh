// The CUDA launcher of TfTtemb>GroupBags (cc/ops/grouped_bags_ops.cc): each id
// checked against its own feature's table and offset to the flat table's row,
// the bags reordered example by example. No TensorFlow headers.

#ifndef TF_TTEMB_CUDA_GROUPED_BAGS_KERNELS_CUH_
#define TF_TTEMB_CUDA_GROUPED_BAGS_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common_types.h"

namespace tf_ttemb {
namespace gpu {

// One call: T features of B bags each, nnz entries held by N parts (read end
// to end, PartsCursor). `features` points to 4 * T int64 in device memory:
// num_rows[T], row_offsets[T], padding_ids[T], has_padding_ids[T] (0 or 1).
struct GroupProblem {
  int64_t num_features = 0;  // T
  int64_t batch = 0;         // B
  int64_t nnz = 0;
  const int64_t* features = nullptr;     // [4 * T], device
  int64_t num_parts = 0;                 // N >= 1
  const int64_t* part_starts = nullptr;  // [N + 1], device: part p's first entry
};

size_t GroupBagsScratchBytes(const GroupProblem& p);

// Queues, on `stream`: the report's initialisation, the row_splits checks, the
// example-major row_splits (a scan of the bags' lengths), the entries' copy with
// each id checked (a bad id becomes -1, never read) and the report's last
// words. Weights (and positions) are copied when `weights` is set. Every read is
// kept inside the inputs even for bad row_splits, whose findings the report holds.
template <typename T, typename Tindex>
cudaError_t LaunchGroupBags(const GroupProblem& p,
                            const Tindex* const* ids,   // [N] parts, device
                            const int64_t* row_splits,  // [T * B + 1]
                            const T* weights,           // [nnz] or null
                            int64_t* group_ids,         // [nnz]
                            int64_t* group_row_splits,  // [B * T + 1]
                            T* group_weights,           // [nnz] or null
                            int64_t* positions,         // [nnz] or null
                            GroupReport* report,        // [1], device
                            void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_GROUPED_BAGS_KERNELS_CUH_
