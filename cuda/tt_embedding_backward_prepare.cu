// The first half of the TT embedding backward (TTRowsGrad): LaunchRowsGradPrepare
// checks the ids, builds the levels, sorts the items of every core by core row and
// cuts the sorted lists (and every level's children) into the pieces that
// LaunchRowsGradCompute sums; the size queries of both halves' scratch. Everything
// here depends only on the ids. See tt_embedding_kernels.cuh for the contract and
// tt_embedding_common.cuh for the levels.

#include "cuda/tt_embedding_grad_plan.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// Parent gradient, children split into pieces: key of child i of level t = its
// parent's item index at level t-1 (non-decreasing); `sentinel` past the count.
__global__ void ParentKeysKernel(Geo g, int t, const int64_t* counts, int64_t nmax,
                                 const int32_t* par_t, int64_t sentinel, int64_t* keys) {
  const bool last = t == g.T - 1;
  const int64_t n_items = last ? counts[0] : counts[1 + t];
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nmax;
       i += int64_t{gridDim.x} * blockDim.x) {
    keys[i] = i < n_items ? int64_t{par_t[i]} : sentinel;
  }
}

// Sort keys of core k: the core row of each item of level k (ids at the last
// level); items past the count get `sentinel` (sorted last).
__global__ void RowKeysKernel(Geo g, int k, const int64_t* counts, int64_t nmax,
                              const int32_t* row_k, int64_t sentinel, int64_t* keys,
                              int32_t* vals) {
  const bool last = k == g.T - 1;
  const int64_t n_items = last ? counts[0] : counts[1 + k];
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nmax;
       i += int64_t{gridDim.x} * blockDim.x) {
    keys[i] = i < n_items ? int64_t{row_k[i]} : sentinel;
    vals[i] = static_cast<int32_t>(i);
  }
}

// Piece starts (a new row, or every kPieceItems items) and segment starts.
__global__ void PieceFlagsKernel(const int64_t* keys, int64_t nmax, int64_t sentinel,
                                 int64_t piece_items, int32_t* piece_flags, int32_t* seg_flags) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nmax;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t key = keys[i];
    const bool valid = key != sentinel;
    const bool seg = valid && (i == 0 || keys[i - 1] != key);
    seg_flags[i] = seg;
    piece_flags[i] = valid && (seg || i % piece_items == 0);
  }
}

// piece_pos[piece] = first sorted position; seg_first_piece[seg] = first piece;
// seg_row[seg] = the row; counts of pieces and rows; the end markers.
__global__ void PieceListKernel(const int64_t* keys, int64_t nmax, const int32_t* piece_flags,
                                const int32_t* seg_flags, const int32_t* piece_incl,
                                const int32_t* seg_incl, int32_t* piece_pos,
                                int32_t* seg_first_piece, int64_t* seg_row, int64_t* piece_count,
                                int64_t* row_count, int64_t* report_rows) {
  const int64_t pieces = nmax > 0 ? piece_incl[nmax - 1] : 0;
  const int64_t rows = nmax > 0 ? seg_incl[nmax - 1] : 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nmax;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (piece_flags[i]) piece_pos[piece_incl[i] - 1] = static_cast<int32_t>(i);
    if (seg_flags[i]) {
      seg_first_piece[seg_incl[i] - 1] = piece_incl[i] - 1;
      seg_row[seg_incl[i] - 1] = keys[i];
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *piece_count = pieces;
    *row_count = rows;
    *report_rows = rows;
    seg_first_piece[rows] = static_cast<int32_t>(pieces);
  }
}

// piece_pos[pieces] = number of items (the first sentinel position).
__global__ void PieceEndKernel(Geo g, int k, const int64_t* counts, const int64_t* piece_count,
                               int32_t* piece_pos) {
  const bool last = k == g.T - 1;
  piece_pos[*piece_count] = static_cast<int32_t>(last ? counts[0] : counts[1 + k]);
}

// keys[q] = parent item of piece q's first item (sentinel past the pieces), vals[q] = q.
__global__ void PieceOrderKeysKernel(const int64_t* __restrict__ piece_count,
                                     const int32_t* __restrict__ piece_pos,
                                     const int32_t* __restrict__ sorted_items,
                                     const int32_t* __restrict__ par_k, int64_t max_pieces,
                                     int64_t sentinel, int64_t* keys, int32_t* vals) {
  const int64_t pieces = *piece_count;
  for (int64_t q = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; q < max_pieces;
       q += int64_t{gridDim.x} * blockDim.x) {
    keys[q] = q < pieces ? int64_t{par_k[sorted_items[piece_pos[q]]]} : sentinel;
    vals[q] = static_cast<int32_t>(q);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

// What Compute's work buffers must hold for the ids Prepare has seen (see CarveGradIndex):
// the items of levels 0 .. T-2, and the largest piece buffer of any level: core pieces x
// the core's width, parent-gradient pieces x S_{t-1}, or, where the by-row parent kernel
// runs, one slot per child item x S_{t-1}.
struct WorkNeeds {
  int T = 0;
  const int64_t* counts = nullptr;                // LevelBuffers::counts
  const int64_t* core_pieces[kMaxTTCores] = {};   // CoreSort::piece_count, cores 0 .. T-1
  const int64_t* child_pieces[kMaxTTCores] = {};  // levels 1 .. T-1
  int64_t width[kMaxTTCores] = {};
  int64_t child_width[kMaxTTCores] = {};  // S_{t-1}
  bool by_row[kMaxTTCores] = {};
};

__global__ void WorkNeedsKernel(WorkNeeds w, TTReport* report) {
  int64_t items = 0;
  for (int t = 0; t + 1 < w.T; ++t) items = max(items, w.counts[1 + t]);
  int64_t values = 0;
  for (int k = 0; k < w.T; ++k) values = max(values, *w.core_pieces[k] * w.width[k]);
  for (int t = 1; t < w.T; ++t) {
    const int64_t children = t == w.T - 1 ? w.counts[0] : w.counts[1 + t];
    const int64_t units = w.by_row[t] ? children : *w.child_pieces[t];
    values = max(values, units * w.child_width[t]);
  }
  report->work_items = items;
  report->work_values = values;
}

// The index part, with the work part at its upper bound (with_work) or without it; 0 for
// a problem or max_ids the kernels refuse.
template <typename T>
size_t GradScratchBytes(const TTProblem& p, int64_t max_ids, bool with_work) {
  Geo g;
  if (!MakeGeo(p, &g) || !ValidIdsCount(max_ids)) return 0;
  GradScratch<T> s;
  return CarveGrad<T>(g, max_ids, nullptr, &s, with_work);
}

template <typename T>
size_t RowsGradScratchBytes(const TTProblem& p, int64_t max_ids) {
  return GradScratchBytes<T>(p, max_ids, /*with_work=*/true);
}

template <typename T>
size_t RowsGradPrepareScratchBytes(const TTProblem& p, int64_t max_ids) {
  return GradScratchBytes<T>(p, max_ids, /*with_work=*/false);
}

template <typename T>
size_t RowsGradWorkBytes(const TTProblem& p, int64_t max_ids, const TTReport* prepared) {
  Geo g;
  if (!MakeGeo(p, &g) || !ValidIdsCount(max_ids)) return 0;
  GradScratch<T> s;
  return CarveWork<T>(g, max_ids, prepared, nullptr, &s);
}

namespace {

// Cuts the sorted keys of level `level` (s.sort.keys_out; `sentinel` past the items) into the
// pieces of cs: at most `piece_items` items each, never across two keys. The number of
// distinct keys also goes to *key_count.
template <typename T>
cudaError_t LaunchPieceList(const Geo& g, int level, const LevelBuffers& b, const GradScratch<T>& s,
                            int64_t nmax, int64_t sentinel, int64_t piece_items, const CoreSort& cs,
                            int64_t* key_count, cudaStream_t stream) {
  PieceFlagsKernel<<<GridFor(nmax), kBlock, 0, stream>>>(s.sort.keys_out, nmax, sentinel,
                                                         piece_items, s.piece_flags, b.flags);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  size_t bytes = b.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
      b.cub_temp, bytes, s.piece_flags, s.piece_incl, static_cast<int>(nmax), stream));
  bytes = b.cub_bytes;
  TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(b.cub_temp, bytes, b.flags, s.seg_incl,
                                                           static_cast<int>(nmax), stream));
  PieceListKernel<<<GridFor(nmax), kBlock, 0, stream>>>(
      s.sort.keys_out, nmax, s.piece_flags, b.flags, s.piece_incl, s.seg_incl, cs.piece_pos,
      cs.seg_first_piece, cs.seg_row, cs.piece_count, cs.row_count, key_count);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  PieceEndKernel<<<1, 1, 0, stream>>>(g, level, b.counts, cs.piece_count, cs.piece_pos);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchRowsGradPrepare(const TTProblem& p, const int64_t* ids, int64_t max_ids,
                                  const int64_t* num_ids, TTReport* report, void* scratch,
                                  size_t scratch_bytes, cudaStream_t stream) {
  Geo g;
  if (!MakeGeo(p, &g) || !ValidIdsCount(max_ids) || report == nullptr) {
    return cudaErrorInvalidValue;
  }
  GradScratch<T> s;
  if (CarveGrad<T>(g, max_ids, nullptr, &s, false) > scratch_bytes) return cudaErrorInvalidValue;
  CarveGrad<T>(g, max_ids, scratch, &s, false);
  const int64_t nmax = max_ids;
  LevelBuffers& b = s.levels;
  InitReportKernel<<<1, 1, 0, stream>>>(report);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  ChunkCountKernel<<<1, 1, 0, stream>>>(num_ids, max_ids, 0, std::max<int64_t>(max_ids, 1),
                                        b.counts);
  TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  TTEMB_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(report->core_rows, 0, sizeof(report->core_rows), stream));
  if (nmax > 0) {
    CheckIdsKernel<<<GridFor(nmax), kBlock, 0, stream>>>(g, ids, b.counts, 0, report);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    TTEMB_RETURN_IF_CUDA_ERROR(BuildLevels(g, ids, nmax, &b, stream));
    for (int k = 0; k < g.T; ++k) {
      CoreSort& cs = s.core[k];
      const int64_t sentinel = g.tables * g.p[k];
      RowKeysKernel<<<GridFor(nmax), kBlock, 0, stream>>>(g, k, b.counts, nmax, b.row[k], sentinel,
                                                          s.sort.keys_in, s.sort.vals_in);
      TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
      size_t bytes = b.cub_bytes;
      TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(
          b.cub_temp, bytes, s.sort.keys_in, s.sort.keys_out, s.sort.vals_in, cs.sorted_items,
          static_cast<int>(nmax), 0, BitsFor(static_cast<uint64_t>(sentinel), 64), stream));
      TTEMB_RETURN_IF_CUDA_ERROR(LaunchPieceList(g, k, b, s, nmax, sentinel, CorePieceItems(g, k),
                                                 cs, &report->core_rows[k], stream));
      if (cs.piece_order != nullptr) {
        PieceOrderKeysKernel<<<GridFor(cs.max_pieces), kBlock, 0, stream>>>(
            cs.piece_count, cs.piece_pos, cs.sorted_items, b.par[k], cs.max_pieces, nmax,
            s.sort.keys_in, s.sort.vals_in);
        TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
        bytes = b.cub_bytes;
        TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(
            b.cub_temp, bytes, s.sort.keys_in, s.sort.keys_out, s.sort.vals_in, cs.piece_order,
            static_cast<int>(cs.max_pieces), 0, BitsFor(static_cast<uint64_t>(nmax), 64), stream));
      }
    }
    for (int t = 1; t < g.T; ++t) {
      CoreSort& cs = s.child[t];
      const int64_t sentinel = nmax;
      ParentKeysKernel<<<GridFor(nmax), kBlock, 0, stream>>>(g, t, b.counts, nmax, b.par[t],
                                                             sentinel, s.sort.keys_out);
      TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
      TTEMB_RETURN_IF_CUDA_ERROR(
          LaunchPieceList(g, t, b, s, nmax, sentinel, kChildPieceItems, cs, cs.row_count, stream));
    }
    WorkNeeds needs;
    needs.T = g.T;
    needs.counts = b.counts;
    for (int k = 0; k < g.T; ++k) {
      needs.core_pieces[k] = s.core[k].piece_count;
      needs.width[k] = g.width[k];
      if (k >= 1) {
        int64_t unused = 0;
        needs.child_pieces[k] = s.child[k].piece_count;
        needs.child_width[k] = g.S[k - 1];
        needs.by_row[k] = ByRowItems<AccT<T>>(g, k, &unused) > 0;
      }
    }
    WorkNeedsKernel<<<1, 1, 0, stream>>>(needs, report);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  } else {
    for (int k = 0; k < g.T; ++k) {
      TTEMB_RETURN_IF_CUDA_ERROR(
          cudaMemsetAsync(s.core[k].piece_count, 0, sizeof(int64_t), stream));
      TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(s.core[k].row_count, 0, sizeof(int64_t), stream));
    }
  }
  FinishReportKernel<<<1, 1, 0, stream>>>(ids, num_ids, max_ids, report);
  return cudaGetLastError();
}

#define TT_INSTANTIATE_VALUE(T)                                                            \
  template size_t RowsGradScratchBytes<T>(const TTProblem&, int64_t);                      \
  template size_t RowsGradPrepareScratchBytes<T>(const TTProblem&, int64_t);               \
  template size_t RowsGradWorkBytes<T>(const TTProblem&, int64_t, const TTReport*);        \
  template cudaError_t LaunchRowsGradPrepare<T>(const TTProblem&, const int64_t*, int64_t, \
                                                const int64_t*, TTReport*, void*, size_t,  \
                                                cudaStream_t);

TTEMB_FOR_EACH_VALUE_TYPE(TT_INSTANTIATE_VALUE)

}  // namespace gpu
}  // namespace tf_ttemb
