// Internal to the gather_reduce_sum CUDA kernels (gather_reduce_sum_forward.cu and
// gather_reduce_sum_backward.cu): the constants, the device helpers every row kernel
// uses, the report kernels and the host-side helpers (grids, column layouts, scratch
// carving, the report's launches). Everything is in an anonymous namespace: each .cu
// file has its own copy. Not for other callers: the launchers' contract is
// gather_reduce_sum_kernels.cuh.
//
// Column layout shared by every row kernel: a row of D elements is cut into
// "vectors" of V = 16 / sizeof(T) consecutive elements (one 16-byte load when
// the row is aligned). A *group* of G lanes (G a power of two <= 32, the
// smallest that covers the row's vectors, so several groups share a warp when
// D is small) owns one work item; lane g of the group handles vector
// chunk * G + g. Rows wider than 32 vectors are cut into `chunks` column
// chunks, each its own work item. Work items are walked with a grid-stride
// loop, one item per group at a time.

#ifndef TF_TTEMB_CUDA_GATHER_REDUCE_SUM_COMMON_CUH_
#define TF_TTEMB_CUDA_GATHER_REDUCE_SUM_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gather_reduce_sum_kernels.cuh"

// Instantiates a .cu file's launchers of the family: PER_T(T) for each value type T,
// PER_T_INDEX(T, Tindex) for each value type and index type (int32_t, int64_t).
#define TTEMB_INSTANTIATE_BAG_LAUNCHERS(PER_T, PER_T_INDEX) \
  TTEMB_FOR_EACH_VALUE_TYPE(PER_T)                          \
  TTEMB_FOR_EACH_VALUE_TYPE_WITH(PER_T_INDEX, int32_t)      \
  TTEMB_FOR_EACH_VALUE_TYPE_WITH(PER_T_INDEX, int64_t)

namespace tf_ttemb {
namespace gpu {
namespace {

// Row vectors each lane has in flight in the gather loops (forward and
// params-gradient reduction): kUnroll / NV entries of NV vectors.
constexpr int kUnroll = 8;
// Params gradient: segments with more entries than this are split into pieces
// of this many entries, reduced separately and combined in piece order.
constexpr int64_t kPieceEntries = 256;
// Forward: with fewer groups than this, bags are split into slices.
constexpr int64_t kTargetGroups = 16384;
constexpr int64_t kMinSliceEntries = 64;
constexpr int64_t kMaxSlices = 1024;
// Weights gradient: consecutive entries per group.
constexpr int64_t kWeightsGradEntries = 8;
// Params-gradient run kernel (ReduceRunsKernel): segments per work item (one
// per lane), 16-byte row vectors per lane in one step, steps in flight (each
// warp has a ring of kRunStages steps of dy vectors in shared memory: 8 KB a
// warp, 64 KB a block) and blocks per SM it is built for. The fastest shape of
// run 4 on the PKM f32 backward (cuda/BENCH_NOTES.md, "Tuning constants").
constexpr int kRunSegments = 32;
constexpr int kRunVectors = 8;
constexpr int kRunStages = 2;
constexpr int kRunMinBlocks = 3;
constexpr int kRunSmemBytes = (kBlock / 32) * kRunStages * kRunVectors * 32 * 16;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// Loads the vector starting at element `col` of a row. kAligned: one 16-byte
// load (row and D are multiples of V). Otherwise element by element, with
// zeros past the end of the row (col + e >= dim). kReadOnly: through the
// read-only data cache, for rows no kernel running now writes; false for
// rows the same kernel updates.
template <typename T, bool kAligned, bool kReadOnly = true>
__device__ __forceinline__ Pack<T> LoadVec(const T* __restrict__ p, int64_t col, int64_t dim) {
  Pack<T> r;
  if (kAligned) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    *reinterpret_cast<uint4*>(r.v) = kReadOnly ? __ldg(q) : *q;
  } else {
#pragma unroll
    for (int e = 0; e < Pack<T>::kSize; ++e) {
      r.v[e] = col + e < dim ? p[e] : FromAcc<T>(AccT<T>(0));
    }
  }
  return r;
}

template <typename T, bool kAligned>
__device__ __forceinline__ void StoreVec(T* __restrict__ p, const Pack<T>& x, int64_t col,
                                         int64_t dim) {
  if (kAligned) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(x.v);
  } else {
#pragma unroll
    for (int e = 0; e < Pack<T>::kSize; ++e) {
      if (col + e < dim) p[e] = x.v[e];
    }
  }
}

// The V elements held in the raw 16 bytes of a row vector (little-endian, element 0 in
// the low bits of x), as AccT<T>.
template <typename T>
__device__ __forceinline__ void RawToAcc(const uint4& r, AccT<T> (&f)[VecOf<T>()]) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __uint_as_float(words[k] << 16);
      f[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
    }
  } else if constexpr (std::is_same<T, __half>::value) {
    const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      __half2 h;
      memcpy(&h, &words[k], sizeof(h));
      const float2 x = __half22float2(h);
      f[2 * k] = x.x;
      f[2 * k + 1] = x.y;
    }
  } else if constexpr (std::is_same<T, double>::value) {
    f[0] = __hiloint2double(static_cast<int>(r.y), static_cast<int>(r.x));
    f[1] = __hiloint2double(static_cast<int>(r.w), static_cast<int>(r.z));
  } else {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  }
}

// The raw 16 bytes of V accumulators rounded to T.
template <typename T>
__device__ __forceinline__ uint4 AccToRaw(const AccT<T> (&f)[VecOf<T>()]) {
  Pack<T> o;
#pragma unroll
  for (int e = 0; e < VecOf<T>(); ++e) o.v[e] = FromAcc<T>(f[e]);
  return *reinterpret_cast<const uint4*>(o.v);
}

// acc[e] = fma(w, element e, acc[e]) over the V elements held in the raw 16 bytes of a
// row vector: the same values as ToAcc on a Pack, in fewer instructions (for bf16 a shift
// or a mask per element) and without 16-bit registers.
template <typename T>
__device__ __forceinline__ void FmaRawOf(AccT<T> w, const uint4& r, AccT<T> (&acc)[VecOf<T>()]) {
  AccT<T> f[VecOf<T>()];
  RawToAcc<T>(r, f);
#pragma unroll
  for (int e = 0; e < VecOf<T>(); ++e) acc[e] = fma(w, f[e], acc[e]);
}

template <int V>
struct Ints {
  int32_t v[V];
};

// argmax entries of one vector; -2 (never a position) past the row's end.
template <int V, bool kAligned>
__device__ __forceinline__ Ints<V> LoadInts(const int32_t* __restrict__ p, int64_t col,
                                            int64_t dim) {
  Ints<V> r;
  if (kAligned && V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V / 4; ++i) {
      const int4 x = __ldg(reinterpret_cast<const int4*>(p) + i);
      r.v[4 * i] = x.x;
      r.v[4 * i + 1] = x.y;
      r.v[4 * i + 2] = x.z;
      r.v[4 * i + 3] = x.w;
    }
  } else if (kAligned && V == 2) {
    const int2 x = __ldg(reinterpret_cast<const int2*>(p));
    r.v[0] = x.x;
    r.v[V - 1] = x.y;
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) r.v[e] = col + e < dim ? p[e] : -2;
  }
  return r;
}

template <int V, bool kAligned>
__device__ __forceinline__ void StoreInts(int32_t* __restrict__ p, const Ints<V>& x, int64_t col,
                                          int64_t dim) {
  if (kAligned && V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V / 4; ++i) {
      reinterpret_cast<int4*>(p)[i] =
          make_int4(x.v[4 * i], x.v[4 * i + 1], x.v[4 * i + 2], x.v[4 * i + 3]);
    }
  } else if (kAligned && V == 2) {
    *reinterpret_cast<int2*>(p) = make_int2(x.v[0], x.v[V - 1]);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      if (col + e < dim) p[e] = x.v[e];
    }
  }
}

template <typename A>
__device__ __forceinline__ A IntBitsAsAcc(int32_t x);
template <>
__device__ __forceinline__ float IntBitsAsAcc<float>(int32_t x) {
  return __int_as_float(x);
}
template <>
__device__ __forceinline__ double IntBitsAsAcc<double>(int32_t x) {
  return __longlong_as_double(static_cast<long long>(x));
}
__device__ __forceinline__ int32_t AccBitsAsInt(float x) { return __float_as_int(x); }
__device__ __forceinline__ int32_t AccBitsAsInt(double x) {
  return static_cast<int32_t>(__double_as_longlong(x));
}

// As the CPU kernel's: 0 for a zero denominator, and a bag of scale 0 gives +0
// and zero gradients whatever its rows hold (0 * Inf would be NaN).
template <typename A>
__device__ __forceinline__ A BagScale(Combiner combiner, A sum, A sq_sum) {
  if (combiner == Combiner::kMean) return sum != A(0) ? A(1) / sum : A(0);
  // != 0, not > 0: a NaN weight makes the scale NaN (IEEE), as on the CPU.
  if (combiner == Combiner::kSqrtn) return sq_sum != A(0) ? A(1) / sqrt(sq_sum) : A(0);
  return A(1);
}

// Whether v, at a later position of the bag than the running max m, replaces
// it: the first entry of the max wins, and NaN is above every number (as in
// tf.reduce_max and the CPU kernel), so the first NaN entry wins a column
// holding NaN.
template <typename A>
__device__ __forceinline__ bool TakesMax(A v, A m) {
  return v > m || (isnan(v) && !isnan(m));
}

// Entries of bag b, clamped to [0, nnz] so that bad splits never lead to an
// out-of-bounds read.
__device__ __forceinline__ void BagRange(const int64_t* __restrict__ splits, int64_t b, int64_t nnz,
                                         int64_t* begin, int64_t* end) {
  const int64_t lo = min(max(splits[b], int64_t{0}), nnz);
  *begin = lo;
  *end = min(max(splits[b + 1], lo), nnz);
}

// The bag holding entry j: the largest b in [0, B) with splits[b] <= j
// (always in [0, B), whatever splits holds). B >= 1.
__device__ __forceinline__ int64_t FindBag(const int64_t* __restrict__ splits, int64_t num_bags,
                                           int64_t j) {
  int64_t lo = 0, hi = num_bags;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (splits[mid] <= j) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo > 0 ? lo - 1 : 0;
}

// Lanes of this thread's group, for shuffles within the group.
__device__ __forceinline__ unsigned GroupMask(int group) {
  if (group == 32) return 0xffffffffu;
  const int first = (threadIdx.x & 31) & ~(group - 1);
  return ((1u << group) - 1u) << first;
}

// Sum over the lanes of a group in a fixed butterfly order; every lane gets it.
template <typename A>
__device__ __forceinline__ A GroupSum(A x, unsigned mask, int group) {
  for (int offset = group >> 1; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(mask, x, offset, group);
  }
  return x;
}

__device__ __forceinline__ void DivMod(int64_t x, int64_t d, int64_t* q, int64_t* r) {
  if (d == 1) {
    *q = x;
    *r = 0;
  } else {
    *q = x / d;
    *r = x - *q * d;
  }
}

// Grid-stride walk over work items, one per group of `group` lanes.
struct GroupWalk {
  int group;
  int lane;
  int64_t first;
  int64_t stride;
  __device__ explicit GroupWalk(int g)
      : group(g),
        lane(static_cast<int>(threadIdx.x) & (g - 1)),
        first(static_cast<int64_t>(blockIdx.x) * (kBlock / g) + threadIdx.x / g),
        stride(static_cast<int64_t>(gridDim.x) * (kBlock / g)) {}
};

// ---------------------------------------------------------------------------
// Report kernels.

// One thread per bag b: splits[b + 1] < splits[b] is recorded (first b wins).
__global__ void CheckSplitsKernel(const int64_t* __restrict__ splits, int64_t num_bags,
                                  DeviceReport* report) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < num_bags;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (splits[b + 1] < splits[b]) ReportMin(&report->first_bad_split, b);
  }
}

// One thread per entry: records ids outside [0, N) that are not padding.
template <typename Tindex>
__global__ void CheckIdsKernel(const Tindex* __restrict__ ids, int64_t nnz, int64_t num_rows,
                               bool has_padding, int64_t padding_id, DeviceReport* report) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < nnz;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = static_cast<int64_t>(ids[j]);
    if ((id < 0 || id >= num_rows) && !(has_padding && id == padding_id)) {
      ReportMin(&report->first_bad_index, j);
    }
  }
}

// One thread: fills in the values that go with the positions found.
template <typename Tindex>
__global__ void FinishReportKernel(const Tindex* __restrict__ ids, int64_t nnz,
                                   const int64_t* __restrict__ splits, int64_t num_bags,
                                   DeviceReport* report) {
  report->first_split = splits[0];
  report->last_split = splits[num_bags];
  const int64_t b = report->first_bad_split;
  if (b >= 0 && b < num_bags) {
    report->bad_split_value = splits[b + 1];
    report->bad_split_prev = splits[b];
  }
  const int64_t j = report->first_bad_index;
  if (ids != nullptr && j >= 0 && j < nnz) {
    report->bad_index_value = static_cast<int64_t>(ids[j]);
  }
}

// ---------------------------------------------------------------------------
// Host side.

int GridFor(int64_t threads) { return GridBlocks(threads, kBlock, kMaxBlocks); }

// For grid-stride kernels whose items mostly exit at once (pieces when few
// segments are long, rows that a segment writes): enough warps to fill any GPU
// several times, without launching a block per item (run 4: 41 + 21 + 13 us
// for such launches in the PKM backward).
int GridCapped(int64_t threads) { return std::min(GridFor(threads), 2048); }

// Column layout of a row of `dim` elements of T (see the top of the file).
struct Columns {
  int64_t dim_vecs = 0;
  int64_t chunks = 0;
  int group = 1;
  int nv = 1;  // vectors per lane per entry
};

// nv > 1 only when a full group still has nv vectors per lane to do.
template <typename T>
Columns ColumnsFor(int64_t dim, int nv = 1) {
  Columns c;
  c.dim_vecs = CeilDiv(dim, VecOf<T>());
  if (c.dim_vecs == 0) return c;
  c.group = Pow2AtLeast(c.dim_vecs, 32);
  c.nv = c.dim_vecs >= 32 * nv ? nv : 1;
  c.chunks = CeilDiv(c.dim_vecs, c.group * c.nv);
  return c;
}

cudaError_t LastLaunchError() { return cudaGetLastError(); }

// Every finding unset (-1), and the header of the call `p` describes.
__global__ void InitReportKernel(DeviceReport* report, int64_t num_rows, int64_t nnz,
                                 int64_t num_bags) {
  DeviceReport r;
  r.first_bad_index = r.bad_index_value = r.first_bad_split = r.bad_split_value = -1;
  r.bad_split_prev = r.first_split = r.last_split = r.num_unique = -1;
  r.num_rows = num_rows;
  r.nnz = nnz;
  r.num_bags = num_bags;
  *report = r;
}

cudaError_t InitReport(const BagProblem& p, DeviceReport* report, cudaStream_t stream) {
  InitReportKernel<<<1, 1, 0, stream>>>(report, p.num_rows, p.nnz, p.num_bags);
  return LastLaunchError();
}

cudaError_t CheckSplits(const int64_t* splits, int64_t num_bags, DeviceReport* report,
                        cudaStream_t stream) {
  if (num_bags == 0) return cudaSuccess;
  CheckSplitsKernel<<<GridFor(num_bags), kBlock, 0, stream>>>(splits, num_bags, report);
  return LastLaunchError();
}

template <typename Tindex>
cudaError_t FinishReport(const Tindex* ids, int64_t nnz, const int64_t* splits, int64_t num_bags,
                         DeviceReport* report, cudaStream_t stream) {
  FinishReportKernel<Tindex><<<1, 1, 0, stream>>>(ids, nnz, splits, num_bags, report);
  return LastLaunchError();
}

bool ValidProblem(const BagProblem& p) {
  return p.num_rows >= 0 && p.dim >= 0 && p.num_bags >= 0 && p.nnz >= 0 &&
         !(p.has_weights && p.combiner == Combiner::kMax);
}

}  // namespace
}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_GATHER_REDUCE_SUM_COMMON_CUH_
