// C ABI over the gather_reduce_sum launchers, for the ctypes harness
// (python/gpu_harness/harness.py), which runs the kernels on a machine without
// TensorFlow. Built with nvcc alone by python/gpu_harness/build_gpu_harness.sh into
// libtf_ttemb_gpu_harness.so. Not part of the op library: Bazel globs only
// cuda/*.cu, not this folder.
//
// dtype codes: 0 float16, 1 bfloat16, 2 float32, 3 float64.
// index codes: 0 int32, 1 int64.
// Every function returning int returns a cudaError_t value (0 = success).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gather_reduce_sum_kernels.cuh"
#include "python/gpu_harness/capi_util.cuh"

namespace g = tf_ttemb::gpu;

extern "C" {

// Mirrors tf_ttemb::gpu::BagProblem with fixed-width fields.
struct TtembProblem {
  int64_t num_rows;
  int64_t dim;
  int64_t num_bags;
  int64_t nnz;
  int64_t padding_id;
  int32_t combiner;  // 0 sum, 1 mean, 2 sqrtn, 3 max
  int32_t has_weights;
  int32_t has_padding_id;
  int32_t reserved;
};

static g::BagProblem ToProblem(const TtembProblem* c) {
  g::BagProblem p;
  p.num_rows = c->num_rows;
  p.dim = c->dim;
  p.num_bags = c->num_bags;
  p.nnz = c->nnz;
  p.padding_id = c->padding_id;
  p.combiner = static_cast<tf_ttemb::Combiner>(c->combiner);
  p.has_weights = c->has_weights != 0;
  p.has_padding_id = c->has_padding_id != 0;
  return p;
}

}  // extern "C"

namespace {

// What `bytes_for(Tag<T>, Tag<Tindex>, problem)` returns for the codes (0 for unknown codes).
template <typename F>
size_t ScratchBytesFor(int dtype, int index_dtype, const TtembProblem* problem, F&& bytes_for) {
  const g::BagProblem p = ToProblem(problem);
  return tf_ttemb::capi::WithTypes(dtype, index_dtype, size_t{0},
                                   [&](auto t, auto i) -> size_t { return bytes_for(t, i, p); });
}

// The error `launch(Tag<T>, Tag<Tindex>, problem)` returns for the codes, as an int
// (cudaErrorInvalidValue for unknown codes).
template <typename F>
int LaunchFor(int dtype, int index_dtype, const TtembProblem* problem, F&& launch) {
  const g::BagProblem p = ToProblem(problem);
  return static_cast<int>(
      tf_ttemb::capi::WithTypes(dtype, index_dtype, cudaErrorInvalidValue,
                                [&](auto t, auto i) -> cudaError_t { return launch(t, i, p); }));
}

}  // namespace

extern "C" {

int ttemb_report_bytes(void) { return static_cast<int>(sizeof(tf_ttemb::DeviceReport)); }

const char* ttemb_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

size_t ttemb_forward_scratch_bytes(int dtype, int index_dtype, const TtembProblem* problem) {
  return ScratchBytesFor(dtype, index_dtype, problem, [](auto t, auto, const g::BagProblem& p) {
    return g::ForwardScratchBytes<typename decltype(t)::type>(p);
  });
}

int ttemb_forward(int dtype, int index_dtype, const TtembProblem* problem, const void* params,
                  const void* ids, const int64_t* splits, const void* weights, void* out,
                  int32_t* argmax, void* report, void* scratch, size_t scratch_bytes,
                  void* stream) {
  return LaunchFor(dtype, index_dtype, problem, [&](auto t, auto i, const g::BagProblem& p) {
    using T = typename decltype(t)::type;
    using I = typename decltype(i)::type;
    return g::LaunchForward<T, I>(p, static_cast<const T*>(params), static_cast<const I*>(ids),
                                  splits, static_cast<const T*>(weights), static_cast<T*>(out),
                                  argmax, static_cast<tf_ttemb::DeviceReport*>(report), scratch,
                                  scratch_bytes, static_cast<cudaStream_t>(stream));
  });
}

size_t ttemb_params_grad_scratch_bytes(int dtype, int index_dtype, const TtembProblem* problem,
                                       int dense, int fused) {
  return ScratchBytesFor(dtype, index_dtype, problem, [&](auto t, auto i, const g::BagProblem& p) {
    return g::ParamsGradScratchBytes<typename decltype(t)::type, typename decltype(i)::type>(
        p, dense != 0, fused != 0);
  });
}

int ttemb_params_grad_prepare(int dtype, int index_dtype, const TtembProblem* problem,
                              const void* ids, const int64_t* splits, const void* weights,
                              void* report, int dense, int fused, void* scratch,
                              size_t scratch_bytes, void* stream) {
  return LaunchFor(dtype, index_dtype, problem, [&](auto t, auto i, const g::BagProblem& p) {
    using T = typename decltype(t)::type;
    using I = typename decltype(i)::type;
    return g::LaunchParamsGradPrepare<T, I>(
        p, static_cast<const I*>(ids), splits, static_cast<const T*>(weights),
        static_cast<tf_ttemb::DeviceReport*>(report), dense != 0, fused != 0, scratch,
        scratch_bytes, static_cast<cudaStream_t>(stream));
  });
}

// Fusion of the weights gradient when weights_grad is not null.
int ttemb_params_grad_reduce(int dtype, int index_dtype, const TtembProblem* problem,
                             const void* grad, const int32_t* argmax, void* unique_ids,
                             void* values, void* dense, const void* fused_params,
                             const void* fused_output, const void* fused_weights,
                             void* weights_grad, void* scratch, size_t scratch_bytes,
                             void* stream) {
  return LaunchFor(dtype, index_dtype, problem, [&](auto t, auto i, const g::BagProblem& p) {
    using T = typename decltype(t)::type;
    using I = typename decltype(i)::type;
    const g::WeightsGradFusion<T> fusion{
        static_cast<const T*>(fused_params), static_cast<const T*>(fused_output),
        static_cast<const T*>(fused_weights), static_cast<T*>(weights_grad)};
    return g::LaunchParamsGradReduce<T, I>(p, static_cast<const T*>(grad), argmax,
                                           static_cast<I*>(unique_ids), static_cast<T*>(values),
                                           static_cast<T*>(dense),
                                           weights_grad != nullptr ? &fusion : nullptr, scratch,
                                           scratch_bytes, static_cast<cudaStream_t>(stream));
  });
}

size_t ttemb_weights_grad_scratch_bytes(int dtype, int index_dtype, const TtembProblem* problem) {
  return ScratchBytesFor(dtype, index_dtype, problem, [](auto t, auto, const g::BagProblem& p) {
    return g::WeightsGradScratchBytes<typename decltype(t)::type>(p);
  });
}

int ttemb_weights_grad(int dtype, int index_dtype, const TtembProblem* problem, const void* grad,
                       const void* params, const void* ids, const int64_t* splits,
                       const void* weights, const void* output, void* weights_grad, void* report,
                       void* scratch, size_t scratch_bytes, void* stream) {
  return LaunchFor(dtype, index_dtype, problem, [&](auto t, auto i, const g::BagProblem& p) {
    using T = typename decltype(t)::type;
    using I = typename decltype(i)::type;
    return g::LaunchWeightsGrad<T, I>(
        p, static_cast<const T*>(grad), static_cast<const T*>(params), static_cast<const I*>(ids),
        splits, static_cast<const T*>(weights), static_cast<const T*>(output),
        static_cast<T*>(weights_grad), static_cast<tf_ttemb::DeviceReport*>(report), scratch,
        scratch_bytes, static_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"
