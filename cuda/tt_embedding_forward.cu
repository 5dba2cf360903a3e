// CUDA kernels of the TT embedding forward: TTUniqueIds (the distinct ids of a batch and
// each entry's slot) and TTRows (the requested rows, decompressed level by level). See
// tt_embedding_kernels.cuh for the contract and tt_embedding_common.cuh for the levels.

#include "cuda/tt_embedding_common.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// ---------------------------------------------------------------------------
// TTUniqueIds kernels.

template <typename Tindex>
__global__ void UniqueKeysKernel(UniqueIdsProblem p, const Tindex* ids, const int64_t* table_splits,
                                 int64_t sentinel, int64_t* keys, int32_t* vals, TTReport* report) {
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < p.nnz;
       j += int64_t{gridDim.x} * blockDim.x) {
    // Table of entry j: the last t with table_splits[t] <= j (splits clamped).
    int64_t lo = 0, hi = p.num_tables;  // answer in [0, num_tables)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (table_splits[mid] <= j) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int64_t v = static_cast<int64_t>(ids[j]);
    int64_t key = sentinel;
    if (p.has_padding_id && v == p.padding_id) {
      key = sentinel;
    } else if (v < 0 || v >= p.num_embeddings) {
      atomicMin(reinterpret_cast<unsigned long long*>(&report->first_bad_index),
                static_cast<unsigned long long>(j));
    } else {
      key = lo * p.stride + v;
    }
    keys[j] = key;
    vals[j] = static_cast<int32_t>(j);
  }
}

template <typename Tindex>
__global__ void UniqueFlagsKernel(int64_t nnz, const int64_t* keys, int64_t sentinel,
                                  int32_t* flags) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nnz;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t key = keys[i];
    flags[i] = key != sentinel && (i == 0 || keys[i - 1] != key);
  }
}

template <typename Tindex>
__global__ void UniqueScatterKernel(int64_t nnz, const int64_t* keys, const int32_t* vals,
                                    const int32_t* flags, const int32_t* incl, int64_t sentinel,
                                    int64_t* unique_ids, Tindex* slots) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nnz;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t key = keys[i];
    if (flags[i]) unique_ids[incl[i] - 1] = key;
    slots[vals[i]] = static_cast<Tindex>(key == sentinel ? -1 : incl[i] - 1);
  }
}

template <typename Tindex>
__global__ void UniqueFinishKernel(const Tindex* ids, int64_t nnz, const int32_t* incl,
                                   TTReport* report) {
  FinishBadIndex(ids, report);
  report->num_unique = nnz > 0 ? incl[nnz - 1] : 0;
  report->num_ids = nnz;
}

struct UniqueScratch {
  SortPairsBuffers<int64_t> sort;  // (global id or sentinel, entry position)
  int32_t* flags = nullptr;
  int32_t* incl = nullptr;
  void* cub_temp = nullptr;
  size_t cub_bytes = 0;
};

size_t CarveUnique(int64_t nnz, void* base, UniqueScratch* s) {
  Carver c(base);
  s->sort.Carve(c, nnz, sizeof(int64_t));
  s->flags = c.Take<int32_t>(nnz);
  s->incl = c.Take<int32_t>(nnz);
  s->cub_bytes = std::max(ScanTempBytes(nnz), SortTempBytes(nnz));
  s->cub_temp = c.TakeBytes(s->cub_bytes);
  return c.bytes();
}

bool UniqueProblemOk(const UniqueIdsProblem& p) {
  if (p.nnz < 0 || p.nnz >= (int64_t{1} << 31) - 2 || p.num_tables < 1 || p.num_embeddings < 1 ||
      p.stride < p.num_embeddings) {
    return false;
  }
  return p.stride <= ((int64_t{1} << 62) - 1) / p.num_tables;
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

template <typename Tindex>
size_t UniqueIdsScratchBytes(const UniqueIdsProblem& p) {
  UniqueScratch s;
  return CarveUnique(std::max<int64_t>(p.nnz, 0), nullptr, &s);
}

template <typename Tindex>
cudaError_t LaunchUniqueIds(const UniqueIdsProblem& p, const Tindex* ids,
                            const int64_t* table_splits, int64_t* unique_ids, Tindex* slots,
                            TTReport* report, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream) {
  if (!UniqueProblemOk(p) || report == nullptr) return cudaErrorInvalidValue;
  UniqueScratch s;
  if (CarveUnique(p.nnz, nullptr, &s) > scratch_bytes) return cudaErrorInvalidValue;
  CarveUnique(p.nnz, scratch, &s);
  InitReportKernel<<<1, 1, 0, stream>>>(report);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  if (p.nnz > 0) {
    const int64_t sentinel = p.num_tables * p.stride;
    UniqueKeysKernel<Tindex><<<GridFor(p.nnz), kBlock, 0, stream>>>(
        p, ids, table_splits, sentinel, s.sort.keys_in, s.sort.vals_in, report);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    size_t bytes = s.cub_bytes;
    TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(
        s.cub_temp, bytes, s.sort.keys_in, s.sort.keys_out, s.sort.vals_in, s.sort.vals_out,
        static_cast<int>(p.nnz), 0, BitsFor(static_cast<uint64_t>(sentinel), 64), stream));
    UniqueFlagsKernel<Tindex>
        <<<GridFor(p.nnz), kBlock, 0, stream>>>(p.nnz, s.sort.keys_out, sentinel, s.flags);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    bytes = s.cub_bytes;
    TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(s.cub_temp, bytes, s.flags, s.incl,
                                                             static_cast<int>(p.nnz), stream));
    UniqueScatterKernel<Tindex><<<GridFor(p.nnz), kBlock, 0, stream>>>(
        p.nnz, s.sort.keys_out, s.sort.vals_out, s.flags, s.incl, sentinel, unique_ids, slots);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  }
  UniqueFinishKernel<Tindex><<<1, 1, 0, stream>>>(ids, p.nnz, s.incl, report);
  return cudaGetLastError();
}

template <typename T>
size_t RowsScratchBytes(const TTProblem& p, int64_t max_ids) {
  Geo g;
  if (!MakeGeo(p, &g) || !ValidIdsCount(max_ids)) return 0;
  LevelBuffers b;
  AccT<T>* partial[kMaxTTCores] = {};
  return CarveRows<T>(g, RowsChunk<T>(g, max_ids), nullptr, &b, partial);
}

template <typename T>
cudaError_t LaunchRows(const TTProblem& p, const int64_t* ids, int64_t max_ids,
                       const int64_t* num_ids, const T* const* cores, T* rows, TTReport* report,
                       void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  Geo g;
  if (!MakeGeo(p, &g) || !ValidIdsCount(max_ids) || report == nullptr || cores == nullptr) {
    return cudaErrorInvalidValue;
  }
  for (int k = 0; k < g.T; ++k) {
    if (cores[k] == nullptr) return cudaErrorInvalidValue;
  }
  const int64_t chunk = RowsChunk<T>(g, max_ids);
  LevelBuffers b;
  AccT<T>* partial[kMaxTTCores] = {};
  if (CarveRows<T>(g, chunk, nullptr, &b, partial) > scratch_bytes) return cudaErrorInvalidValue;
  CarveRows<T>(g, chunk, scratch, &b, partial);
  InitReportKernel<<<1, 1, 0, stream>>>(report);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  for (int64_t begin = 0; begin < max_ids; begin += chunk) {
    const int64_t nmax = std::min(chunk, max_ids - begin);
    const int64_t* cids = ids + begin;
    ChunkCountKernel<<<1, 1, 0, stream>>>(num_ids, max_ids, begin, chunk, b.counts);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    CheckIdsKernel<<<GridFor(nmax), kBlock, 0, stream>>>(g, cids, b.counts, begin, report);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    TTEMB_RETURN_IF_CUDA_ERROR(BuildLevels(g, cids, nmax, &b, stream));
    T* out = rows + begin * g.D;
    for (int t = 1; t < g.T; ++t) {
      const bool last = t == g.T - 1;
      cudaError_t err;
      if (t == 1) {
        err =
            last ? LaunchLevelForward<T, T, T>(g, t, cids, nmax, b, cores[0], cores[t], out, stream)
                 : LaunchLevelForward<T, T, AccT<T>>(g, t, cids, nmax, b, cores[0], cores[t],
                                                     partial[t], stream);
      } else {
        err = last ? LaunchLevelForward<AccT<T>, T, T>(g, t, cids, nmax, b, partial[t - 1],
                                                       cores[t], out, stream)
                   : LaunchLevelForward<AccT<T>, T, AccT<T>>(g, t, cids, nmax, b, partial[t - 1],
                                                             cores[t], partial[t], stream);
      }
      TTEMB_RETURN_IF_CUDA_ERROR(err);
    }
  }
  FinishReportKernel<<<1, 1, 0, stream>>>(ids, num_ids, max_ids, report);
  return cudaGetLastError();
}

#define TT_INSTANTIATE_VALUE(T)                                                                 \
  template size_t RowsScratchBytes<T>(const TTProblem&, int64_t);                               \
  template cudaError_t LaunchRows<T>(const TTProblem&, const int64_t*, int64_t, const int64_t*, \
                                     const T* const*, T*, TTReport*, void*, size_t, cudaStream_t);

TTEMB_FOR_EACH_VALUE_TYPE(TT_INSTANTIATE_VALUE)

#define TT_INSTANTIATE_INDEX(I)                                                              \
  template size_t UniqueIdsScratchBytes<I>(const UniqueIdsProblem&);                         \
  template cudaError_t LaunchUniqueIds<I>(const UniqueIdsProblem&, const I*, const int64_t*, \
                                          int64_t*, I*, TTReport*, void*, size_t, cudaStream_t);

TT_INSTANTIATE_INDEX(int32_t)
TT_INSTANTIATE_INDEX(int64_t)

}  // namespace gpu
}  // namespace tf_ttemb
