// TfTtemb>GroupBags on the GPU (cuda/grouped_bags_kernels.cuh). Threads map to
// data as follows:
//   * CheckKernel: one thread per bag k, flags the first decreasing row_split
//     and writes the length of output bag k (example-major: output bag
//     b * T + t is input bag t * B + b; bad row_splits give 0);
//   * the example-major row_splits are an inclusive scan (CUB) of the lengths;
//   * CopyKernel: one thread per output bag, copying its entries in order
//     (read across the `indices` parts, PartsCursor), checking each id against
//     its feature's table;
//   * one-thread kernels start and finish the report.

#include <cstdint>
#include <cub/cub.cuh>
#include <limits>

#include "cuda/common.cuh"
#include "cuda/grouped_bags_kernels.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

constexpr int64_t kMaxBlocks = 65535;

int Grid(int64_t work) { return GridBlocks(work, kBlock, kMaxBlocks); }

// Input bag (feature-major) of output bag k (example-major).
__device__ __forceinline__ int64_t SourceBag(int64_t k, int64_t num_features, int64_t batch) {
  return (k % num_features) * batch + k / num_features;
}

// Length of output bag k, 0 where the row_splits decrease or leave [0, nnz].
struct LengthOf {
  const int64_t* splits;
  int64_t num_features, batch, nnz;
  __device__ __forceinline__ int64_t operator()(int64_t k) const {
    const int64_t s = SourceBag(k, num_features, batch);
    const int64_t from = splits[s], to = splits[s + 1];
    if (from < 0 || to > nnz || to < from) return 0;
    return to - from;
  }
};

__global__ void InitKernel(GroupReport* report, const int64_t* splits, int64_t num_bags,
                           int64_t nnz, int64_t* group_splits) {
  GroupReport r;
  r.first_bad_entry = r.bad_value = r.bad_feature = r.bad_position = -1;
  r.first_bad_split = r.bad_split_value = r.bad_split_prev = -1;
  r.first_split = splits[0];
  r.last_split = splits[num_bags];
  r.nnz = nnz;
  r.num_bags = num_bags;
  *report = r;
  group_splits[0] = 0;
}

// Checks input bag k's row_splits and writes the length of output bag k.
__global__ void CheckKernel(const int64_t* __restrict__ splits, LengthOf length_of,
                            int64_t num_bags, int64_t* __restrict__ lengths, GroupReport* report) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < num_bags;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (splits[k + 1] < splits[k]) ReportMin(&report->first_bad_split, k);
    lengths[k] = length_of(k);
  }
}

template <typename T, typename Tindex>
__global__ void CopyKernel(const GroupProblem p, const Tindex* const* __restrict__ parts,
                           const int64_t* __restrict__ splits, const T* __restrict__ weights,
                           const int64_t* __restrict__ group_splits,
                           int64_t* __restrict__ group_ids, T* __restrict__ group_weights,
                           int64_t* __restrict__ positions, GroupReport* report) {
  const int64_t num_features = p.num_features, batch = p.batch, nnz = p.nnz;
  const int64_t num_bags = num_features * batch;
  const int64_t* num_rows = p.features;
  const int64_t* offsets = p.features + num_features;
  const int64_t* padding = p.features + 2 * num_features;
  const int64_t* has_padding = p.features + 3 * num_features;
  const LengthOf length_of{splits, num_features, batch, nnz};
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < num_bags;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = k % num_features;
    const int64_t length = length_of(k);
    const int64_t from = splits[SourceBag(k, num_features, batch)];
    const int64_t to = group_splits[k];
    if (to < 0 || to + length > nnz) continue;  // only after bad row_splits
    if (length == 0) continue;
    PartsCursor<Tindex> ids(parts, p.part_starts, p.num_parts, from);
    const int64_t rows = num_rows[t], offset = offsets[t];
    const bool pads = has_padding[t] != 0;
    const int64_t pad = padding[t];
    int64_t first_bad = -1;
    for (int64_t e = 0; e < length; ++e) {
      const int64_t id = static_cast<int64_t>(ids[from + e]);
      int64_t row = -1;
      if (!(pads && id == pad)) {
        if (id >= 0 && id < rows) {
          row = offset + id;
        } else if (first_bad < 0) {
          first_bad = from + e;
        }
      }
      group_ids[to + e] = row;
      if (weights != nullptr) {
        group_weights[to + e] = weights[from + e];
        positions[from + e] = to + e;
      }
    }
    if (first_bad >= 0) ReportMin(&report->first_bad_entry, first_bad);
  }
}

template <typename Tindex>
__global__ void FinishKernel(const GroupProblem p, const Tindex* const* parts,
                             const int64_t* splits, GroupReport* report) {
  const int64_t num_features = p.num_features, batch = p.batch;
  GroupReport& r = *report;
  if (r.first_bad_split >= 0) {
    r.bad_split_value = splits[r.first_bad_split + 1];
    r.bad_split_prev = splits[r.first_bad_split];
  }
  const int64_t j = r.first_bad_entry;
  if (j < 0) return;
  r.bad_value = static_cast<int64_t>(PartsCursor<Tindex>(parts, p.part_starts, p.num_parts, j)[j]);
  // The feature whose entries [splits[t * B], splits[(t + 1) * B]) hold j.
  int64_t t = 0;
  while (t + 1 < num_features && splits[(t + 1) * batch] <= j) ++t;
  r.bad_feature = t;
  r.bad_position = j - splits[t * batch];
}

size_t ScanBytes(int64_t num_bags) {
  size_t bytes = 0;
  cub::DeviceScan::InclusiveSum(nullptr, bytes, static_cast<const int64_t*>(nullptr),
                                static_cast<int64_t*>(nullptr), num_bags);
  return bytes;
}

}  // namespace

// Scratch: the output bags' lengths [T * B], then CUB's scan storage.
size_t GroupBagsScratchBytes(const GroupProblem& p) {
  const int64_t num_bags = p.num_features * p.batch;
  Carver carve(nullptr);
  carve.Take<int64_t>(num_bags);
  carve.TakeBytes(num_bags > 0 ? ScanBytes(num_bags) : 0);
  return carve.bytes();
}

template <typename T, typename Tindex>
cudaError_t LaunchGroupBags(const GroupProblem& p, const Tindex* const* ids,
                            const int64_t* row_splits, const T* weights, int64_t* group_ids,
                            int64_t* group_row_splits, T* group_weights, int64_t* positions,
                            GroupReport* report, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream) {
  const int64_t num_bags = p.num_features * p.batch;
  InitKernel<<<1, 1, 0, stream>>>(report, row_splits, num_bags, p.nnz, group_row_splits);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  if (num_bags > 0) {
    Carver carve(scratch);
    int64_t* lengths = carve.Take<int64_t>(num_bags);
    size_t bytes = ScanBytes(num_bags);
    void* scan_storage = carve.TakeBytes(bytes);
    if (carve.bytes() > scratch_bytes) return cudaErrorInvalidValue;
    const LengthOf length_of{row_splits, p.num_features, p.batch, p.nnz};
    CheckKernel<<<Grid(num_bags), kBlock, 0, stream>>>(row_splits, length_of, num_bags, lengths,
                                                       report);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
        scan_storage, bytes, lengths, group_row_splits + 1, num_bags, stream));
    CopyKernel<T, Tindex><<<Grid(num_bags), kBlock, 0, stream>>>(
        p, ids, row_splits, weights, group_row_splits, group_ids, group_weights, positions, report);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  }
  FinishKernel<Tindex><<<1, 1, 0, stream>>>(p, ids, row_splits, report);
  return cudaGetLastError();
}

#define TTEMB_INSTANTIATE(T, Tindex)                                                               \
  template cudaError_t LaunchGroupBags<T, Tindex>(                                                 \
      const GroupProblem&, const Tindex* const*, const int64_t*, const T*, int64_t*, int64_t*, T*, \
      int64_t*, GroupReport*, void*, size_t, cudaStream_t);
#define TTEMB_INSTANTIATE_BOTH(T) TTEMB_INSTANTIATE(T, int32_t) TTEMB_INSTANTIATE(T, int64_t)
TTEMB_FOR_EACH_VALUE_TYPE(TTEMB_INSTANTIATE_BOTH)
#undef TTEMB_INSTANTIATE_BOTH
#undef TTEMB_INSTANTIATE

}  // namespace gpu
}  // namespace tf_ttemb
