// CUDA kernels and launchers of the fused TT update and the device-side row cache's
// lookup, populate and row select, which only the ctypes harness calls (through
// tt_update_capi.cu); the op library's TTCacheCount counting stays in
// cuda/tt_update_kernels.cu. See tt_cache_kernels.cuh for the contract; this file holds
// how threads map to data.
//
// Row kernels (sparse update, select rows): a row of `width` elements is cut
// into vectors of V = 16 / sizeof(T) elements when every pointer is 16-byte
// aligned and V divides the width (one 16-byte load each), else V = 1. A
// *group* of G threads (G the smallest power of two covering the row's
// vectors, at most the block) owns one row at a time; lane g handles vectors
// g, g + G, ... so a block holds kBlock / G rows. Rows are walked with a
// grid-stride loop over a capped grid, so every row is visited for any n and
// width (FBTT's fused update covered only the rows its fixed grid reached).
//
// Lookup and populate: a binary search per id, one 64-bit exclusive scan
// whose high half ranks the hits and low half the misses, and a scatter.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>
#include <type_traits>

#include "cuda/common.cuh"
#include "python/gpu_harness/tt_cache_kernels.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// Blocks one slice (or one row launch) gets at most; larger problems are
// walked by the grid-stride loops.
constexpr int64_t kMaxRowBlocks = 2048;

// ---------------------------------------------------------------------------
// Element math. ToAcc / FromAcc (cuda/common.cuh) load to the compute type AccT<T> and
// round back when stored; these correctly rounded operations may not be contracted into
// FMAs by the compiler, so that each step rounds like the separate TF ops of the layer.
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float Div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float Sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double Mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double Add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double Sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double Div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double Sqrt(double a) { return __dsqrt_rn(a); }

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> LoadPack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <typename T, int V>
__device__ __forceinline__ void StorePack(T* p, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p) = x;
}

// How a row kernel maps threads to the rows of one problem.
struct RowPlan {
  int group = 1;       // threads per row (power of two <= kBlock)
  int vec = 1;         // elements per vector (V or 1)
  int64_t vecs = 0;    // vectors per row
  int64_t blocks = 0;  // blocks of the grid-stride walk
};

template <typename T>
RowPlan PlanRows(int64_t n, int64_t width, bool aligned) {
  RowPlan plan;
  constexpr int V = VecOf<T>();
  plan.vec = aligned && width % V == 0 ? V : 1;
  plan.vecs = width / plan.vec;
  plan.group = Pow2AtLeast(plan.vecs, kBlock);
  const int64_t rows_per_block = kBlock / plan.group;
  plan.blocks = n > 0 && width > 0 ? std::min(CeilDiv(n, rows_per_block), kMaxRowBlocks) : 0;
  return plan;
}

// ---------------------------------------------------------------------------
// Sparse update.

// A slice as the kernel walks it: the caller's (accum null for SGD), its row plan, and
// its first block in the grid.
template <typename T>
struct UpdateSlice {
  SparseUpdateSlice<T> in;
  RowPlan plan;
  int64_t block_begin;
};

template <typename T>
struct UpdateParams {
  UpdateSlice<T> s[kMaxUpdateSlices];
  int num;
  AccT<T> lr;
  AccT<T> eps;
};

// One row's vectors lane, lane + group, ... of the update.
template <typename T, int V, bool kAdagrad>
__device__ __forceinline__ void UpdateRow(T* var, T* accum, const T* grad, int64_t vecs, int lane,
                                          int group, AccT<T> lr, AccT<T> eps) {
  using C = AccT<T>;
  for (int64_t c = lane; c < vecs; c += group) {
    const Pack<T, V> g = LoadPack<T, V>(grad + c * V);
    Pack<T, V> w = LoadPack<T, V>(var + c * V);
    if (kAdagrad) {
      Pack<T, V> a = LoadPack<T, V>(accum + c * V);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const C gk = ToAcc(g.v[k]);
        a.v[k] = FromAcc<T>(Add(ToAcc(a.v[k]), Mul(gk, gk)));
        // The new state as stored (rounded to T), as the layer reads it back.
        const C step = Div(Mul(lr, gk), Add(Sqrt(ToAcc(a.v[k])), eps));
        w.v[k] = FromAcc<T>(Sub(ToAcc(w.v[k]), step));
      }
      StorePack<T, V>(accum + c * V, a);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        w.v[k] = FromAcc<T>(Sub(ToAcc(w.v[k]), Mul(lr, ToAcc(g.v[k]))));
      }
    }
    StorePack<T, V>(var + c * V, w);
  }
}

// Grid: the blocks of all slices, slice k owning [block_begin, block_begin +
// blocks). Within a slice, group `local` of block b starts at row
// b * rows_per_block + local and strides by blocks * rows_per_block.
template <typename T, bool kAdagrad>
__global__ void __launch_bounds__(kBlock) SparseUpdateKernel(const UpdateParams<T> p) {
  int k = 0;
  while (k + 1 < p.num && static_cast<int64_t>(blockIdx.x) >= p.s[k + 1].block_begin) ++k;
  const SparseUpdateSlice<T>& s = p.s[k].in;
  const RowPlan& plan = p.s[k].plan;
  int64_t n = s.n;
  if (s.num_valid != nullptr) n = min(n, max(*s.num_valid, int64_t{0}));
  const int group = plan.group;
  const int64_t rows_per_block = kBlock / group;
  const int lane = threadIdx.x % group;
  const int64_t stride = plan.blocks * rows_per_block;
  for (int64_t i = (blockIdx.x - p.s[k].block_begin) * rows_per_block + threadIdx.x / group; i < n;
       i += stride) {
    const int64_t r = s.rows[i];
    if (r < 0 || r >= s.num_rows) continue;
    T* var = s.var + r * s.width;
    T* accum = kAdagrad ? s.accum + r * s.width : nullptr;
    const T* grad = s.grad + i * s.width;
    if (plan.vec > 1) {
      UpdateRow<T, VecOf<T>(), kAdagrad>(var, accum, grad, plan.vecs, lane, group, p.lr, p.eps);
    } else {
      UpdateRow<T, 1, kAdagrad>(var, accum, grad, plan.vecs, lane, group, p.lr, p.eps);
    }
  }
}

// ---------------------------------------------------------------------------
// Select rows: out[j] = a[sel_a[j]] | b[sel_b[j]] | 0.

template <typename T, int V>
__device__ __forceinline__ void CopyRow(const T* src, T* dst, int64_t vecs, int lane, int group) {
  for (int64_t c = lane; c < vecs; c += group) {
    Pack<T, V> x;
    if (src != nullptr) {
      x = LoadPack<T, V>(src + c * V);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) x.v[k] = FromAcc<T>(AccT<T>(0));
    }
    StorePack<T, V>(dst + c * V, x);
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    SelectRowsKernel(int64_t n, int64_t width, int64_t vecs, int group, int vec, const T* a,
                     int64_t a_rows, const int64_t* sel_a, const T* b, int64_t b_rows,
                     const int64_t* sel_b, T* out) {
  const int64_t rows_per_block = kBlock / group;
  const int lane = threadIdx.x % group;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rows_per_block;
  for (int64_t j = blockIdx.x * rows_per_block + threadIdx.x / group; j < n; j += stride) {
    const int64_t ia = sel_a[j];
    const T* src = nullptr;
    if (ia >= 0) {
      if (ia < a_rows) src = a + ia * width;
    } else if (sel_b != nullptr && b != nullptr) {
      const int64_t ib = sel_b[j];
      if (ib >= 0 && ib < b_rows) src = b + ib * width;
    }
    T* dst = out + j * width;
    if (vec > 1) {
      CopyRow<T, VecOf<T>()>(src, dst, vecs, lane, group);
    } else {
      CopyRow<T, 1>(src, dst, vecs, lane, group);
    }
  }
}

// ---------------------------------------------------------------------------
// Lookup (also the second half of populate).

constexpr uint64_t kHitOne = uint64_t{1} << 32;

// Binary search of each id in the sorted cache ids: position and a packed
// flag (1 << 32 for a hit, 1 for a miss, 0 for a skipped id).
__global__ void LookupFlagsKernel(const int64_t* ids, int64_t n, const int64_t* cache_ids,
                                  int64_t cache_size, int64_t* position, uint64_t* flags) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[j];
    int64_t pos = -1;
    uint64_t flag = 0;
    if (id >= 0 && id != kEmptyCacheId) {
      int64_t lo = 0, hi = cache_size;
      while (lo < hi) {
        const int64_t mid = (lo + hi) >> 1;
        if (cache_ids[mid] < id) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      if (lo < cache_size && cache_ids[lo] == id) {
        pos = lo;
        flag = kHitOne;
      } else {
        flag = 1;
      }
    }
    position[j] = pos;
    flags[j] = flag;
  }
}

// Writes the compacted lists from the exclusive scan of the flags, the tails
// past the totals, and the totals (thread 0).
__global__ void LookupScatterKernel(const int64_t* ids, int64_t n, const int64_t* position,
                                    const uint64_t* flags, const uint64_t* ranks,
                                    int64_t miss_pad_id, int64_t* miss_rank, int64_t* miss_ids,
                                    int64_t* miss_at, int64_t* hit_at, int64_t* hit_pos,
                                    int64_t* num_hits, int64_t* num_misses) {
  const uint64_t total = ranks[n - 1] + flags[n - 1];
  const int64_t hits = static_cast<int64_t>(total >> 32);
  const int64_t misses = static_cast<int64_t>(total & 0xffffffffu);
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t flag = flags[j];
    const uint64_t rank = ranks[j];
    int64_t mr = -1;
    if (flag == kHitOne) {
      const int64_t hr = static_cast<int64_t>(rank >> 32);
      if (hit_at != nullptr) hit_at[hr] = j;
      if (hit_pos != nullptr) hit_pos[hr] = position[j];
    } else if (flag == 1) {
      mr = static_cast<int64_t>(rank & 0xffffffffu);
      miss_ids[mr] = ids[j];
      miss_at[mr] = j;
    }
    miss_rank[j] = mr;
    if (j >= misses) {
      miss_ids[j] = miss_pad_id;
      miss_at[j] = -1;
    }
    if (j >= hits) {
      if (hit_at != nullptr) hit_at[j] = -1;
      if (hit_pos != nullptr) hit_pos[j] = -1;
    }
    if (j == 0) {
      if (num_hits != nullptr) *num_hits = hits;
      if (num_misses != nullptr) *num_misses = misses;
    }
  }
}

// ---------------------------------------------------------------------------
// Populate.

// Sort inputs: the key of every slot, and its count or -1 when not live.
__global__ void PopulatePrepKernel(const int64_t* keys, const int64_t* counts, int64_t size,
                                   int64_t* ids_out, int64_t* counts_out) {
  for (int64_t h = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; h < size;
       h += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t key = keys[h];
    const int64_t count = counts[h];
    ids_out[h] = key;
    counts_out[h] = key >= 0 && count > 0 ? count : -1;
  }
}

// The first cache_size ranked ids (live ones only), kEmptyCacheId elsewhere.
__global__ void PopulateChooseKernel(const int64_t* ranked_ids, const int64_t* ranked_counts,
                                     int64_t table_size, int64_t cache_size, int64_t* chosen) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < cache_size;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    chosen[s] = s < table_size && ranked_counts[s] > 0 ? ranked_ids[s] : kEmptyCacheId;
  }
}

// ---------------------------------------------------------------------------
// Host helpers.

struct LookupBuffers {
  uint64_t* flags;
  uint64_t* ranks;
  void* cub;
  size_t cub_bytes;
};

LookupBuffers CarveLookup(Carver& carver, int64_t n) {
  LookupBuffers b;
  b.flags = carver.Take<uint64_t>(n);
  b.ranks = carver.Take<uint64_t>(n);
  b.cub_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, b.cub_bytes, static_cast<const uint64_t*>(nullptr),
                                static_cast<uint64_t*>(nullptr), static_cast<int>(n));
  b.cub = carver.TakeBytes(b.cub_bytes);
  return b;
}

cudaError_t RunLookup(const int64_t* ids, int64_t n, const int64_t* cache_ids, int64_t cache_size,
                      int64_t miss_pad_id, const CacheLookupResult& out, int64_t* num_hits,
                      int64_t* num_misses, const LookupBuffers& b, cudaStream_t stream) {
  if (n == 0) {
    if (num_hits != nullptr) TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(num_hits, 0, 8, stream));
    if (num_misses != nullptr)
      TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(num_misses, 0, 8, stream));
    return cudaSuccess;
  }
  const int blocks = FlatBlocks(n);
  LookupFlagsKernel<<<blocks, kBlock, 0, stream>>>(ids, n, cache_ids, cache_size, out.position,
                                                   b.flags);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  size_t cub_bytes = b.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceScan::ExclusiveSum(b.cub, cub_bytes, b.flags, b.ranks,
                                                           static_cast<int>(n), stream));
  LookupScatterKernel<<<blocks, kBlock, 0, stream>>>(
      ids, n, out.position, b.flags, b.ranks, miss_pad_id, out.miss_rank, out.miss_ids, out.miss_at,
      out.hit_at, out.hit_pos, num_hits, num_misses);
  return cudaGetLastError();
}

struct PopulateBuffers {
  int64_t* ids_in;
  int64_t* counts_in;
  int64_t* ids_by_id;
  int64_t* counts_by_id;
  int64_t* ids_ranked;
  int64_t* counts_ranked;
  int64_t* chosen;
  int64_t* num_stay;
  void* cub;
  size_t cub_bytes;
  LookupBuffers lookup;
};

PopulateBuffers CarvePopulate(Carver& carver, int64_t table_size, int64_t cache_size) {
  PopulateBuffers b;
  b.ids_in = carver.Take<int64_t>(table_size);
  b.counts_in = carver.Take<int64_t>(table_size);
  b.ids_by_id = carver.Take<int64_t>(table_size);
  b.counts_by_id = carver.Take<int64_t>(table_size);
  b.ids_ranked = carver.Take<int64_t>(table_size);
  b.counts_ranked = carver.Take<int64_t>(table_size);
  b.chosen = carver.Take<int64_t>(cache_size);
  b.num_stay = carver.Take<int64_t>(1);
  size_t a = 0, c = 0, d = 0;
  const int h = static_cast<int>(table_size);
  const int64_t* ci = nullptr;
  int64_t* mi = nullptr;
  cub::DeviceRadixSort::SortPairs(nullptr, a, ci, mi, ci, mi, h);
  cub::DeviceRadixSort::SortPairsDescending(nullptr, c, ci, mi, ci, mi, h);
  cub::DeviceRadixSort::SortKeys(nullptr, d, ci, mi, static_cast<int>(cache_size));
  b.cub_bytes = std::max({a, c, d});
  b.cub = carver.TakeBytes(b.cub_bytes);
  b.lookup = CarveLookup(carver, cache_size);
  return b;
}

bool SizeOk(int64_t n) { return n >= 0 && n <= INT32_MAX; }

// Whether `r` has every output a lookup needs (hit_at and hit_pos may be null).
bool LookupOutputsOk(const CacheLookupResult& r) {
  return r.position != nullptr && r.miss_rank != nullptr && r.miss_ids != nullptr &&
         r.miss_at != nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

template <typename T>
cudaError_t LaunchSparseUpdate(SparseOptimizer optimizer, const SparseUpdateSlice<T>* slices,
                               int num_slices, double learning_rate, double eps,
                               cudaStream_t stream) {
  if (num_slices < 0 || num_slices > kMaxUpdateSlices || (num_slices > 0 && slices == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (optimizer != SparseOptimizer::kSgd && optimizer != SparseOptimizer::kAdagrad) {
    return cudaErrorInvalidValue;
  }
  const bool adagrad = optimizer == SparseOptimizer::kAdagrad;
  using C = AccT<T>;
  UpdateParams<T> p{};
  p.num = 0;
  p.lr = static_cast<C>(learning_rate);
  p.eps = static_cast<C>(eps);
  int64_t total_blocks = 0;
  for (int k = 0; k < num_slices; ++k) {
    const SparseUpdateSlice<T>& in = slices[k];
    if (in.n < 0 || in.width < 0 || in.num_rows < 0) return cudaErrorInvalidValue;
    if (in.n == 0 || in.width == 0) continue;
    if (in.var == nullptr || in.rows == nullptr || in.grad == nullptr ||
        (adagrad && in.accum == nullptr)) {
      return cudaErrorInvalidValue;
    }
    const bool aligned =
        Aligned16(in.var) && Aligned16(in.grad) && (!adagrad || Aligned16(in.accum));
    const RowPlan plan = PlanRows<T>(in.n, in.width, aligned);
    UpdateSlice<T>& s = p.s[p.num++];
    s.in = in;
    if (!adagrad) s.in.accum = nullptr;
    s.plan = plan;
    s.block_begin = total_blocks;
    total_blocks += plan.blocks;
  }
  if (total_blocks == 0) return cudaSuccess;
  if (adagrad) {
    SparseUpdateKernel<T, true><<<static_cast<unsigned>(total_blocks), kBlock, 0, stream>>>(p);
  } else {
    SparseUpdateKernel<T, false><<<static_cast<unsigned>(total_blocks), kBlock, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSelectRows(int64_t n, int64_t width, const T* a, int64_t a_rows,
                             const int64_t* sel_a, const T* b, int64_t b_rows, const int64_t* sel_b,
                             T* out, cudaStream_t stream) {
  if (n < 0 || width < 0 || a_rows < 0 || b_rows < 0) return cudaErrorInvalidValue;
  if (n == 0 || width == 0) return cudaSuccess;
  if (sel_a == nullptr || out == nullptr || (a == nullptr && a_rows > 0)) {
    return cudaErrorInvalidValue;
  }
  const bool aligned =
      (a == nullptr || Aligned16(a)) && (b == nullptr || Aligned16(b)) && Aligned16(out);
  const RowPlan plan = PlanRows<T>(n, width, aligned);
  SelectRowsKernel<T><<<static_cast<unsigned>(plan.blocks), kBlock, 0, stream>>>(
      n, width, plan.vecs, plan.group, plan.vec, a, a_rows, sel_a, b, b_rows, sel_b, out);
  return cudaGetLastError();
}

size_t CacheLookupScratchBytes(int64_t n) {
  if (!SizeOk(n)) return 256;
  Carver carver(nullptr);
  CarveLookup(carver, n);
  return carver.bytes();
}

cudaError_t LaunchCacheLookup(const int64_t* ids, int64_t n, const int64_t* cache_ids,
                              int64_t cache_size, int64_t miss_pad_id, const CacheLookupResult& out,
                              int64_t* counts, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream) {
  if (!SizeOk(n) || cache_size < 0 || counts == nullptr) return cudaErrorInvalidValue;
  if (n > 0 && (ids == nullptr || !LookupOutputsOk(out) || scratch == nullptr ||
                (cache_size > 0 && cache_ids == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (scratch_bytes < CacheLookupScratchBytes(n)) return cudaErrorInvalidValue;
  Carver carver(scratch);
  const LookupBuffers b = CarveLookup(carver, n);
  return RunLookup(ids, n, cache_ids, cache_size, miss_pad_id, out, counts, counts + 1, b, stream);
}

size_t CachePopulateScratchBytes(int64_t table_size, int64_t cache_size) {
  if (!SizeOk(table_size) || !SizeOk(cache_size)) return 256;
  Carver carver(nullptr);
  CarvePopulate(carver, table_size, cache_size);
  return carver.bytes();
}

cudaError_t LaunchCachePopulate(const int64_t* keys, const int64_t* counts, int64_t table_size,
                                const int64_t* old_ids, int64_t cache_size, int64_t fresh_pad_id,
                                int64_t* new_ids, const CacheLookupResult& fresh,
                                int64_t* num_fresh, void* scratch, size_t scratch_bytes,
                                cudaStream_t stream) {
  if (!SizeOk(table_size) || !SizeOk(cache_size) || num_fresh == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (cache_size == 0) return cudaMemsetAsync(num_fresh, 0, 8, stream);
  if (old_ids == nullptr || new_ids == nullptr || !LookupOutputsOk(fresh) || scratch == nullptr ||
      (table_size > 0 && (keys == nullptr || counts == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (scratch_bytes < CachePopulateScratchBytes(table_size, cache_size)) {
    return cudaErrorInvalidValue;
  }
  Carver carver(scratch);
  const PopulateBuffers b = CarvePopulate(carver, table_size, cache_size);
  const int h = static_cast<int>(table_size);
  if (table_size > 0) {
    PopulatePrepKernel<<<FlatBlocks(table_size), kBlock, 0, stream>>>(keys, counts, table_size,
                                                                      b.ids_in, b.counts_in);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    // Ascending ids, then a stable sort by descending count: count desc, id asc.
    size_t cub_bytes = b.cub_bytes;
    TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(
        b.cub, cub_bytes, b.ids_in, b.ids_by_id, b.counts_in, b.counts_by_id, h, 0, 64, stream));
    cub_bytes = b.cub_bytes;
    TTEMB_RETURN_IF_CUDA_ERROR(
        cub::DeviceRadixSort::SortPairsDescending(b.cub, cub_bytes, b.counts_by_id, b.counts_ranked,
                                                  b.ids_by_id, b.ids_ranked, h, 0, 64, stream));
  }
  PopulateChooseKernel<<<FlatBlocks(cache_size), kBlock, 0, stream>>>(
      b.ids_ranked, b.counts_ranked, table_size, cache_size, b.chosen);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  size_t cub_bytes = b.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortKeys(
      b.cub, cub_bytes, b.chosen, new_ids, static_cast<int>(cache_size), 0, 64, stream));
  const CacheLookupResult new_in_old{fresh.position, fresh.miss_rank, fresh.miss_ids,
                                     fresh.miss_at};
  return RunLookup(new_ids, cache_size, old_ids, cache_size, fresh_pad_id, new_in_old, b.num_stay,
                   num_fresh, b.lookup, stream);
}

#define TTUPD_INSTANTIATE(T)                                                                    \
  template cudaError_t LaunchSparseUpdate<T>(SparseOptimizer, const SparseUpdateSlice<T>*, int, \
                                             double, double, cudaStream_t);                     \
  template cudaError_t LaunchSelectRows<T>(int64_t, int64_t, const T*, int64_t, const int64_t*, \
                                           const T*, int64_t, const int64_t*, T*, cudaStream_t);
TTEMB_FOR_EACH_VALUE_TYPE(TTUPD_INSTANTIATE)
#undef TTUPD_INSTANTIATE

}  // namespace gpu
}  // namespace tf_ttemb
