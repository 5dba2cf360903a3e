// Shared pieces of the TT embedding kernels: the factorisation parsed from the
// op attrs, the input validation (the GPU kernels' own limits included) and
// the error messages, for the OpKernels of both devices (tt_embedding_op.h),
// the CPU kernels (tt_embedding_cpu.h) and the GPU glue
// (tt_embedding_kernels_gpu.cc), so that both reject bad input with the same
// messages. Checks of values that live in device memory on GPU (ids) are split into the check
// itself (CPU) and the message (both: the GPU glue raises it from what the device reported).

#ifndef TF_TTEMB_CC_KERNELS_TT_EMBEDDING_KERNELS_H_
#define TF_TTEMB_CC_KERNELS_TT_EMBEDDING_KERNELS_H_

#include <cstdint>
#include <vector>

#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cuda/common_types.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
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

// Checks the values of host-resident ids [U]: in [0, shape.num_ids()).
Status ValidateGlobalIdValues(const Tensor& ids, const TTShape& shape);

// Checks that ids is a vector [U] (its values are not read).
Status ValidateGlobalIdsShape(const Tensor& ids);

// The host checks of TTRows and TTRowsGrad before any id is read: the cores'
// shapes (the `cores` input list, set), then the ids' shape (input 0).
Status ValidateRowsInputs(OpKernelContext* ctx, const TTShape& shape, OpInputList* cores);

// The message for ids[position] = value outside [0, limit).
Status GlobalIdError(int64_t position, int64_t value, int64_t limit);

// What a GPU TT op found (TTReport, cuda/common_types.h), with the CPU kernels' message for a
// bad global id of TTRows / TTRowsGrad: valid ids are [0, limit).
Status GlobalIdsReportStatus(const TTReport& report, int64_t limit);

// TfTtemb>CheckTTRowsReport: its attr (the ids' bound) and its input, a TTRows report:
// [0] (from the CPU kernel, which checks the ids itself; `*empty` is set) or a TTReport.
Status GetTTRowsReportAttrs(OpKernelConstruction* ctx, int64_t* limit);
Status ValidateTTReportInput(const Tensor& report, bool* empty);

// Checks that TTRowsGrad's grad is [num_ids, D].
Status ValidateRowsGradShape(const Tensor& grad, int64_t num_ids, const TTShape& shape);

// TTRowsBagsGrad's attrs beyond the factorisation: the combiner and has_weights
// (its slots' padding is -1, set here).
Status GetRowsBagsGradAttrs(OpKernelConstruction* ctx, BagAttrs* attrs);

// The host shape checks of TTRowsBagsGrad's bag inputs (grad [B, D], slots,
// row_splits [B + 1], weights), after ValidateRowsInputs; sets `shapes`. The
// slots' values are checked by the kernel (in [0, U) or -1).
Status ValidateRowsBagsGradShapes(OpKernelContext* ctx, const TTShape& shape, const BagAttrs& attrs,
                                  int64_t* num_bags, int64_t* nnz);

// ---------------------------------------------------------------------------
// The GPU kernels' own limits, checked on the host by the GPU ops only.

// Most ids (or other entries) a GPU launcher sorts and scans: int32 positions.
constexpr int64_t kMaxGpuIds = (int64_t{1} << 31) - 3;

// (Most cores of a GPU TT kernel: kMaxTTCores, cuda/common_types.h.)

// The error for more than kMaxGpuIds `what` of `op`.
Status GpuIdsLimit(const char* op, const char* what, int64_t count);

// The factorisation's limits on the GPU (cores, row width), checked in the
// kernel constructor.
Status ValidateGpuTTShape(const TTShape& shape);

// ---------------------------------------------------------------------------
// TTUniqueIds

struct UniqueIdsAttrs {
  int64_t num_embeddings = 1;
  int64_t stride = 1;  // P: global id = table * stride + id
  BagAttrs bag;        // the padding id (combiner and weights unused)
};

// Reads and checks num_embeddings, stride, padding_id and has_padding_id.
Status GetUniqueIdsAttrs(OpKernelConstruction* ctx, UniqueIdsAttrs* attrs);

// Checks ids [nnz] (shape only: the ids' values are checked where they live)
// and the host-resident table_splits [num_tables + 1]: 0, non-decreasing,
// ending at nnz, with num_tables * stride representable.
Status ValidateUniqueIdsInputs(const Tensor& ids, const Tensor& table_splits,
                               const UniqueIdsAttrs& attrs);

// The GPU kernel's limits on the ids' count and on num_tables * stride (the
// CPU check allows 2^62 itself), after ValidateUniqueIdsInputs.
Status ValidateGpuUniqueIdsSizes(int64_t nnz, int64_t num_tables, const UniqueIdsAttrs& attrs);

// ---------------------------------------------------------------------------
// TTCacheCount

// Checks that ids is a vector [n].
Status ValidateCacheCountIds(const Tensor& ids);

// Looks up the keys and counts variables (inputs 0 and 1): initialized int64
// vectors, two different variables.
Status LookupCacheTables(OpKernelContext* ctx, core::RefCountPtr<Var>* keys,
                         core::RefCountPtr<Var>* counts);

// With both variables' locks held: checks that they have the same size.
Status ValidateCacheTableSizes(Var* keys, Var* counts);

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_TT_EMBEDDING_KERNELS_H_
