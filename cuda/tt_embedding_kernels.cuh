// CUDA kernels of the TT embedding family (TTUniqueIds, TTRows, TTRowsGrad)
// behind plain launcher functions. No TensorFlow headers: the TF GPU
// OpKernels (cc/kernels/tt_embedding_kernels_gpu.cc) and the ctypes harness
// (python/gpu_harness/tt_embedding_capi.cu) both call these. The op semantics and
// the core layout are docs/tt_embedding_contract.md; the bag reduction of a
// TT embedding bag is gather_reduce_sum's (rows [U, D] as params, slots as
// ids, padding_id -1), see cuda/gather_reduce_sum_kernels.cuh.
//
// Conventions (the same as gather_reduce_sum's). Every launcher
//   * runs only on `stream` and allocates nothing: it takes caller-provided
//     device scratch of at least the bytes its *ScratchBytes function returns
//     (256-byte aligned is best; any base works, the launcher aligns);
//   * never reads or writes out of bounds, whatever the ids hold: a bad id
//     is treated as padding (unique ids) or gives a zero row (rows) and is
//     reported;
//   * reports what it found wrong, and the data-dependent sizes, in a
//     TTReport in device memory which the caller copies back when it needs
//     them (one small asynchronous copy + stream sync in the TF glue; see
//     "Data-dependent sizes" below);
//   * returns cudaSuccess, cudaErrorInvalidValue for arguments it cannot take
//     (shapes, too little scratch, more than kMaxTTCores cores), or the first
//     CUDA error of its launches.
// Results are bitwise deterministic: every reduction runs in a fixed order that
// depends only on the ids and shapes, never on timing (no float atomics; the
// only atomics are integer atomicMin for the first bad position).
//
// Value types T: __half, __nv_bfloat16, float, double. Compute type: float
// for the halves and float (plain FMA, no TF32), double for double. Index
// types Tindex (TTUniqueIds' ids and slots): int32_t, int64_t. Global ids
// (unique ids, TTRows/TTRowsGrad ids, core rows) are int64_t.
//
// Data-dependent sizes. TF allocates outputs before computing them, so the
// launchers whose output sizes depend on the data write their results into
// upper-bound-sized buffers and put the exact counts into the TTReport:
//   * TTUniqueIds: LaunchUniqueIds writes the sorted distinct ids into an
//     upper-bound buffer unique_ids [nnz] and report->num_unique = U. The glue
//     copies the report back (one sync), allocates the output [U] and copies
//     the first U ids (cudaMemcpyAsync device to device) or hands out a slice
//     of the buffer. slots [nnz] has a static size and is final.
//   * TTRows: output [U, D] has a static size (U is ids' length); nothing is
//     read back. For callers that keep U on the device (the harness, whose
//     forward has no host sync at all) every launcher also takes an optional
//     device count `num_ids` (null: all max_ids ids are valid): ids past
//     *num_ids are ignored and their rows are left unwritten.
//   * TTRowsGrad: two launches sharing one scratch, untouched in between:
//     LaunchRowsGradPrepare digitises and sorts the ids and writes
//     report->core_rows[k] = n_k (distinct core rows of core k); the glue copies
//     the report back (one sync), allocates core_grad_indices[k] [n_k] and
//     core_grad_values[k] [n_k, r_k q_k r_{k+1}], then LaunchRowsGradCompute
//     writes them. Compute can instead write the dense gradient of each core
//     [num_tables * p_k, r_k q_k r_{k+1}] (rows not touched are zero), which
//     needs no read-back (the harness's path). The same read-back sizes
//     Compute's float work buffers (RowsGradWorkBytes): what the ids need,
//     not the upper bound for max_ids arbitrary ids.
// The TTRows `saved` output is not produced on GPU (the contract allows an
// empty `saved`); TTRowsGrad recomputes the partial products it needs.

#ifndef TF_TTEMB_CUDA_TT_EMBEDDING_KERNELS_CUH_
#define TF_TTEMB_CUDA_TT_EMBEDDING_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common_types.h"

namespace tf_ttemb {
namespace gpu {

// The cores' limit (kMaxTTCores) and what the device found and counted (TTReport, in
// device memory) are in cuda/common_types.h.

// The factorisation of a (table-batched) TT table, as in the contract.
// p[k], q[k] for k < num_cores; r[0] = r[num_cores] = 1, r[1..num_cores-1]
// the inner ranks. Global ids are in [0, num_tables * prod(p)).
struct TTProblem {
  int num_cores = 0;  // T, 2 <= T <= kMaxTTCores
  int64_t num_tables = 1;
  int64_t p[kMaxTTCores] = {};
  int64_t q[kMaxTTCores] = {};
  int64_t r[kMaxTTCores + 1] = {};
};

// ---------------------------------------------------------------------------
// TTUniqueIds: global id g = table * stride + id of every non-padding entry;
// unique_ids = the sorted distinct g; slots[j] = position of entry j's g in
// unique_ids, -1 for padding entries (and for bad ids, which are reported).
// Entries table_splits[t] .. table_splits[t + 1] - 1 belong to table t.
struct UniqueIdsProblem {
  int64_t nnz = 0;
  int64_t num_tables = 1;
  int64_t num_embeddings = 1;  // valid ids are [0, num_embeddings)
  int64_t stride = 1;          // P >= num_embeddings; num_tables * stride < 2^62
  bool has_padding_id = false;
  int64_t padding_id = -1;
};

template <typename Tindex>
size_t UniqueIdsScratchBytes(const UniqueIdsProblem& p);

template <typename Tindex>
cudaError_t LaunchUniqueIds(const UniqueIdsProblem& p,
                            const Tindex* ids,            // [nnz], device
                            const int64_t* table_splits,  // [num_tables + 1], device;
                                                          //   validated by the caller (0,
                                                          //   non-decreasing, ends at nnz);
                                                          //   clamped to [0, nnz] anyway
                            int64_t* unique_ids,          // [nnz] upper bound; the first
                                                          //   report->num_unique are written
                            Tindex* slots,                // [nnz]
                            TTReport* report,             // [1], device: first_bad_index,
                                                          //   bad_index_value, num_unique
                            void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------
// TTRows: rows[j] = row ids[j] of the TT table (any order, duplicates allowed).
// Level by level (t = 1 .. T-1) the distinct prefixes i_0..i_t of consecutive
// ids are found, and each prefix's partial product P_t = P_{t-1} @ G_t[i_t]
// is computed once; with sorted ids (TTUniqueIds' output) every distinct
// prefix is computed once per call. Memory is bounded by processing the ids
// in chunks (the scratch is sized for a chunk, not for max_ids).
// cores: a HOST array of num_cores DEVICE pointers, core k
// [num_tables * p_k, r_k * q_k * r_{k+1}].
template <typename T>
size_t RowsScratchBytes(const TTProblem& p, int64_t max_ids);

template <typename T>
cudaError_t LaunchRows(const TTProblem& p,
                       const int64_t* ids,  // [max_ids], device
                       int64_t max_ids,
                       const int64_t* num_ids,  // [1], device, <= max_ids; or null (= max_ids)
                       const T* const* cores,   // host array [num_cores] of device pointers
                       T* rows,                 // [max_ids, D], device; rows of bad ids are 0
                       TTReport* report,        // [1], device: first_bad_index, bad_index_value,
                                                //   num_ids
                       void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------
// TTRowsGrad: given grad = dL/drows [U, D], the gradient of every core as
// (sorted distinct core rows t * p_k + d, values [n_k, r_k q_k r_{k+1}]), or
// dense. Per level the core gradient of a core row is summed over the
// prefixes that use it, in prefix order (sorted by a stable radix sort,
// split into fixed-length pieces combined in piece order): deterministic,
// no atomics. Ids of any order; bad ids contribute nothing and are reported.
//
// Scratch. Two parts: the index part (levels, sorts, piece lists; ~100 bytes
// per id), written by Prepare and read by Compute, and Compute's float work
// part (the partial products of levels 1 .. T-2 and their gradients, one per
// prefix item, and the pieces of the fixed-order sums). For ids of any order
// the work part's upper bound grows with max_ids times the partial products'
// size (FBTT's shape, 1.24M ids: 8.0 GB); for sorted distinct ids (TTUniqueIds'
// output) the items are the distinct prefixes, and Prepare reports the exact
// need in report->work_items / work_values (the same ids: 425 MB).
//   * one buffer: scratch >= RowsGradScratchBytes (index part + work part at
//     its upper bound), work = null; nothing has to be read back;
//   * two buffers: scratch >= RowsGradPrepareScratchBytes (index part) for
//     Prepare and Compute, and, after Prepare's report is read back,
//     work >= RowsGradWorkBytes(p, max_ids, &that_report) for Compute.
template <typename T>
size_t RowsGradScratchBytes(const TTProblem& p, int64_t max_ids);

template <typename T>
size_t RowsGradPrepareScratchBytes(const TTProblem& p, int64_t max_ids);

// prepared: a host copy of the report Prepare wrote for these ids, or null (the
// upper bound).
template <typename T>
size_t RowsGradWorkBytes(const TTProblem& p, int64_t max_ids, const TTReport* prepared);

template <typename T>
cudaError_t LaunchRowsGradPrepare(const TTProblem& p,
                                  const int64_t* ids,  // [max_ids], device
                                  int64_t max_ids,
                                  const int64_t* num_ids,  // [1], device, or null
                                  TTReport* report,        // [1], device: core_rows[k] = n_k,
                                                           //   first_bad_index, bad_index_value,
                                                           //   num_ids, work_items, work_values
                                  void* scratch, size_t scratch_bytes, cudaStream_t stream);

// Exactly one of (core_indices and core_values) or core_dense is non-null.
// core_indices[k] [n_k] int64, core_values[k] [n_k, width_k],
// core_dense[k] [num_tables * p_k, width_k]: HOST arrays of num_cores DEVICE
// pointers (a pointer may be null only where n_k == 0).
template <typename T>
cudaError_t LaunchRowsGradCompute(const TTProblem& p,
                                  const int64_t* ids,  // [max_ids], device (same as Prepare)
                                  int64_t max_ids,
                                  const int64_t* num_ids,  // [1], device, or null (same as Prepare)
                                  const T* const* cores,   // host array [num_cores]
                                  const T* grad,           // [max_ids, D], device
                                  int64_t* const* core_indices,  // host array [num_cores] or null
                                  T* const* core_values,         // host array [num_cores] or null
                                  T* const* core_dense,          // host array [num_cores] or null
                                  void* scratch, size_t scratch_bytes,  // Prepare's, untouched
                                  const TTReport* prepared,  // HOST copy of Prepare's report
                                                             //   (used only with work), or null
                                  void* work, size_t work_bytes,  // null: carved from scratch
                                  cudaStream_t stream);

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_TT_EMBEDDING_KERNELS_CUH_
