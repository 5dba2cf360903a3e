// What every CUDA kernel family of the package shares: the conversions to and from the
// accumulation type, 16-byte row packets, the scratch carver, grid sizing and the status
// macro of the launchers. No TensorFlow headers; device functions exist only for nvcc.

#ifndef TF_TTEMB_CUDA_COMMON_CUH_
#define TF_TTEMB_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/common_types.h"

// Returns the CUDA error of `expr` from the enclosing launcher, if any.
#define TTEMB_RETURN_IF_CUDA_ERROR(expr)  \
  do {                                    \
    const cudaError_t err_ = (expr);      \
    if (err_ != cudaSuccess) return err_; \
  } while (0)

// Expands M(T, args...) for each value type T the launchers take; each .cu file
// instantiates its own launchers with it (or with TTEMB_FOR_EACH_VALUE_TYPE, M(T)).
#define TTEMB_FOR_EACH_VALUE_TYPE_WITH(M, ...) \
  M(__half, __VA_ARGS__) M(__nv_bfloat16, __VA_ARGS__) M(float, __VA_ARGS__) M(double, __VA_ARGS__)
#define TTEMB_VALUE_TYPE_ONLY(T, M) M(T)
#define TTEMB_FOR_EACH_VALUE_TYPE(M) TTEMB_FOR_EACH_VALUE_TYPE_WITH(TTEMB_VALUE_TYPE_ONLY, M)

namespace tf_ttemb {
namespace gpu {

// Threads per block of the package's kernels.
constexpr int kBlock = 256;
// Grid-stride kernels sized by upper bounds (counts that live on the device) launch at
// most this many blocks: a capped grid keeps empty blocks cheap.
constexpr int64_t kMaxGridBlocks = 4096;

#if defined(__CUDACC__)
__device__ __forceinline__ float ToAcc(float x) { return x; }
__device__ __forceinline__ double ToAcc(double x) { return x; }
__device__ __forceinline__ float ToAcc(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToAcc(__nv_bfloat16 x) { return __bfloat162float(x); }

// Rounds to nearest even.
template <typename T>
__device__ __forceinline__ T FromAcc(AccT<T> x);
template <>
__device__ __forceinline__ float FromAcc<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ double FromAcc<double>(double x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromAcc<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromAcc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// Lowers a report's field to `value` (>= 0); an unset field holds -1, the largest
// value as unsigned, so the first report wins and the smallest stays.
__device__ __forceinline__ void ReportMin(int64_t* field, int64_t value) {
  atomicMin(reinterpret_cast<unsigned long long*>(field), static_cast<unsigned long long>(value));
}
#endif  // defined(__CUDACC__)

// Elements of T in one 16-byte vector.
template <typename T>
__host__ __device__ constexpr int VecOf() {
  return 16 / static_cast<int>(sizeof(T));
}

// V consecutive elements of a row, loaded and stored as one (16 bytes by default).
template <typename T, int V = VecOf<T>()>
struct alignas(sizeof(T) * V) Pack {
  static constexpr int kSize = V;
  T v[V];
};

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of `threads` for `work` items, at least 1 and at most `max_blocks`.
inline int GridBlocks(int64_t work, int threads, int64_t max_blocks) {
  return static_cast<int>(std::max<int64_t>(1, std::min(CeilDiv(work, threads), max_blocks)));
}

// FlatBlocks: GridBlocks for a grid-stride kernel of `threads` per block, capped at
// kMaxGridBlocks.
inline int FlatBlocks(int64_t work, int threads = kBlock) {
  return GridBlocks(work, threads, kMaxGridBlocks);
}

// The smallest power of two >= x, at most `cap` (a power of two); 1 for x <= 1.
inline int Pow2AtLeast(int64_t x, int cap) {
  int p = 1;
  while (p < x && p < cap) p <<= 1;
  return p;
}

// Bits that hold every value in [0, max_value]: at least 1, at most max_bits.
inline int BitsFor(uint64_t max_value, int max_bits) {
  int bits = 1;
  while (bits < max_bits && (max_value >> bits) != 0) ++bits;
  return bits;
}

// Carves 256-byte aligned sub-buffers out of the caller's scratch; with a null base it only
// counts the bytes, so a launcher's *ScratchBytes query and its launch share one layout.
class Carver {
 public:
  explicit Carver(void* base)
      : base_(base == nullptr ? nullptr
                              : reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + 255) &
                                                        ~uintptr_t{255})) {}
  template <typename U>
  U* Take(int64_t count) {
    offset_ = (offset_ + 255) & ~size_t{255};
    U* p = base_ == nullptr ? nullptr : reinterpret_cast<U*>(base_ + offset_);
    offset_ += sizeof(U) * static_cast<size_t>(std::max<int64_t>(count, 0));
    return p;
  }
  void* TakeBytes(size_t bytes) { return Take<char>(static_cast<int64_t>(bytes)); }
  // Bytes used, plus room to align an unaligned base.
  size_t bytes() const { return offset_ + 256; }

 private:
  char* base_;
  size_t offset_ = 0;
};

// The buffers of a CUB radix sort of n (Key, int32) pairs. Key is void where the key
// width is chosen at run time (key_bytes).
template <typename Key>
struct SortPairsBuffers {
  Key* keys_in = nullptr;       // [n]
  Key* keys_out = nullptr;      // [n]
  int32_t* vals_in = nullptr;   // [n]
  int32_t* vals_out = nullptr;  // [n], or null for sorts that write the values elsewhere

  void Carve(Carver& carver, int64_t n, int64_t key_bytes, bool with_vals_out = true) {
    keys_in = static_cast<Key*>(carver.TakeBytes(static_cast<size_t>(n * key_bytes)));
    keys_out = static_cast<Key*>(carver.TakeBytes(static_cast<size_t>(n * key_bytes)));
    vals_in = carver.Take<int32_t>(n);
    if (with_vals_out) vals_out = carver.Take<int32_t>(n);
  }
};

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_COMMON_CUH_
