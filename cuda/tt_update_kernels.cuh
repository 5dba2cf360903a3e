// CUDA launcher of TTCacheCount's frequency counting, the part of the device-side TT
// row cache that the op library calls (cc/kernels/tt_embedding_kernels_gpu.cc). Plain
// launcher, no TensorFlow headers. The fused TT update and the cache's lookup,
// populate and row select, which only the ctypes harness calls, are
// python/gpu_harness/tt_cache_kernels.cuh.
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

#ifndef TF_TTEMB_CUDA_TT_UPDATE_KERNELS_CUH_
#define TF_TTEMB_CUDA_TT_UPDATE_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tf_ttemb {
namespace gpu {

// ---------------------------------------------------------------------------
// Frequency counting (TTCacheCount): a bounded table of `table_size` slots,
// keys [H] and counts [H] (int64, key < 0 = empty), in sets of min(32, H)
// consecutive ways (the last set holds the remainder); the set of id x is
// splitmix64-finalizer(x) mod num_sets. Each distinct id of the batch, in
// ascending order, adds its multiplicity m: found in its set -> count += m;
// else the first empty way takes it with count m; else the way with the
// smallest count (lowest way on ties) is replaced: key = id, count += m.
//
// Input: the raw ids of the batch [n] (the same tensor the CPU op takes;
// negative ids, e.g. -1 for padding, are skipped). The ids are sorted and
// run-length encoded on the device, the runs grouped by set (stable, so
// ascending within a set), and one warp per set applies its runs in
// ascending order with the set's 32 ways in registers: the result equals the
// CPU kernel's bit for bit.
//
// id_bound: a host bound on the ids (every non-negative id < id_bound; the
// layer's num_tables * prod(p)), which cuts the radix sort to the bits it
// needs; 0 = unknown (a full 64-bit sort). An id >= id_bound makes the counts
// unspecified (never an out-of-bounds access).
size_t CacheCountScratchBytes(int64_t n, int64_t table_size, int64_t id_bound);

cudaError_t LaunchCacheCount(const int64_t* ids,  // [n]
                             int64_t n, int64_t id_bound,
                             int64_t* keys,    // [table_size], in place
                             int64_t* counts,  // [table_size], in place
                             int64_t table_size, void* scratch, size_t scratch_bytes,
                             cudaStream_t stream);

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_TT_UPDATE_KERNELS_CUH_
