// C ABI over the TT embedding launchers (cuda/tt_embedding_kernels.cuh), for
// the ctypes harness (python/gpu_harness/harness.py). Built with nvcc alone by
// python/gpu_harness/build_gpu_harness.sh into libtf_ttemb_gpu_harness.so, beside the
// gather_reduce_sum C ABI (gpu_harness_capi.cu). Not part of the op library.
//
// dtype codes: 0 float16, 1 bfloat16, 2 float32, 3 float64.
// index codes: 0 int32, 1 int64.
// Every function returning int returns a cudaError_t value (0 = success).
// Core arrays (cores, indices, values, dense) are HOST arrays of num_cores
// device pointers.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/tt_embedding_kernels.cuh"
#include "python/gpu_harness/capi_util.cuh"

namespace g = tf_ttemb::gpu;

extern "C" {

// Mirrors tf_ttemb::gpu::TTProblem with fixed-width fields.
struct TtembTTProblem {
  int64_t num_cores;
  int64_t num_tables;
  int64_t p[8];
  int64_t q[8];
  int64_t r[9];
};

static bool ToTTProblem(const TtembTTProblem* c, g::TTProblem* p) {
  if (c->num_cores < 2 || c->num_cores > tf_ttemb::kMaxTTCores) return false;
  p->num_cores = static_cast<int>(c->num_cores);
  p->num_tables = c->num_tables;
  for (int k = 0; k < tf_ttemb::kMaxTTCores; ++k) {
    p->p[k] = c->p[k];
    p->q[k] = c->q[k];
  }
  for (int k = 0; k <= tf_ttemb::kMaxTTCores; ++k) p->r[k] = c->r[k];
  return true;
}

static g::UniqueIdsProblem ToUniqueProblem(int64_t nnz, int64_t num_tables, int64_t num_embeddings,
                                           int64_t stride, int32_t has_padding_id,
                                           int64_t padding_id) {
  g::UniqueIdsProblem p;
  p.nnz = nnz;
  p.num_tables = num_tables;
  p.num_embeddings = num_embeddings;
  p.stride = stride;
  p.has_padding_id = has_padding_id != 0;
  p.padding_id = padding_id;
  return p;
}

extern "C++" {  // a template cannot have C linkage
// size(Tag<T>, problem) for the value dtype code; 0 for an unknown dtype or a TT problem
// the kernels refuse (the scratch-size functions below).
template <typename F>
static size_t TTBytes(int dtype, const TtembTTProblem* problem, F&& size) {
  g::TTProblem p;
  if (!ToTTProblem(problem, &p)) return 0;
  return tf_ttemb::capi::WithValueType(dtype, size_t{0},
                                       [&](auto t) -> size_t { return size(t, p); });
}

// The error launch(Tag<T>, problem) returns for the value dtype code, as an int;
// cudaErrorInvalidValue for an unknown dtype or a TT problem the kernels refuse.
template <typename F>
static int TTLaunch(int dtype, const TtembTTProblem* problem, F&& launch) {
  g::TTProblem p;
  if (!ToTTProblem(problem, &p)) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(tf_ttemb::capi::WithValueType(
      dtype, cudaErrorInvalidValue, [&](auto t) -> cudaError_t { return launch(t, p); }));
}
}

int ttemb_tt_report_bytes(void) { return static_cast<int>(sizeof(tf_ttemb::TTReport)); }

size_t ttemb_tt_unique_scratch_bytes(int index_dtype, int64_t nnz, int64_t num_tables,
                                     int64_t num_embeddings, int64_t stride, int32_t has_padding_id,
                                     int64_t padding_id) {
  const g::UniqueIdsProblem p =
      ToUniqueProblem(nnz, num_tables, num_embeddings, stride, has_padding_id, padding_id);
  return tf_ttemb::capi::WithIndexType(index_dtype, size_t{0}, [&](auto i) -> size_t {
    return g::UniqueIdsScratchBytes<typename decltype(i)::type>(p);
  });
}

int ttemb_tt_unique(int index_dtype, int64_t nnz, int64_t num_tables, int64_t num_embeddings,
                    int64_t stride, int32_t has_padding_id, int64_t padding_id, const void* ids,
                    const int64_t* table_splits, int64_t* unique_ids, void* slots, void* report,
                    void* scratch, size_t scratch_bytes, void* stream) {
  const g::UniqueIdsProblem p =
      ToUniqueProblem(nnz, num_tables, num_embeddings, stride, has_padding_id, padding_id);
  return static_cast<int>(
      tf_ttemb::capi::WithIndexType(index_dtype, cudaErrorInvalidValue, [&](auto i) {
        using I = typename decltype(i)::type;
        return g::LaunchUniqueIds<I>(p, static_cast<const I*>(ids), table_splits, unique_ids,
                                     static_cast<I*>(slots),
                                     static_cast<tf_ttemb::TTReport*>(report), scratch,
                                     scratch_bytes, static_cast<cudaStream_t>(stream));
      }));
}

size_t ttemb_tt_rows_scratch_bytes(int dtype, const TtembTTProblem* problem, int64_t max_ids) {
  return TTBytes(dtype, problem, [&](auto t, const g::TTProblem& p) {
    return g::RowsScratchBytes<typename decltype(t)::type>(p, max_ids);
  });
}

int ttemb_tt_rows(int dtype, const TtembTTProblem* problem, const int64_t* ids, int64_t max_ids,
                  const int64_t* num_ids, const void* const* cores, void* rows, void* report,
                  void* scratch, size_t scratch_bytes, void* stream) {
  return TTLaunch(dtype, problem, [&](auto t, const g::TTProblem& p) {
    using T = typename decltype(t)::type;
    return g::LaunchRows<T>(p, ids, max_ids, num_ids, reinterpret_cast<const T* const*>(cores),
                            static_cast<T*>(rows), static_cast<tf_ttemb::TTReport*>(report),
                            scratch, scratch_bytes, static_cast<cudaStream_t>(stream));
  });
}

size_t ttemb_tt_rows_grad_scratch_bytes(int dtype, const TtembTTProblem* problem, int64_t max_ids) {
  return TTBytes(dtype, problem, [&](auto t, const g::TTProblem& p) {
    return g::RowsGradScratchBytes<typename decltype(t)::type>(p, max_ids);
  });
}

// The index part alone (Prepare's scratch when Compute gets its own work buffer).
size_t ttemb_tt_rows_grad_prepare_scratch_bytes(int dtype, const TtembTTProblem* problem,
                                                int64_t max_ids) {
  return TTBytes(dtype, problem, [&](auto t, const g::TTProblem& p) {
    return g::RowsGradPrepareScratchBytes<typename decltype(t)::type>(p, max_ids);
  });
}

// Compute's work buffer for a host copy of Prepare's report (null: the upper bound).
size_t ttemb_tt_rows_grad_work_bytes(int dtype, const TtembTTProblem* problem, int64_t max_ids,
                                     const void* prepared) {
  return TTBytes(dtype, problem, [&](auto t, const g::TTProblem& p) {
    return g::RowsGradWorkBytes<typename decltype(t)::type>(
        p, max_ids, static_cast<const tf_ttemb::TTReport*>(prepared));
  });
}

int ttemb_tt_rows_grad_prepare(int dtype, const TtembTTProblem* problem, const int64_t* ids,
                               int64_t max_ids, const int64_t* num_ids, void* report, void* scratch,
                               size_t scratch_bytes, void* stream) {
  return TTLaunch(dtype, problem, [&](auto t, const g::TTProblem& p) {
    return g::LaunchRowsGradPrepare<typename decltype(t)::type>(
        p, ids, max_ids, num_ids, static_cast<tf_ttemb::TTReport*>(report), scratch, scratch_bytes,
        static_cast<cudaStream_t>(stream));
  });
}

// Either indices and values (compact form) or dense is non-null. work null: the work
// part is carved from scratch (RowsGradScratchBytes); else prepared is a host copy of
// Prepare's report (or null) and work holds RowsGradWorkBytes(prepared) bytes.
int ttemb_tt_rows_grad_compute(int dtype, const TtembTTProblem* problem, const int64_t* ids,
                               int64_t max_ids, const int64_t* num_ids, const void* const* cores,
                               const void* grad, int64_t* const* indices, void* const* values,
                               void* const* dense, void* scratch, size_t scratch_bytes,
                               const void* prepared, void* work, size_t work_bytes, void* stream) {
  return TTLaunch(dtype, problem, [&](auto t, const g::TTProblem& p) {
    using T = typename decltype(t)::type;
    return g::LaunchRowsGradCompute<T>(
        p, ids, max_ids, num_ids, reinterpret_cast<const T* const*>(cores),
        static_cast<const T*>(grad), indices, reinterpret_cast<T* const*>(values),
        reinterpret_cast<T* const*>(dense), scratch, scratch_bytes,
        static_cast<const tf_ttemb::TTReport*>(prepared), work, work_bytes,
        static_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"
