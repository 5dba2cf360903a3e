// Shared pieces of the TT embedding kernels: the factorisation parsed from the
// op attrs and the input validation, for the CPU kernels and (later) the GPU
// glue, so that both reject bad input with the same messages.

#ifndef TF_TTEMB_CC_KERNELS_TT_EMBEDDING_KERNELS_H_
#define TF_TTEMB_CC_KERNELS_TT_EMBEDDING_KERNELS_H_

#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// The factorisation of a (table-batched) TT table. Index k runs over cores.
struct TTShape {
  int num_cores = 0;
  int64_t num_tables = 1;
  std::vector<int64_t> p;       // [num_cores] row factors
  std::vector<int64_t> q;       // [num_cores] column factors
  std::vector<int64_t> r;       // [num_cores + 1] ranks, r[0] = r[T] = 1
  std::vector<int64_t> stride;  // [num_cores] L_k = prod_{j > k} p_j
  std::vector<int64_t> width;   // [num_cores] r_k * q_k * r_{k+1}
  std::vector<int64_t> cols;    // [num_cores] q_0 * ... * q_k
  int64_t rows_per_table = 1;   // P = prod(p)
  int64_t dim = 1;              // D = prod(q)

  // Global ids are in [0, num_ids()).
  int64_t num_ids() const { return num_tables * rows_per_table; }
  // Row of core k holding the digit of global id `id` at level k.
  int64_t CoreRow(int64_t id, int k) const {
    return (id / rows_per_table) * p[k] + (id / stride[k]) % p[k];
  }
  // Key of the leading digits i_0..i_k of `id` (with its table): ids with the
  // same key share the partial product P_k.
  int64_t PrefixKey(int64_t id, int k) const { return id / stride[k]; }
};

// Reads and checks p_shapes, q_shapes, ranks, num_tables and num_cores.
Status GetTTShape(OpKernelConstruction* ctx, TTShape* shape);

// Checks that core k is [num_tables * p_k, r_k q_k r_{k+1}].
Status ValidateCore(const Tensor& core, int k, const TTShape& shape);

// Checks ids [U] and, if any, their values in [0, shape.num_ids()).
Status ValidateGlobalIds(const Tensor& ids, const TTShape& shape);

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_TT_EMBEDDING_KERNELS_H_
