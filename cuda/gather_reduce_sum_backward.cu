// CUDA kernels of the gather_reduce_sum gradients' first step and of the weights gradient
// alone: LaunchParamsGradPrepare sorts the entries by id and finds the segments of equal ids
// (the reduction itself is gather_reduce_sum_reduce.cu's), LaunchWeightsGrad computes the
// gradient w.r.t. the weights on its own. See gather_reduce_sum_kernels.cuh for the
// contract and gather_reduce_sum_common.cuh for the column layout every row kernel shares.

#include "cuda/gather_reduce_sum_grad_plan.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// ---------------------------------------------------------------------------
// Params gradient: preparation.

// One thread per entry: key = id for valid entries, N (sorts last) for
// padding and bad ids; value = the entry's position. With bags (B >= 1), also
// entry_bag[j] = the entry's bag (FindBag; the threads of a warp search for
// neighbouring entries, so their loads of splits mostly coincide).
template <typename Tindex, typename Key>
__global__ void BuildSortKeysKernel(const Tindex* __restrict__ ids, int64_t nnz, int64_t num_rows,
                                    bool has_padding, int64_t padding_id,
                                    const int64_t* __restrict__ splits, int64_t num_bags,
                                    Key* __restrict__ keys, int32_t* __restrict__ positions,
                                    int32_t* __restrict__ entry_bag, DeviceReport* report) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < nnz;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (num_bags > 0) entry_bag[j] = static_cast<int32_t>(FindBag(splits, num_bags, j));
    const int64_t id = static_cast<int64_t>(ids[j]);
    const bool pad = has_padding && id == padding_id;
    const bool valid = !pad && id >= 0 && id < num_rows;
    if (!valid && !pad) ReportMin(&report->first_bad_index, j);
    keys[j] = static_cast<Key>(valid ? id : num_rows);
    positions[j] = static_cast<int32_t>(j);
  }
}

// One thread per i in [0, nnz]: 1 where a segment of equal valid keys starts.
template <typename Key>
__global__ void SegmentHeadsKernel(const Key* __restrict__ keys, int64_t nnz, Key sentinel,
                                   int32_t* __restrict__ heads) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i <= nnz;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    heads[i] = i < nnz && keys[i] != sentinel && (i == 0 || keys[i] != keys[i - 1]) ? 1 : 0;
  }
}

// One thread per sorted entry i: the segment heads record their start and id;
// the last valid entry closes the last segment; thread 0 publishes U and m
// (the number of valid entries) in meta and the report.
template <typename Key>
__global__ void ScatterSegmentsKernel(const Key* __restrict__ keys, int64_t nnz, Key sentinel,
                                      const int32_t* __restrict__ heads,
                                      const int32_t* __restrict__ seg_index,  // [nnz + 1]
                                      int32_t* __restrict__ seg_start,        // [U + 1]
                                      int64_t* __restrict__ seg_id,           // [U]
                                      int64_t* __restrict__ meta,             // [2]: U, m
                                      DeviceReport* report) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nnz;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t num_unique = seg_index[nnz];
    if (heads[i]) {
      seg_start[seg_index[i]] = static_cast<int32_t>(i);
      seg_id[seg_index[i]] = static_cast<int64_t>(keys[i]);
    }
    const bool valid = keys[i] != sentinel;
    if (valid && (i + 1 == nnz || keys[i + 1] == sentinel)) {
      seg_start[num_unique] = static_cast<int32_t>(i + 1);
      meta[1] = i + 1;
    }
    if (i == 0) {
      meta[0] = num_unique;
      report->num_unique = num_unique;
      if (!valid) {
        seg_start[0] = 0;
        meta[1] = 0;
      }
    }
  }
}

// One thread per u in [0, nnz]: pieces of segment u if it has more than one,
// else 0 (and 0 past U).
__global__ void HotPiecesKernel(const int32_t* __restrict__ seg_start,
                                const int64_t* __restrict__ meta, int64_t nnz,
                                int32_t* __restrict__ hot) {
  const int64_t num_unique = meta[0];
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u <= nnz;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t pieces = 0;
    if (u < num_unique) {
      const int64_t count = seg_start[u + 1] - seg_start[u];
      const int64_t p = (count + kPieceEntries - 1) / kPieceEntries;
      pieces = p > 1 ? static_cast<int32_t>(p) : 0;
    }
    hot[u] = pieces;
  }
}

// One thread, after FinishReport: where the report holds a problem (bad ids
// or row_splits), leaves the launches after Prepare nothing to do (U = 0, no
// valid entry, no piece), so that no output row and, for the sparse apply, no
// table row is written before the caller raises the error.
__global__ void DisarmOnBadInputKernel(const DeviceReport* __restrict__ report, int64_t nnz,
                                       int64_t* __restrict__ meta,       // [2]: U, m
                                       int32_t* __restrict__ hot_off) {  // [nnz + 1]
  const bool bad = report->first_split != 0 || report->first_bad_split >= 0 ||
                   report->last_split != nnz || report->first_bad_index >= 0;
  if (!bad) return;
  meta[0] = 0;
  meta[1] = 0;
  hot_off[nnz] = 0;
}

// One thread per sorted valid entry k: its bag, and either its coefficient
// scale[b] * w (sum, mean, sqrtn) or its position inside the bag (max).
template <typename T>
__global__ void SortedEntryInfoKernel(const int32_t* __restrict__ positions,  // [nnz] sorted
                                      const int32_t* __restrict__ entry_bag,  // [nnz]
                                      const int64_t* __restrict__ splits,     // [B + 1]
                                      const T* __restrict__ weights,          // [nnz] or null
                                      const AccT<T>* __restrict__ scale,      // [B] or null
                                      const int64_t* __restrict__ meta, int64_t num_bags,
                                      int64_t nnz, bool is_max,
                                      int32_t* __restrict__ sorted_bag,      // [nnz]
                                      AccT<T>* __restrict__ sorted_coef,     // [nnz] or null
                                      int32_t* __restrict__ sorted_inbag) {  // [nnz] or null
  using A = AccT<T>;
  const int64_t valid = meta[1];
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < valid;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pos = positions[k];
    const int64_t b = entry_bag[pos];  // in [0, B)
    sorted_bag[k] = static_cast<int32_t>(b);
    if (is_max) {
      sorted_inbag[k] = static_cast<int32_t>(pos - splits[b]);
    } else {
      const A s = scale != nullptr ? scale[b] : A(1);
      sorted_coef[k] = weights != nullptr ? s * ToAcc(weights[pos]) : s;
    }
  }
}

// ---------------------------------------------------------------------------
// Weights gradient on its own.

// The problem (its sizes and bag options), the pointers and the column layout.
template <typename T, typename Tindex>
struct WeightsGradArgs : BagProblem {
  const T* grad;          // [B, D]
  const T* params;        // [N, D]
  const Tindex* ids;      // [nnz]
  const int64_t* splits;  // [B + 1]
  const T* weights;       // [nnz]
  const AccT<T>* scale;   // [B] or null (sum)
  const AccT<T>* dyout;   // [B] or null (sum)
  T* weights_grad;        // [nnz]
  DeviceReport* report;
  int64_t dim_vecs, num_items;
  int group;
};

// Work item = kWeightsGradEntries consecutive entries; the group computes
// each entry's dot <grad_b, params_row> over the whole row (lane-strided
// vectors, then a butterfly sum) and lane 0 writes dw.
template <typename T, typename Tindex, bool kAligned>
__global__ void __launch_bounds__(kBlock) WeightsGradKernel(const WeightsGradArgs<T, Tindex> a) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  const GroupWalk walk(a.group);
  const unsigned mask = GroupMask(a.group);
  for (int64_t item = walk.first; item < a.num_items; item += walk.stride) {
    const int64_t j0 = item * kWeightsGradEntries;
    const int64_t j1 = min(j0 + kWeightsGradEntries, a.nnz);
    int64_t b = FindBag(a.splits, a.num_bags, j0);
    for (int64_t j = j0; j < j1; ++j) {
      while (b + 1 < a.num_bags && a.splits[b + 1] <= j) ++b;
      const int64_t id = static_cast<int64_t>(a.ids[j]);
      const bool pad = a.has_padding_id && id == a.padding_id;
      const bool valid = !pad && id >= 0 && id < a.num_rows;
      if (!valid && !pad && walk.lane == 0) ReportMin(&a.report->first_bad_index, j);
      const A s = a.scale != nullptr ? a.scale[b] : A(1);
      if (!valid || s == A(0)) {
        if (walk.lane == 0) a.weights_grad[j] = FromAcc<T>(A(0));
        continue;
      }
      A dot = A(0);
      const T* dy_row = a.grad + b * a.dim;
      const T* p_row = a.params + id * a.dim;
#pragma unroll 4
      for (int64_t cv = walk.lane; cv < a.dim_vecs; cv += a.group) {
        const int64_t col = cv * V;
        const Pack<T> dy = LoadVec<T, kAligned>(dy_row + col, col, a.dim);
        const Pack<T> pr = LoadVec<T, kAligned>(p_row + col, col, a.dim);
#pragma unroll
        for (int e = 0; e < V; ++e) dot = fma(ToAcc(dy.v[e]), ToAcc(pr.v[e]), dot);
      }
      dot = GroupSum(dot, mask, a.group);
      if (walk.lane == 0) {
        const A g = WeightGradFromDot(a.combiner, dot, a.dyout != nullptr ? a.dyout[b] : A(0), s,
                                      ToAcc(a.weights[j]));
        a.weights_grad[j] = FromAcc<T>(g);
      }
    }
  }
}

template <typename T, typename Tindex, typename Key>
cudaError_t SortAndSegmentImpl(const BagProblem& p, const GradPlan<T>& g, const Tindex* ids,
                               const int64_t* splits, GradScratch<T>& s, DeviceReport* report,
                               cudaStream_t stream) {
  const int64_t n = p.nnz;
  Key* keys_in = static_cast<Key*>(s.sort.keys_in);
  Key* keys_out = static_cast<Key*>(s.sort.keys_out);
  const Key sentinel = static_cast<Key>(p.num_rows);
  BuildSortKeysKernel<Tindex, Key><<<GridFor(n), kBlock, 0, stream>>>(
      ids, n, p.num_rows, p.has_padding_id, p.padding_id, splits, p.num_bags, keys_in,
      s.sort.vals_in, s.entry_bag, report);
  TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  size_t bytes = s.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(s.cub_temp, bytes, keys_in, keys_out,
                                                             s.sort.vals_in, s.sort.vals_out, n, 0,
                                                             g.end_bit, stream));
  SegmentHeadsKernel<Key><<<GridFor(n + 1), kBlock, 0, stream>>>(keys_out, n, sentinel, s.heads);
  TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  bytes = s.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(
      cub::DeviceScan::ExclusiveSum(s.cub_temp, bytes, s.heads, s.seg_index, n + 1, stream));
  ScatterSegmentsKernel<Key><<<GridFor(n), kBlock, 0, stream>>>(
      keys_out, n, sentinel, s.heads, s.seg_index, s.seg_start, s.seg_id, s.meta, report);
  TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  HotPiecesKernel<<<GridFor(n + 1), kBlock, 0, stream>>>(s.seg_start, s.meta, n, s.hot);
  TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  bytes = s.cub_bytes;
  return cub::DeviceScan::ExclusiveSum(s.cub_temp, bytes, s.hot, s.hot_off, n + 1, stream);
}

}  // namespace

// ---------------------------------------------------------------------------
// Public launchers.

template <typename T, typename Tindex>
size_t ParamsGradScratchBytes(const BagProblem& p, bool dense, bool fuse_weights_grad) {
  GradScratch<T> s;
  return CarveGrad<T>(p, PlanGrad<T>(p), dense, fuse_weights_grad, nullptr, &s);
}

template <typename T, typename Tindex>
cudaError_t LaunchParamsGradPrepare(const BagProblem& p, const Tindex* ids, const int64_t* splits,
                                    const T* weights, DeviceReport* report, bool dense,
                                    bool fuse_weights_grad, void* scratch, size_t scratch_bytes,
                                    cudaStream_t stream) {
  if (!ValidProblem(p) || !GradSizesOk(p)) return cudaErrorInvalidValue;
  const GradPlan<T> g = PlanGrad<T>(p);
  GradScratch<T> s;
  if (CarveGrad<T>(p, g, dense, fuse_weights_grad, nullptr, &s) > scratch_bytes) {
    return cudaErrorInvalidValue;
  }
  CarveGrad<T>(p, g, dense, fuse_weights_grad, scratch, &s);
  TTEMB_RETURN_IF_CUDA_ERROR(InitReport(p, report, stream));
  TTEMB_RETURN_IF_CUDA_ERROR(CheckSplits(splits, p.num_bags, report, stream));
  if (p.nnz == 0) {
    TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(s.meta, 0, 2 * sizeof(int64_t), stream));
    TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(&report->num_unique, 0, sizeof(int64_t), stream));
    TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(s.hot_off, 0, sizeof(int32_t), stream));
  } else {
    if (g.wide_keys) {
      TTEMB_RETURN_IF_CUDA_ERROR(
          (SortAndSegmentImpl<T, Tindex, uint64_t>(p, g, ids, splits, s, report, stream)));
    } else {
      TTEMB_RETURN_IF_CUDA_ERROR(
          (SortAndSegmentImpl<T, Tindex, uint32_t>(p, g, ids, splits, s, report, stream)));
    }
    if (p.num_bags > 0) {
      if (s.scale != nullptr) {
        const int64_t warps_per_block = kBlock / 32;
        BagScalesKernel<T, Tindex>
            <<<static_cast<int>(std::min(CeilDiv(p.num_bags, warps_per_block), kMaxBlocks)), kBlock,
               0, stream>>>(ids, splits, p.has_weights ? weights : nullptr, nullptr, nullptr,
                            p.num_bags, p.nnz, p.dim, p.combiner, p.has_padding_id, p.padding_id,
                            s.scale, nullptr);
        TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
      }
      SortedEntryInfoKernel<T><<<GridFor(p.nnz), kBlock, 0, stream>>>(
          s.sort.vals_out, s.entry_bag, splits, p.has_weights ? weights : nullptr, s.scale, s.meta,
          p.num_bags, p.nnz, p.combiner == Combiner::kMax, s.sorted_bag, s.sorted_coef,
          s.sorted_inbag);
      TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    }
  }
  TTEMB_RETURN_IF_CUDA_ERROR(FinishReport<Tindex>(ids, p.nnz, splits, p.num_bags, report, stream));
  if (p.nnz == 0) return cudaSuccess;  // nothing to disarm: U = m = 0 already
  DisarmOnBadInputKernel<<<1, 1, 0, stream>>>(report, p.nnz, s.meta, s.hot_off);
  return LastLaunchError();
}

template <typename T>
size_t WeightsGradScratchBytes(const BagProblem& p) {
  Carver carver(nullptr);
  carver.Take<AccT<T>>(p.num_bags);
  carver.Take<AccT<T>>(p.num_bags);
  return carver.bytes();
}

template <typename T, typename Tindex>
cudaError_t LaunchWeightsGrad(const BagProblem& p, const T* grad, const T* params,
                              const Tindex* ids, const int64_t* splits, const T* weights,
                              const T* output, T* weights_grad, DeviceReport* report, void* scratch,
                              size_t scratch_bytes, cudaStream_t stream) {
  const bool scaled = p.combiner == Combiner::kMean || p.combiner == Combiner::kSqrtn;
  if (!ValidProblem(p) || p.combiner == Combiner::kMax || !p.has_weights ||
      (scaled && output == nullptr && p.num_bags * p.dim > 0) ||
      WeightsGradScratchBytes<T>(p) > scratch_bytes) {
    return cudaErrorInvalidValue;
  }
  Carver carver(scratch);
  AccT<T>* scale = carver.Take<AccT<T>>(p.num_bags);
  AccT<T>* dyout = carver.Take<AccT<T>>(p.num_bags);
  TTEMB_RETURN_IF_CUDA_ERROR(InitReport(p, report, stream));
  TTEMB_RETURN_IF_CUDA_ERROR(CheckSplits(splits, p.num_bags, report, stream));
  if (p.num_bags > 0 && p.nnz > 0) {
    if (scaled) {
      const int64_t warps_per_block = kBlock / 32;
      BagScalesKernel<T, Tindex>
          <<<static_cast<int>(std::min(CeilDiv(p.num_bags, warps_per_block), kMaxBlocks)), kBlock,
             0, stream>>>(ids, splits, weights, grad, output, p.num_bags, p.nnz, p.dim, p.combiner,
                          p.has_padding_id, p.padding_id, scale, dyout);
      TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    }
    const Columns cols = ColumnsFor<T>(p.dim);
    WeightsGradArgs<T, Tindex> a;
    static_cast<BagProblem&>(a) = p;
    a.grad = grad;
    a.params = params;
    a.ids = ids;
    a.splits = splits;
    a.weights = weights;
    a.scale = scaled ? scale : nullptr;
    a.dyout = scaled ? dyout : nullptr;
    a.weights_grad = weights_grad;
    a.report = report;
    a.dim_vecs = cols.dim_vecs;
    a.num_items = CeilDiv(p.nnz, kWeightsGradEntries);
    a.group = cols.group;
    const int grid = GridFor(a.num_items * cols.group);
    if (p.dim % VecOf<T>() == 0 && Aligned16(grad) && Aligned16(params)) {
      WeightsGradKernel<T, Tindex, true><<<grid, kBlock, 0, stream>>>(a);
    } else {
      WeightsGradKernel<T, Tindex, false><<<grid, kBlock, 0, stream>>>(a);
    }
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  } else if (p.nnz > 0) {
    // No bags but entries: row_splits is wrong (reported); the ids are still
    // checked and the gradient is zero.
    CheckIdsKernel<Tindex><<<GridFor(p.nnz), kBlock, 0, stream>>>(
        ids, p.nnz, p.num_rows, p.has_padding_id, p.padding_id, report);
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    TTEMB_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(weights_grad, 0, sizeof(T) * static_cast<size_t>(p.nnz), stream));
  }
  return FinishReport<Tindex>(ids, p.nnz, splits, p.num_bags, report, stream);
}

// ---------------------------------------------------------------------------
// Instantiations.

#define TTEMB_INSTANTIATE_T(T) template size_t WeightsGradScratchBytes<T>(const BagProblem&);
#define TTEMB_INSTANTIATE(T, Tindex)                                                            \
  template size_t ParamsGradScratchBytes<T, Tindex>(const BagProblem&, bool, bool);             \
  template cudaError_t LaunchParamsGradPrepare<T, Tindex>(                                      \
      const BagProblem&, const Tindex*, const int64_t*, const T*, DeviceReport*, bool, bool,    \
      void*, size_t, cudaStream_t);                                                             \
  template cudaError_t LaunchWeightsGrad<T, Tindex>(                                            \
      const BagProblem&, const T*, const T*, const Tindex*, const int64_t*, const T*, const T*, \
      T*, DeviceReport*, void*, size_t, cudaStream_t);

TTEMB_INSTANTIATE_BAG_LAUNCHERS(TTEMB_INSTANTIATE_T, TTEMB_INSTANTIATE)

#undef TTEMB_INSTANTIATE_T
#undef TTEMB_INSTANTIATE

}  // namespace gpu
}  // namespace tf_ttemb
