// What the harness's C ABI files (gpu_harness_capi.cu, tt_embedding_capi.cu,
// tt_update_capi.cu) share: the ctypes side's dtype and index codes turned into the
// launchers' types.
//
// dtype codes: 0 float16, 1 bfloat16, 2 float32, 3 float64.
// index codes: 0 int32, 1 int64.

#ifndef TF_TTEMB_PYTHON_GPU_HARNESS_CAPI_UTIL_CUH_
#define TF_TTEMB_PYTHON_GPU_HARNESS_CAPI_UTIL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace tf_ttemb {
namespace capi {

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<Types...[code]>), the type `code` stands for in the list, or `otherwise` for a
// code outside it.
template <typename... Types, typename R, typename F>
R WithTypeOf(int code, R otherwise, F&& f) {
  R result = otherwise;
  int k = 0;
  ((k++ == code && (result = f(Tag<Types>{}), true)) || ...);
  return result;
}

// f(Tag<T>) for the value type of `dtype`, or `otherwise` for an unknown code.
template <typename R, typename F>
R WithValueType(int dtype, R otherwise, F&& f) {
  return WithTypeOf<__half, __nv_bfloat16, float, double>(dtype, otherwise, f);
}

// f(Tag<Tindex>) for the index type of `index_dtype`, or `otherwise` for an unknown code.
template <typename R, typename F>
R WithIndexType(int index_dtype, R otherwise, F&& f) {
  return WithTypeOf<int32_t, int64_t>(index_dtype, otherwise, f);
}

// f(Tag<T>, Tag<Tindex>) for both codes, or `otherwise` for an unknown one.
template <typename R, typename F>
R WithTypes(int dtype, int index_dtype, R otherwise, F&& f) {
  return WithValueType(dtype, otherwise, [&](auto t) {
    return WithIndexType(index_dtype, otherwise, [&](auto i) -> R { return f(t, i); });
  });
}

}  // namespace capi
}  // namespace tf_ttemb

#endif  // TF_TTEMB_PYTHON_GPU_HARNESS_CAPI_UTIL_CUH_
