// C ABI over the launchers of cuda/tt_update_kernels.cuh (TTCacheCount's counting) and
// python/gpu_harness/tt_cache_kernels.cuh (fused TT update, the rest of the device-side
// row cache), for the ctypes check python/gpu_harness/check_tt_update.py.
// Built by python/gpu_harness/build_gpu_harness.sh into libtf_ttemb_gpu_harness.so beside
// the other harness files; not part of the op library.
//
// dtype codes: 0 float16, 1 bfloat16, 2 float32, 3 float64.
// Every function returning int returns a cudaError_t value (0 = success).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/tt_update_kernels.cuh"
#include "python/gpu_harness/capi_util.cuh"
#include "python/gpu_harness/tt_cache_kernels.cuh"

namespace g = tf_ttemb::gpu;

extern "C" {

// Mirrors tf_ttemb::gpu::SparseUpdateSlice<T> with untyped pointers.
struct TtupdSlice {
  void* var;
  void* accum;
  const int64_t* rows;
  const void* grad;
  const int64_t* num_valid;
  int64_t num_rows;
  int64_t width;
  int64_t n;
};

int ttupd_max_slices() { return g::kMaxUpdateSlices; }

int ttupd_sparse_update(int dtype, int optimizer, const TtupdSlice* slices, int num_slices,
                        double learning_rate, double eps, void* stream) {
  if (num_slices < 0 || num_slices > g::kMaxUpdateSlices) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return tf_ttemb::capi::WithValueType(
      dtype, static_cast<int>(cudaErrorInvalidValue), [&](auto tag) {
        using T = typename decltype(tag)::type;
        g::SparseUpdateSlice<T> s[g::kMaxUpdateSlices];
        for (int k = 0; k < num_slices; ++k) {
          s[k].var = static_cast<T*>(slices[k].var);
          s[k].accum = static_cast<T*>(slices[k].accum);
          s[k].rows = slices[k].rows;
          s[k].grad = static_cast<const T*>(slices[k].grad);
          s[k].num_valid = slices[k].num_valid;
          s[k].num_rows = slices[k].num_rows;
          s[k].width = slices[k].width;
          s[k].n = slices[k].n;
        }
        return static_cast<int>(g::LaunchSparseUpdate<T>(static_cast<g::SparseOptimizer>(optimizer),
                                                         s, num_slices, learning_rate, eps,
                                                         static_cast<cudaStream_t>(stream)));
      });
}

int ttupd_select_rows(int dtype, int64_t n, int64_t width, const void* a, int64_t a_rows,
                      const int64_t* sel_a, const void* b, int64_t b_rows, const int64_t* sel_b,
                      void* out, void* stream) {
  return tf_ttemb::capi::WithValueType(
      dtype, static_cast<int>(cudaErrorInvalidValue), [&](auto tag) {
        using T = typename decltype(tag)::type;
        return static_cast<int>(g::LaunchSelectRows<T>(
            n, width, static_cast<const T*>(a), a_rows, sel_a, static_cast<const T*>(b), b_rows,
            sel_b, static_cast<T*>(out), static_cast<cudaStream_t>(stream)));
      });
}

size_t ttupd_cache_count_scratch_bytes(int64_t n, int64_t table_size, int64_t id_bound) {
  return g::CacheCountScratchBytes(n, table_size, id_bound);
}

int ttupd_cache_count(const int64_t* ids, int64_t n, int64_t id_bound, int64_t* keys,
                      int64_t* counts, int64_t table_size, void* scratch, size_t scratch_bytes,
                      void* stream) {
  return static_cast<int>(g::LaunchCacheCount(ids, n, id_bound, keys, counts, table_size, scratch,
                                              scratch_bytes, static_cast<cudaStream_t>(stream)));
}

size_t ttupd_cache_lookup_scratch_bytes(int64_t n) { return g::CacheLookupScratchBytes(n); }

int ttupd_cache_lookup(const int64_t* ids, int64_t n, const int64_t* cache_ids, int64_t cache_size,
                       int64_t miss_pad_id, int64_t* position, int64_t* miss_rank,
                       int64_t* miss_ids, int64_t* miss_at, int64_t* hit_at, int64_t* hit_pos,
                       int64_t* counts, void* scratch, size_t scratch_bytes, void* stream) {
  const g::CacheLookupResult out{position, miss_rank, miss_ids, miss_at, hit_at, hit_pos};
  return static_cast<int>(g::LaunchCacheLookup(ids, n, cache_ids, cache_size, miss_pad_id, out,
                                               counts, scratch, scratch_bytes,
                                               static_cast<cudaStream_t>(stream)));
}

size_t ttupd_cache_populate_scratch_bytes(int64_t table_size, int64_t cache_size) {
  return g::CachePopulateScratchBytes(table_size, cache_size);
}

int ttupd_cache_populate(const int64_t* keys, const int64_t* counts, int64_t table_size,
                         const int64_t* old_ids, int64_t cache_size, int64_t fresh_pad_id,
                         int64_t* new_ids, int64_t* src, int64_t* fresh_rank, int64_t* fresh_ids,
                         int64_t* fresh_at, int64_t* num_fresh, void* scratch, size_t scratch_bytes,
                         void* stream) {
  const g::CacheLookupResult fresh{src, fresh_rank, fresh_ids, fresh_at};
  return static_cast<int>(g::LaunchCachePopulate(keys, counts, table_size, old_ids, cache_size,
                                                 fresh_pad_id, new_ids, fresh, num_fresh, scratch,
                                                 scratch_bytes, static_cast<cudaStream_t>(stream)));
}

const char* ttupd_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
