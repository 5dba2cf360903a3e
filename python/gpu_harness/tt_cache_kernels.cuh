// CUDA kernels for the sparse side of TT embedding bags that only the ctypes harness
// calls (python/gpu_harness/tt_update_capi.cu): the fused SGD / Adagrad update of core
// rows (and cache rows), and the device-side row cache's lookup, populate and row
// gather/stitch. Its frequency counting (TTCacheCount), which the op library calls,
// is cuda/tt_update_kernels.cuh. Plain launchers, no TensorFlow headers.
//
// Semantics are those of tf_ttemb/layers/tt_embedding_bag.py (the TF-op
// composition the layers use) and of the CPU TTCacheCount kernel
// (cc/kernels/tt_embedding_kernels.cc); see docs/tt_embedding_contract.md.
//
// Every launcher
//   * runs only on `stream`, allocates nothing and never synchronises the
//     host: counts that depend on the data (misses, fresh cache rows) stay in
//     device memory, and the launchers that consume them take a host-side
//     upper bound plus the device count;
//   * takes caller scratch of at least the bytes its *ScratchBytes function
//     returns (any alignment; 256 bytes of slack are included);
//   * never reads or writes out of bounds, whatever the indices hold: row
//     indices outside [0, num_rows) are skipped;
//   * returns cudaSuccess, cudaErrorInvalidValue for arguments it cannot take
//     (negative sizes, null pointers that are needed, too many cores), or the
//     first CUDA error of its launches.
// Results are bitwise deterministic (integer scans and stable radix sorts,
// elementwise float math, no atomics on floats or on the tables).
//
// Supported T: __half, __nv_bfloat16, float, double. Halves are loaded into
// float, updated in float and rounded once when stored; double is updated in
// double. Index arrays are int64.

#ifndef TF_TTEMB_PYTHON_GPU_HARNESS_TT_CACHE_KERNELS_CUH_
#define TF_TTEMB_PYTHON_GPU_HARNESS_TT_CACHE_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tf_ttemb {
namespace gpu {

// ---------------------------------------------------------------------------
// Fused sparse update (the layers' `_apply_update` for an IndexedSlices
// gradient with distinct rows, e.g. TTRowsGrad's core gradients or a cache
// gradient):
//   SGD:     var[r] -= lr * g
//   Adagrad: acc[r] += g * g;  var[r] -= lr * g / (sqrt(acc[r]) + eps)
// elementwise (the accumulator has the variable's shape and dtype), computed
// exactly as the TF ops compute it: every product, sum, square root and
// quotient rounded on its own (no FMA contraction), the new accumulator
// rounded to T before the square root reads it. For float and double the
// result is bitwise the one of the TF-op composition; halves differ from
// TF's half arithmetic only by computing in float (eps is not flushed to a
// half zero).
//
// The learning rate and eps are host values (the layer's constants), rounded
// to the compute type (float, or double for double) once per launch.

enum class SparseOptimizer : int { kSgd = 0, kAdagrad = 1 };

// One variable to update: `grad` row i updates `var` row `rows[i]`.
template <typename T>
struct SparseUpdateSlice {
  T* var = nullptr;               // [num_rows, width], updated in place
  T* accum = nullptr;             // [num_rows, width], Adagrad only (else null)
  const int64_t* rows = nullptr;  // [n], distinct; entries outside [0, num_rows) skipped
  const T* grad = nullptr;        // [n, width]
  int64_t num_rows = 0;
  int64_t width = 0;
  int64_t n = 0;  // rows listed (host upper bound)
  // Optional device count: only the first min(n, *num_valid) rows are used.
  const int64_t* num_valid = nullptr;
};

// Most slices one launch takes (the cores of one TT table, plus its cache).
constexpr int kMaxUpdateSlices = 8;

// Updates `num_slices` variables in one launch. The rows of one slice must be
// distinct (two equal rows would race); slices must not share memory. Every
// listed row is updated for any n and width (grid-stride loops over the rows
// of each slice; a row's columns are walked by a group of threads).
template <typename T>
cudaError_t LaunchSparseUpdate(SparseOptimizer optimizer,
                               const SparseUpdateSlice<T>* slices,  // host array
                               int num_slices, double learning_rate, double eps,
                               cudaStream_t stream);

// ---------------------------------------------------------------------------
// Cache lookup: for each id of `ids` [n] (sorted ascending, distinct; the
// layer's unique ids), its slot in the sorted `cache_ids` [cache_size]
// (empty slots hold kEmptyCacheId at the end) or -1, exactly as the layer's
// `searchsorted` + equality test. Ids outside [0, kEmptyCacheId) are neither
// hits nor misses (position -1, miss_rank -1).
//
// Outputs: `out` (below) and counts[2] = {number of hits, number of misses}.
// `miss_pad_id` lets a caller run a fixed-size [n] row computation over
// miss_ids (e.g. 0, a valid row) without reading the count back.
constexpr int64_t kEmptyCacheId = INT64_MAX;

// What a lookup of n ids writes (all [n], int64, device):
struct CacheLookupResult {
  int64_t* position;           // cache slot of ids[j] or -1
  int64_t* miss_rank;          // rank of ids[j] among the misses, -1 for hits and skipped ids
  int64_t* miss_ids;           // the missed ids, ascending, then the pad id up to n
  int64_t* miss_at;            // their positions j, then -1
  int64_t* hit_at = nullptr;   // positions j of the hits, ascending, then -1 (may be null)
  int64_t* hit_pos = nullptr;  // their cache slots (ascending), then -1 (may be null)
};

size_t CacheLookupScratchBytes(int64_t n);

cudaError_t LaunchCacheLookup(const int64_t* ids,  // [n]
                              int64_t n,
                              const int64_t* cache_ids,  // [cache_size]
                              int64_t cache_size, int64_t miss_pad_id, const CacheLookupResult& out,
                              int64_t* counts,  // [2]
                              void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Row selection, the gather / stitch step of every cache path:
//   out[j] = sel_a[j] >= 0 ? a[sel_a[j]] : (sel_b && sel_b[j] >= 0 ? b[sel_b[j]] : 0)
// for j < n (indices >= the source's row count also give zeros).
//   forward stitch:   sel_a = position (cache_rows), sel_b = miss_rank (rows
//                     computed for miss_ids)
//   populate rows:    sel_a = src (old cache_rows), sel_b = fresh_rank (rows
//                     computed for fresh_ids); empty slots get zeros
//   populate Adagrad: sel_a = src (old accumulator), no b: new rows start at 0
//   gradient split:   sel_a = miss_at (rows of the rows-gradient) -> the
//                     gradient rows of the misses, for TTRowsGrad
// `out` must not overlap a or b.
template <typename T>
cudaError_t LaunchSelectRows(int64_t n, int64_t width, const T* a,
                             int64_t a_rows,              // [a_rows, width]
                             const int64_t* sel_a,        // [n]
                             const T* b, int64_t b_rows,  // [b_rows, width] or null
                             const int64_t* sel_b,        // [n] or null
                             T* out,                      // [n, width]
                             cudaStream_t stream);

// The fused cache-row update needs no own launcher: LaunchSparseUpdate with
// rows = position (the lookup's, -1 for misses: skipped) and grad = the
// rows-gradient [U, D] updates exactly the cache slots that were hit.

// ---------------------------------------------------------------------------
// Cache populate (the layer's cache_populate): ranks the live entries of the
// frequency table (key >= 0 and count > 0) by count descending, then id
// ascending, takes the first cache_size, and sorts them into new_ids
// (kEmptyCacheId fills the remaining slots). Then `fresh` is the lookup of
// new_ids in old_ids (the current sorted cache ids; [cache_size] each, no hit
// lists):
//   src[s]         (position) slot of new_ids[s] in old_ids when the row stays, else -1
//   fresh_rank[s]  (miss_rank) rank of slot s among the newly cached ids, else -1
//   fresh_ids      (miss_ids) the newly cached ids (ascending), then `fresh_pad_id`
//   fresh_at       (miss_at) their slots, then -1
//   num_fresh[1]   how many (device)
// The caller computes TT rows of fresh_ids (all cache_size of them, or
// num_fresh after a read-back) and assembles the new rows and Adagrad state
// with LaunchSelectRows (see above); evicted rows are dropped, so they revert
// to their value in the cores.
size_t CachePopulateScratchBytes(int64_t table_size, int64_t cache_size);

cudaError_t LaunchCachePopulate(const int64_t* keys,    // [table_size]
                                const int64_t* counts,  // [table_size]
                                int64_t table_size,
                                const int64_t* old_ids,  // [cache_size]
                                int64_t cache_size, int64_t fresh_pad_id,
                                int64_t* new_ids,  // [cache_size]
                                const CacheLookupResult& fresh,
                                int64_t* num_fresh,  // [1]
                                void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_PYTHON_GPU_HARNESS_TT_CACHE_KERNELS_CUH_
