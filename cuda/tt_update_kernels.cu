// CUDA kernels and launcher of TTCacheCount's frequency counting (the op library's
// TTCacheCount GPU kernel calls it). See the header for the contract; this file holds
// how threads map to data.
//
// Counting: one warp per set of the frequency table, lane w holding way w;
// the batch's distinct ids reach their set in ascending order through two
// stable radix sorts (by id, on the bits id_bound needs; then by set) and a
// run-length encoding; a bounds pass finds each set's slice of the runs.
//
// The rest of the device-side row cache (lookup, populate, row select) and the fused
// TT update, which only the ctypes harness calls, are python/gpu_harness/tt_cache_kernels.cu.

#include <algorithm>
#include <climits>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>

#include "cuda/common.cuh"
#include "cuda/tt_update_kernels.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// ---------------------------------------------------------------------------
// Frequency counting.

// The set hash is the CPU kernel's: MixId of cuda/common_types.h.

// Set of each run (num_sets for negative ids and for i >= num_runs, which
// sorts them after every real set), and the run's index as the sort value.
__global__ void SetKeysKernel(const int64_t* unique, const int64_t* num_runs, int64_t n,
                              uint64_t num_sets, uint32_t* set_key, int32_t* run_index) {
  const int64_t runs = *num_runs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t key = static_cast<uint32_t>(num_sets);
    if (i < runs && unique[i] >= 0) {
      key = static_cast<uint32_t>(MixId(static_cast<uint64_t>(unique[i])) % num_sets);
    }
    set_key[i] = key;
    run_index[i] = static_cast<int32_t>(i);
  }
}

// Where each set's entries start and end in the sorted set keys (sets with no
// entry keep the zeros the caller stored).
__global__ void SetBoundsKernel(const uint32_t* set_key, int64_t n, int32_t* start, int32_t* end) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t key = set_key[i];
    if (i == 0 || set_key[i - 1] != key) start[key] = static_cast<int32_t>(i);
    if (i == n - 1 || set_key[i + 1] != key) end[key] = static_cast<int32_t>(i + 1);
  }
}

// One warp per set; lane w holds way w of the set in registers. The set's
// runs (ascending ids) are applied one at a time, as the CPU kernel does;
// the warp loads 32 runs at a time (one per lane) and walks them by shuffles.
__global__ void __launch_bounds__(kBlock)
    CountSetsKernel(const int32_t* set_start, const int32_t* set_end, const int32_t* run_index,
                    const int64_t* unique, const int64_t* run_length, int64_t num_sets,
                    int64_t ways, int64_t table_size, int64_t* keys, int64_t* counts) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kBlock / 32);
  for (int64_t set = blockIdx.x * static_cast<int64_t>(kBlock / 32) + threadIdx.x / 32;
       set < num_sets; set += warps) {
    const int64_t lo = set_start[set];
    const int64_t hi = set_end[set];
    if (lo >= hi) continue;
    const int64_t base = set * ways;
    const int64_t way = base + lane;
    const bool valid = lane < ways && way < table_size;
    int64_t key = valid ? keys[way] : 0;
    int64_t count = valid ? counts[way] : 0;
    for (int64_t chunk = lo; chunk < hi; chunk += 32) {
      long long my_id = 0, my_m = 0;
      if (chunk + lane < hi) {
        const int32_t run = run_index[chunk + lane];
        my_id = unique[run];
        my_m = run_length[run];
      }
      const int steps = static_cast<int>(min(int64_t{32}, hi - chunk));
      for (int k = 0; k < steps; ++k) {
        const int64_t id = __shfl_sync(0xffffffffu, my_id, k);
        const int64_t m = __shfl_sync(0xffffffffu, my_m, k);
        const unsigned found = __ballot_sync(0xffffffffu, valid && key == id);
        if (found != 0) {
          if (lane == __ffs(found) - 1) count += m;
          continue;
        }
        const unsigned empty = __ballot_sync(0xffffffffu, valid && key < 0);
        if (empty != 0) {
          if (lane == __ffs(empty) - 1) {
            key = id;
            count = m;
          }
          continue;
        }
        // Smallest count, lowest way on ties, over the (all occupied) ways.
        long long best = valid ? count : LLONG_MAX;
        int best_lane = valid ? lane : 32;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
          const long long other = __shfl_xor_sync(0xffffffffu, best, offset);
          const int other_lane = __shfl_xor_sync(0xffffffffu, best_lane, offset);
          if (other < best || (other == best && other_lane < best_lane)) {
            best = other;
            best_lane = other_lane;
          }
        }
        if (lane == best_lane) {
          key = id;
          count += m;
        }
      }
    }
    if (valid) {
      keys[way] = key;
      counts[way] = count;
    }
  }
}

// ---------------------------------------------------------------------------
// Host helpers.

int EndBit(uint64_t max_value) { return BitsFor(max_value, 32); }

// Bits of the id sort: enough for every id below id_bound (0: all 64).
int IdBits(int64_t id_bound) {
  if (id_bound <= 0) return 64;
  int bits = 1;
  while (bits < 63 && ((id_bound - 1) >> bits) != 0) ++bits;
  return bits;
}

// CUB temporary bytes of every CUB call of the counting pipeline.
size_t CountCubBytes(int64_t n, int end_bit, int id_bits) {
  size_t a = 0, b = 0, c = 0;
  const int items = static_cast<int>(n);
  cub::DeviceRadixSort::SortKeys(nullptr, a, static_cast<const int64_t*>(nullptr),
                                 static_cast<int64_t*>(nullptr), items, 0, id_bits);
  cub::DeviceRunLengthEncode::Encode(nullptr, b, static_cast<const int64_t*>(nullptr),
                                     static_cast<int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                     static_cast<int64_t*>(nullptr), items);
  cub::DeviceRadixSort::SortPairs(
      nullptr, c, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), items, 0, end_bit);
  return std::max({a, b, c});
}

struct CountBuffers {
  int64_t* sorted;
  int64_t* unique;
  int64_t* run_length;
  int64_t* num_runs;
  uint32_t* set_key_in;
  uint32_t* set_key;
  int32_t* run_in;
  int32_t* run;
  int32_t* set_start;  // [num_sets + 1]
  int32_t* set_end;    // [num_sets + 1]
  void* cub;
  size_t cub_bytes;
};

CountBuffers CarveCount(Carver& carver, int64_t n, int64_t num_sets, int id_bits) {
  CountBuffers b;
  b.sorted = carver.Take<int64_t>(n);
  b.unique = carver.Take<int64_t>(n);
  b.run_length = carver.Take<int64_t>(n);
  b.num_runs = carver.Take<int64_t>(1);
  b.set_key_in = carver.Take<uint32_t>(n);
  b.set_key = carver.Take<uint32_t>(n);
  b.run_in = carver.Take<int32_t>(n);
  b.run = carver.Take<int32_t>(n);
  b.set_start = carver.Take<int32_t>(2 * (num_sets + 1));
  b.set_end = b.set_start == nullptr ? nullptr : b.set_start + (num_sets + 1);
  b.cub_bytes = CountCubBytes(n, EndBit(static_cast<uint64_t>(num_sets)), id_bits);
  b.cub = carver.TakeBytes(b.cub_bytes);
  return b;
}

int64_t NumSets(int64_t table_size, int64_t* ways) {
  *ways = std::min<int64_t>(32, table_size);
  return CeilDiv(table_size, *ways);
}
bool SizeOk(int64_t n) { return n >= 0 && n <= INT32_MAX; }

}  // namespace

// ---------------------------------------------------------------------------
// Launcher.

size_t CacheCountScratchBytes(int64_t n, int64_t table_size, int64_t id_bound) {
  if (!SizeOk(n) || table_size <= 0) return 256;
  int64_t ways;
  const int64_t num_sets = NumSets(table_size, &ways);
  Carver carver(nullptr);
  CarveCount(carver, n, num_sets, IdBits(id_bound));
  return carver.bytes();
}

cudaError_t LaunchCacheCount(const int64_t* ids, int64_t n, int64_t id_bound, int64_t* keys,
                             int64_t* counts, int64_t table_size, void* scratch,
                             size_t scratch_bytes, cudaStream_t stream) {
  if (!SizeOk(n) || table_size < 0) return cudaErrorInvalidValue;
  if (n == 0 || table_size == 0) return cudaSuccess;
  if (ids == nullptr || keys == nullptr || counts == nullptr || scratch == nullptr) {
    return cudaErrorInvalidValue;
  }
  int64_t ways;
  const int64_t num_sets = NumSets(table_size, &ways);
  if (num_sets >= static_cast<int64_t>(UINT32_MAX)) return cudaErrorInvalidValue;
  if (scratch_bytes < CacheCountScratchBytes(n, table_size, id_bound)) {
    return cudaErrorInvalidValue;
  }
  Carver carver(scratch);
  const int id_bits = IdBits(id_bound);
  const CountBuffers b = CarveCount(carver, n, num_sets, id_bits);
  const int items = static_cast<int>(n);
  size_t cub_bytes = b.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(
      cub::DeviceRadixSort::SortKeys(b.cub, cub_bytes, ids, b.sorted, items, 0, id_bits, stream));
  cub_bytes = b.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceRunLengthEncode::Encode(
      b.cub, cub_bytes, b.sorted, b.unique, b.run_length, b.num_runs, items, stream));
  SetKeysKernel<<<FlatBlocks(n), kBlock, 0, stream>>>(
      b.unique, b.num_runs, n, static_cast<uint64_t>(num_sets), b.set_key_in, b.run_in);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  cub_bytes = b.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(
      cub::DeviceRadixSort::SortPairs(b.cub, cub_bytes, b.set_key_in, b.set_key, b.run_in, b.run,
                                      items, 0, EndBit(static_cast<uint64_t>(num_sets)), stream));
  TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      b.set_start, 0, sizeof(int32_t) * 2 * static_cast<size_t>(num_sets + 1), stream));
  SetBoundsKernel<<<FlatBlocks(n), kBlock, 0, stream>>>(b.set_key, n, b.set_start, b.set_end);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  const int64_t warps_per_block = kBlock / 32;
  const unsigned blocks =
      static_cast<unsigned>(std::min(CeilDiv(num_sets, warps_per_block), int64_t{65535}));
  CountSetsKernel<<<blocks, kBlock, 0, stream>>>(b.set_start, b.set_end, b.run, b.unique,
                                                 b.run_length, num_sets, ways, table_size, keys,
                                                 counts);
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace tf_ttemb
