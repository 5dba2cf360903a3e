// Internal to the gather_reduce_sum gradient kernels (gather_reduce_sum_backward.cu and
// gather_reduce_sum_reduce.cu): the params-gradient plan and scratch layout that Prepare
// and Reduce must share, and the kernels both files launch (the bag scales, the weights
// gradient from a dot). In an anonymous namespace like gather_reduce_sum_common.cuh.

#ifndef TF_TTEMB_CUDA_GATHER_REDUCE_SUM_GRAD_PLAN_CUH_
#define TF_TTEMB_CUDA_GATHER_REDUCE_SUM_GRAD_PLAN_CUH_

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "cuda/gather_reduce_sum_common.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// One warp per bag: scale[b] (mean, sqrtn) from the bag's weights, and
// dyout[b] = <grad_b, output_b> when grad is given. Lane sums are combined in
// a fixed butterfly order.
template <typename T, typename Tindex>
__global__ void BagScalesKernel(const Tindex* __restrict__ ids,      // [nnz] or null
                                const int64_t* __restrict__ splits,  // [B + 1]
                                const T* __restrict__ weights,       // [nnz] or null
                                const T* __restrict__ grad,          // [B, D] or null
                                const T* __restrict__ output,        // [B, D] or null
                                int64_t num_bags, int64_t nnz, int64_t dim, Combiner combiner,
                                bool has_padding, int64_t padding_id,
                                AccT<T>* __restrict__ scale,    // [B] or null
                                AccT<T>* __restrict__ dyout) {  // [B] or null
  using A = AccT<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
       b < num_bags; b += warps) {
    if (scale != nullptr) {
      int64_t begin, end;
      BagRange(splits, b, nnz, &begin, &end);
      A sum = A(0), sq = A(0);
      for (int64_t j = begin + lane; j < end; j += 32) {
        if (has_padding && static_cast<int64_t>(ids[j]) == padding_id) continue;
        const A w = weights != nullptr ? ToAcc(weights[j]) : A(1);
        sum += w;
        sq += w * w;
      }
      sum = GroupSum(sum, 0xffffffffu, 32);
      sq = GroupSum(sq, 0xffffffffu, 32);
      if (lane == 0) scale[b] = BagScale(combiner, sum, sq);
    }
    if (dyout != nullptr) {
      A dot = A(0);
      for (int64_t d = lane; d < dim; d += 32) {
        dot = fma(ToAcc(grad[b * dim + d]), ToAcc(output[b * dim + d]), dot);
      }
      dot = GroupSum(dot, 0xffffffffu, 32);
      if (lane == 0) dyout[b] = dot;
    }
  }
}

// Vectors per lane in the params-gradient reduction of wide rows (one column
// chunk = 32 * NV vectors): 2 for every type since run 4 (with kRunVectors =
// 8, 4 entries per step in ReduceRunsKernel; 1 KB of dy per entry and chunk
// for f32, so the chunk of dy in use, 16 MB for PKM, stays in L2; f32 with 4
// was slower, cuda/BENCH_NOTES.md, "Tuning constants").
template <typename T>
constexpr int kReduceWideNV = 2;

// Params-gradient plan and scratch, shared by Prepare and Reduce.
template <typename T>
struct GradPlan {
  Columns cols;
  bool wide_keys = false;  // uint64 keys (N >= 2^32 - 1)
  int end_bit = 1;
  int64_t unique_bound = 0;  // min(nnz, N)
  int64_t piece_bound = 0;   // most pieces of long segments
};

template <typename T>
GradPlan<T> PlanGrad(const BagProblem& p) {
  GradPlan<T> g;
  g.cols = ColumnsFor<T>(p.dim, kReduceWideNV<T>);
  g.wide_keys = p.num_rows >= int64_t{0xffffffff};
  int bits = 0;
  while (bits < 63 && (p.num_rows >> bits) != 0) ++bits;
  g.end_bit = std::max(bits, 1);
  g.unique_bound = std::min(p.nnz, p.num_rows);
  g.piece_bound = 2 * p.nnz / kPieceEntries + 1;
  return g;
}

template <typename T>
struct GradScratch {
  SortPairsBuffers<void> sort;  // (id key, entry position), keys of g.wide_keys' width
  int32_t* heads = nullptr;
  int32_t* seg_index = nullptr;
  int32_t* seg_start = nullptr;
  int64_t* seg_id = nullptr;
  int32_t* hot = nullptr;
  int32_t* hot_off = nullptr;
  int64_t* meta = nullptr;
  AccT<T>* scale = nullptr;
  AccT<T>* dyout = nullptr;
  int32_t* entry_bag = nullptr;
  int32_t* sorted_bag = nullptr;
  AccT<T>* sorted_coef = nullptr;
  int32_t* sorted_inbag = nullptr;
  AccT<T>* part = nullptr;
  AccT<T>* pdot = nullptr;
  uint8_t* touched = nullptr;
  void* cub_temp = nullptr;
  size_t cub_bytes = 0;
};

template <typename Key>
size_t SortTempBytes(int64_t nnz, int end_bit) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const Key*>(nullptr),
                                  static_cast<Key*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), nnz, 0, end_bit);
  return bytes;
}

size_t ScanTempBytes(int64_t items) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                static_cast<int32_t*>(nullptr), items);
  return bytes;
}

template <typename T>
size_t CarveGrad(const BagProblem& p, const GradPlan<T>& g, bool dense, bool fused, void* base,
                 GradScratch<T>* s) {
  Carver carver(base);
  const int64_t n = p.nnz;
  const size_t key_size = g.wide_keys ? sizeof(uint64_t) : sizeof(uint32_t);
  s->sort.Carve(carver, n, static_cast<int64_t>(key_size));
  s->heads = carver.Take<int32_t>(n + 1);
  s->seg_index = carver.Take<int32_t>(n + 1);
  s->seg_start = carver.Take<int32_t>(n + 1);
  s->seg_id = carver.Take<int64_t>(n);
  s->hot = carver.Take<int32_t>(n + 1);
  s->hot_off = carver.Take<int32_t>(n + 1);
  s->meta = carver.Take<int64_t>(2);
  const bool scaled = p.combiner == Combiner::kMean || p.combiner == Combiner::kSqrtn;
  if (scaled) s->scale = carver.Take<AccT<T>>(p.num_bags);
  if (scaled && fused) s->dyout = carver.Take<AccT<T>>(p.num_bags);
  s->entry_bag = carver.Take<int32_t>(n);
  s->sorted_bag = carver.Take<int32_t>(n);
  if (p.combiner == Combiner::kMax) {
    s->sorted_inbag = carver.Take<int32_t>(n);
  } else {
    s->sorted_coef = carver.Take<AccT<T>>(n);
  }
  s->part = carver.Take<AccT<T>>(g.piece_bound * p.dim);
  if (fused) s->pdot = carver.Take<AccT<T>>(n * g.cols.chunks);
  if (dense) s->touched = carver.Take<uint8_t>(p.num_rows);
  s->cub_bytes = std::max(
      g.wide_keys ? SortTempBytes<uint64_t>(n, g.end_bit) : SortTempBytes<uint32_t>(n, g.end_bit),
      ScanTempBytes(n + 1));
  s->cub_temp = carver.Take<char>(static_cast<int64_t>(s->cub_bytes));
  return carver.bytes();
}

bool GradSizesOk(const BagProblem& p) {
  return p.nnz < std::numeric_limits<int32_t>::max() - 1 &&
         p.num_bags < std::numeric_limits<int32_t>::max();
}

}  // namespace
}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_GATHER_REDUCE_SUM_GRAD_PLAN_CUH_
