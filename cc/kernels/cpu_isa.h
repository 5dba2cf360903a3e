// The CPU kernels' run-time choices by CPU (the instruction set, the vendor) and
// the environment variables that fix one. The library is built for AVX2 + FMA +
// F16C (configure.sh), so that one build runs on every x86-64 CPU of the last
// decade; functions marked TF_TTEMB_AVX512 are compiled for AVX-512 as well and
// run only where CpuHasAvx512() holds. Plain C++ (no TensorFlow headers).

#ifndef TF_TTEMB_CC_KERNELS_CPU_ISA_H_
#define TF_TTEMB_CC_KERNELS_CPU_ISA_H_

#include <cstdlib>
#include <cstring>

// Compiles a function for AVX-512 (F, BW, VL); call it only under
// CpuHasAvx512().
#define TF_TTEMB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

// TF_TTEMB_AVX512, with every call inside the function inlined into it
// (recursively): for templates written once over a vector type (AVX2's or
// AVX-512's), whose AVX-512 instantiations can only be inlined into an
// AVX-512 function.
#define TF_TTEMB_AVX512_FLATTEN TF_TTEMB_AVX512 __attribute__((flatten))

namespace tensorflow {
namespace tf_ttemb {

// Whether the AVX-512 paths run: the CPU has AVX512F/BW/VL and the
// environment variable TF_TTEMB_CPU_ISA is not "avx2" (which keeps the AVX2
// paths, so that they can be tested on an AVX-512 machine). Read once.
inline bool CpuHasAvx512() {
  static const bool has = [] {
    const char* isa = std::getenv("TF_TTEMB_CPU_ISA");
    if (isa != nullptr && std::strcmp(isa, "avx2") == 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return has;
}

// A run-time choice that the environment can fix: true where `variable` is
// `yes`, false where it is `no`, else `fallback` (what the CPU suggests).
inline bool EnvChoice(const char* variable, const char* yes, const char* no, bool fallback) {
  const char* value = std::getenv(variable);
  if (value != nullptr && std::strcmp(value, yes) == 0) return true;
  if (value != nullptr && std::strcmp(value, no) == 0) return false;
  return fallback;
}

// Whether the CPU is Intel's: where the gather kernels' row prefetches are
// tuned by vendor (gather_reduce_sum_cpu.h). Read once.
inline bool CpuIsIntel() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_CPU_ISA_H_
