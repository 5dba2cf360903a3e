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

namespace {

using tf_ttemb::gpu::kMaxTTCores;
using tf_ttemb::gpu::TTProblem;
using tf_ttemb::gpu::TTReport;
using tf_ttemb::gpu::UniqueIdsProblem;

template <typename T>
struct Tag {
  using type = T;
};

template <typename F>
bool DispatchValue(int dtype, F&& f) {
  switch (dtype) {
    case 0:
      f(Tag<__half>{});
      return true;
    case 1:
      f(Tag<__nv_bfloat16>{});
      return true;
    case 2:
      f(Tag<float>{});
      return true;
    case 3:
      f(Tag<double>{});
      return true;
    default:
      return false;
  }
}

template <typename F>
bool DispatchIndex(int index_dtype, F&& f) {
  if (index_dtype == 0) {
    f(Tag<int32_t>{});
    return true;
  }
  if (index_dtype == 1) {
    f(Tag<int64_t>{});
    return true;
  }
  return false;
}

}  // namespace

extern "C" {

// Mirrors tf_ttemb::gpu::TTProblem with fixed-width fields.
struct TtembTTProblem {
  int64_t num_cores;
  int64_t num_tables;
  int64_t p[8];
  int64_t q[8];
  int64_t r[9];
};

static bool ToTTProblem(const TtembTTProblem* c, TTProblem* p) {
  if (c->num_cores < 2 || c->num_cores > kMaxTTCores) return false;
  p->num_cores = static_cast<int>(c->num_cores);
  p->num_tables = c->num_tables;
  for (int k = 0; k < kMaxTTCores; ++k) {
    p->p[k] = c->p[k];
    p->q[k] = c->q[k];
  }
  for (int k = 0; k <= kMaxTTCores; ++k) p->r[k] = c->r[k];
  return true;
}

static UniqueIdsProblem ToUniqueProblem(int64_t nnz, int64_t num_tables, int64_t num_embeddings,
                                        int64_t stride, int32_t has_padding_id,
                                        int64_t padding_id) {
  UniqueIdsProblem p;
  p.nnz = nnz;
  p.num_tables = num_tables;
  p.num_embeddings = num_embeddings;
  p.stride = stride;
  p.has_padding_id = has_padding_id != 0;
  p.padding_id = padding_id;
  return p;
}

// size(Tag<T>, problem) for the value dtype code; 0 for an unknown dtype or a TT problem
// the kernels refuse (the scratch-size functions below).
extern "C++" {  // a template cannot have C linkage
template <typename F>
static size_t TTBytes(int dtype, const TtembTTProblem* problem, F&& size) {
  size_t bytes = 0;
  TTProblem p;
  if (!ToTTProblem(problem, &p)) return 0;
  DispatchValue(dtype, [&](auto t) { bytes = size(t, p); });
  return bytes;
}
}

int ttemb_tt_report_bytes(void) { return static_cast<int>(sizeof(TTReport)); }

size_t ttemb_tt_unique_scratch_bytes(int index_dtype, int64_t nnz, int64_t num_tables,
                                     int64_t num_embeddings, int64_t stride, int32_t has_padding_id,
                                     int64_t padding_id) {
  size_t bytes = 0;
  const UniqueIdsProblem p =
      ToUniqueProblem(nnz, num_tables, num_embeddings, stride, has_padding_id, padding_id);
  DispatchIndex(index_dtype, [&](auto i) {
    bytes = tf_ttemb::gpu::UniqueIdsScratchBytes<typename decltype(i)::type>(p);
  });
  return bytes;
}

int ttemb_tt_unique(int index_dtype, int64_t nnz, int64_t num_tables, int64_t num_embeddings,
                    int64_t stride, int32_t has_padding_id, int64_t padding_id, const void* ids,
                    const int64_t* table_splits, int64_t* unique_ids, void* slots, void* report,
                    void* scratch, size_t scratch_bytes, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  const UniqueIdsProblem p =
      ToUniqueProblem(nnz, num_tables, num_embeddings, stride, has_padding_id, padding_id);
  DispatchIndex(index_dtype, [&](auto i) {
    using I = typename decltype(i)::type;
    err = tf_ttemb::gpu::LaunchUniqueIds<I>(
        p, static_cast<const I*>(ids), table_splits, unique_ids, static_cast<I*>(slots),
        static_cast<TTReport*>(report), scratch, scratch_bytes, static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

size_t ttemb_tt_rows_scratch_bytes(int dtype, const TtembTTProblem* problem, int64_t max_ids) {
  return TTBytes(dtype, problem, [&](auto t, const TTProblem& p) {
    return tf_ttemb::gpu::RowsScratchBytes<typename decltype(t)::type>(p, max_ids);
  });
}

int ttemb_tt_rows(int dtype, const TtembTTProblem* problem, const int64_t* ids, int64_t max_ids,
                  const int64_t* num_ids, const void* const* cores, void* rows, void* report,
                  void* scratch, size_t scratch_bytes, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  TTProblem p;
  if (!ToTTProblem(problem, &p)) return static_cast<int>(err);
  DispatchValue(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    err = tf_ttemb::gpu::LaunchRows<T>(
        p, ids, max_ids, num_ids, reinterpret_cast<const T* const*>(cores), static_cast<T*>(rows),
        static_cast<TTReport*>(report), scratch, scratch_bytes, static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

size_t ttemb_tt_rows_grad_scratch_bytes(int dtype, const TtembTTProblem* problem, int64_t max_ids) {
  return TTBytes(dtype, problem, [&](auto t, const TTProblem& p) {
    return tf_ttemb::gpu::RowsGradScratchBytes<typename decltype(t)::type>(p, max_ids);
  });
}

// The index part alone (Prepare's scratch when Compute gets its own work buffer).
size_t ttemb_tt_rows_grad_prepare_scratch_bytes(int dtype, const TtembTTProblem* problem,
                                                int64_t max_ids) {
  return TTBytes(dtype, problem, [&](auto t, const TTProblem& p) {
    return tf_ttemb::gpu::RowsGradPrepareScratchBytes<typename decltype(t)::type>(p, max_ids);
  });
}

// Compute's work buffer for a host copy of Prepare's report (null: the upper bound).
size_t ttemb_tt_rows_grad_work_bytes(int dtype, const TtembTTProblem* problem, int64_t max_ids,
                                     const void* prepared) {
  return TTBytes(dtype, problem, [&](auto t, const TTProblem& p) {
    return tf_ttemb::gpu::RowsGradWorkBytes<typename decltype(t)::type>(
        p, max_ids, static_cast<const TTReport*>(prepared));
  });
}

int ttemb_tt_rows_grad_prepare(int dtype, const TtembTTProblem* problem, const int64_t* ids,
                               int64_t max_ids, const int64_t* num_ids, void* report, void* scratch,
                               size_t scratch_bytes, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  TTProblem p;
  if (!ToTTProblem(problem, &p)) return static_cast<int>(err);
  DispatchValue(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    err = tf_ttemb::gpu::LaunchRowsGradPrepare<T>(p, ids, max_ids, num_ids,
                                                  static_cast<TTReport*>(report), scratch,
                                                  scratch_bytes, static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

// Either indices and values (compact form) or dense is non-null. work null: the work
// part is carved from scratch (RowsGradScratchBytes); else prepared is a host copy of
// Prepare's report (or null) and work holds RowsGradWorkBytes(prepared) bytes.
int ttemb_tt_rows_grad_compute(int dtype, const TtembTTProblem* problem, const int64_t* ids,
                               int64_t max_ids, const int64_t* num_ids, const void* const* cores,
                               const void* grad, int64_t* const* indices, void* const* values,
                               void* const* dense, void* scratch, size_t scratch_bytes,
                               const void* prepared, void* work, size_t work_bytes, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  TTProblem p;
  if (!ToTTProblem(problem, &p)) return static_cast<int>(err);
  DispatchValue(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    err = tf_ttemb::gpu::LaunchRowsGradCompute<T>(
        p, ids, max_ids, num_ids, reinterpret_cast<const T* const*>(cores),
        static_cast<const T*>(grad), indices, reinterpret_cast<T* const*>(values),
        reinterpret_cast<T* const*>(dense), scratch, scratch_bytes,
        static_cast<const TTReport*>(prepared), work, work_bytes,
        static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

}  // extern "C"
