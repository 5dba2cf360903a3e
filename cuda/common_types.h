// What the TensorFlow kernels (cc/) and the CUDA launchers (cuda/) both name: the
// combiner and row-optimizer choices, a bag op's attributes, the type T accumulates in
// and the TT cache's set hash. Plain C++, no
// TensorFlow or CUDA headers, so that cc/ code built without CUDA includes it too.
// cc/ sees these in tensorflow::tf_ttemb, cuda/ in tf_ttemb::gpu (using-declarations).

#ifndef TF_TTEMB_CUDA_COMMON_TYPES_H_
#define TF_TTEMB_CUDA_COMMON_TYPES_H_

#include <cstdint>

#if defined(__CUDACC__)
#define TTEMB_HOST_DEVICE __host__ __device__
#else
#define TTEMB_HOST_DEVICE
#endif

namespace tf_ttemb {

// How a bag's rows combine. The ctypes harness passes the values as ints.
enum class Combiner : int { kSum = 0, kMean = 1, kSqrtn = 2, kMax = 3 };

// The optimizer GatherReduceSumSparseApply applies to each distinct row.
enum class RowOptimizer : int { kSgd = 0, kRowwiseAdagrad = 1, kAdagrad = 2 };

// The attributes every bag op takes: parsed once from the op's attrs in the kernel
// constructor (cc/, where they are BagAttrs) and passed to the launchers as part of
// their BagProblem (cuda/). Entries whose id is the padding id are skipped.
struct BagOptions {
  Combiner combiner = Combiner::kSum;
  bool has_weights = false;
  bool has_padding_id = false;
  int64_t padding_id = -1;
};

// The type every kernel sums T in: float for the half types and float, double
// for double (half types accumulate in float32).
template <typename T>
struct AccumulatorOf {
  using type = float;
};
template <>
struct AccumulatorOf<double> {
  using type = double;
};
template <typename T>
using AccT = typename AccumulatorOf<T>::type;

// Fixed 64-bit mixer (splitmix64's finaliser): which set of TTCacheCount's frequency
// table an id belongs to, on the CPU and the GPU alike.
inline TTEMB_HOST_DEVICE uint64_t MixId(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_COMMON_TYPES_H_
