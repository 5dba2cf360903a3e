// What the TensorFlow kernels (cc/) and the CUDA launchers (cuda/) both name: the
// combiner and row-optimizer choices and the type T accumulates in. Plain C++, no
// TensorFlow or CUDA headers, so that cc/ code built without CUDA includes it too.
// cc/ sees these in tensorflow::tf_ttemb, cuda/ in tf_ttemb::gpu (using-declarations).

#ifndef TF_TTEMB_CUDA_COMMON_TYPES_H_
#define TF_TTEMB_CUDA_COMMON_TYPES_H_

namespace tf_ttemb {

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

}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_COMMON_TYPES_H_
