// Internal to the TT embedding backward (tt_embedding_backward_prepare.cu and
// tt_embedding_backward.cu): the plan both halves of TTRowsGrad share, i.e. which
// kernel a level takes (the by-row kernels' batch sizes, the ordered core pieces) and
// the layout of the scratch that Prepare writes and Compute reads. Everything is in an
// anonymous namespace: each .cu file has its own copy. The launchers' contract is
// tt_embedding_kernels.cuh.

#ifndef TF_TTEMB_CUDA_TT_EMBEDDING_GRAD_PLAN_CUH_
#define TF_TTEMB_CUDA_TT_EMBEDDING_GRAD_PLAN_CUH_

#include "cuda/tt_embedding_common.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

constexpr int kByRowMaxItems = 32;  // CompactBatch handles at most a warp of items
// Dynamic shared memory of the by-row kernels: 48 KB less their static arrays and a margin.
constexpr int64_t kByRowSmemBudget = 46 * 1024;
// Core gradient: items per piece. Narrow cores (width < 1024) take short pieces: more
// blocks in flight on small batches, for a piece buffer of pieces x width that stays small.
constexpr int64_t kPieceItems = 64;
constexpr int64_t kNarrowPieceItems = 16;
// Parent gradient: children per piece.
constexpr int64_t kChildPieceItems = 16;

int64_t CorePieceItems(const Geo& g, int k) {
  return g.width[k] >= 1024 ? kPieceItems : kNarrowPieceItems;
}

// Items per batch of a by-row kernel: the most (<= kByRowMaxItems) whose shared memory,
// b_bytes for the core row plus `inner` rows of (ib * M + 4) values for the batch, fits the
// budget; 0 where fewer than 64 tiles of 4 x 4 outputs per batch (`out_cols` columns) would
// leave the block mostly idle.
template <typename C>
int ByRowBatch(int64_t M, int64_t inner, int64_t out_cols, int64_t b_bytes, int64_t* smem) {
  const int64_t elem = static_cast<int64_t>(sizeof(C));
  int64_t ib = kByRowMaxItems;
  while (ib >= 1 && b_bytes + inner * (ib * M + 4) * elem > kByRowSmemBudget) --ib;
  if (ib < 1 || ib * (M / 4) * (out_cols / 4) < 64) return 0;
  *smem = b_bytes + inner * (ib * M + 4) * elem;
  return static_cast<int>(ib);
}

// ParentByRowKernel for level t: B^T [Nc, K + 4], dC^T [Nc, RP], outputs [M, K].
template <typename C>
int ByRowItems(const Geo& g, int t, int64_t* smem) {
  const int64_t M = g.M[t], K = g.K[t], Nc = g.Nc[t];
  if (Nc < 32 || M % 4 != 0 || K % 4 != 0 || Nc % 4 != 0) return 0;
  return ByRowBatch<C>(M, Nc, K, Nc * (K + 4) * static_cast<int64_t>(sizeof(C)), smem);
}

// LevelForwardByRowKernel for level t (1 <= t <= T-2): B [K, Nc], A^T [K, RP], outputs [M, Nc].
template <typename C>
int ForwardByRowItems(const Geo& g, int t, int64_t* smem) {
  const int64_t M = g.M[t], K = g.K[t], Nc = g.Nc[t];
  if (t < 1 || t + 1 >= g.T || Nc < 32 || M % 4 != 0 || Nc % 4 != 0) return 0;
  return ByRowBatch<C>(M, K, Nc, K * Nc * static_cast<int64_t>(sizeof(C)), smem);
}

// Core gradient of core k >= 2: A_n is the parent's partial P_{k-1} (S_{k-1} values, 2 KB at
// FBTT's shape) and dC_n a row of the rows' gradient or of dP_k. Sorted by core row, the
// items of a piece have parents scattered over all of P_{k-1} (90 MB at FBTT's shape and
// 1.24M ids), so with the pieces run in index order (row by row) every item's operands
// come from HBM. With many pieces the pieces are instead run in the order of their first
// item's parent (PieceOrderKeysKernel + a stable sort): the pieces in flight at a time
// read a narrow window of P_{k-1} and of dC, which L2 holds. Each piece is still summed
// into its own slot, in the same order: the same bits. H200, FBTT's shape, 1.24M ids: the
// level-2 core gradient 855 -> 455 us. Fewer pieces skip the sort: there the plain
// CorePieceKernel runs (thread per output), which did not gain from the order (Zipf ids at
// B=65,536, 15K pieces: 332 us either way, plus ~25 us for the sort).
// (-DTT_ORDER_MIN_PIECES=1 orders every such core: how the float64 sweep checks the path.)
#ifndef TT_ORDER_MIN_PIECES
#define TT_ORDER_MIN_PIECES (int64_t{1} << 14)
#endif
constexpr int64_t kOrderMinPieces = TT_ORDER_MIN_PIECES;

bool OrderCorePieces(const Geo& g, int k, int64_t nmax, int64_t max_pieces) {
  return k >= 2 && max_pieces >= kOrderMinPieces && max_pieces <= nmax;
}

struct CoreSort {
  int32_t* sorted_items = nullptr;     // [nmax]
  int32_t* piece_pos = nullptr;        // [max_pieces + 1]
  int32_t* seg_first_piece = nullptr;  // [max_rows + 1]
  int64_t* seg_row = nullptr;          // [max_rows]
  int64_t* piece_count = nullptr;      // [1]
  int64_t* row_count = nullptr;        // [1]
  int32_t* piece_order = nullptr;      // [max_pieces] or null: see PieceOrderKeysKernel
  int64_t max_pieces = 0;
  int64_t max_rows = 0;
};

template <typename T>
struct GradScratch {
  LevelBuffers levels;
  CoreSort core[kMaxTTCores];
  CoreSort child[kMaxTTCores];     // parent-gradient pieces of levels 1 .. T-1
  SortPairsBuffers<int64_t> sort;  // no vals_out: the sorts write to a CoreSort's lists
  int32_t* piece_flags = nullptr;
  int32_t* piece_incl = nullptr;
  int32_t* seg_incl = nullptr;
  AccT<T>* partial[kMaxTTCores] = {};   // P_t, t = 1 .. T-2
  AccT<T>* dpartial[kMaxTTCores] = {};  // dP_t, t = 0 .. T-2
  AccT<T>* pieces = nullptr;            // [max over cores of max_pieces * width]
};

// The scratch of TTRowsGrad has two parts. The index part (levels, sorted items, piece
// lists: int32/int64 per id) is written by Prepare and read by Compute. The work part holds
// Compute's float buffers: the partial products P_t and their gradients dP_t, one per item
// of levels 0 .. T-2 (at most `items` each), and the piece buffer (`piece_values`
// elements). Their upper bounds (items = nmax, the largest piece list nmax ids can make)
// hold for any ids; Prepare reports the sizes the ids actually need (WorkNeedsKernel), which
// for sorted distinct ids are bounded by the number of distinct prefixes instead of nmax
// (FBTT's shape, 1.24M distinct ids, H200: 425 MB instead of 8.0 GB).
template <typename T>
void CarveGradIndex(const Geo& g, int64_t nmax, Carver* c, GradScratch<T>* s,
                    int64_t* max_piece_values) {
  const size_t cub_bytes = std::max(ScanTempBytes(nmax), SortTempBytes(nmax));
  CarveLevels(g, nmax, cub_bytes, c, &s->levels);
  int64_t values = 0;
  for (int k = 0; k < g.T; ++k) {
    CoreSort& cs = s->core[k];
    cs.max_rows = std::min<int64_t>(nmax, g.tables * g.p[k]);
    cs.max_pieces = CeilDiv(nmax, CorePieceItems(g, k)) + cs.max_rows;
    cs.sorted_items = c->Take<int32_t>(nmax);
    cs.piece_pos = c->Take<int32_t>(cs.max_pieces + 1);
    cs.seg_first_piece = c->Take<int32_t>(cs.max_rows + 1);
    cs.seg_row = c->Take<int64_t>(cs.max_rows);
    cs.piece_count = c->Take<int64_t>(1);
    cs.row_count = c->Take<int64_t>(1);
    cs.piece_order =
        OrderCorePieces(g, k, nmax, cs.max_pieces) ? c->Take<int32_t>(cs.max_pieces) : nullptr;
    values = std::max(values, cs.max_pieces * g.width[k]);
  }
  for (int t = 1; t < g.T; ++t) {
    CoreSort& cs = s->child[t];
    cs.max_rows = nmax;
    cs.max_pieces = CeilDiv(nmax, kChildPieceItems) + nmax;
    cs.piece_pos = c->Take<int32_t>(cs.max_pieces + 1);
    cs.seg_first_piece = c->Take<int32_t>(cs.max_rows + 1);
    cs.seg_row = c->Take<int64_t>(cs.max_rows);
    cs.piece_count = c->Take<int64_t>(1);
    cs.row_count = c->Take<int64_t>(1);
    values = std::max(values, cs.max_pieces * g.S[t - 1]);
  }
  s->sort.Carve(*c, nmax, sizeof(int64_t), /*with_vals_out=*/false);
  s->piece_flags = c->Take<int32_t>(nmax);
  s->piece_incl = c->Take<int32_t>(nmax);
  s->seg_incl = c->Take<int32_t>(nmax);
  *max_piece_values = values;
}

template <typename T>
void CarveGradWork(const Geo& g, int64_t items, int64_t piece_values, Carver* c,
                   GradScratch<T>* s) {
  for (int t = 1; t + 1 < g.T; ++t) s->partial[t] = c->Take<AccT<T>>(items * g.S[t]);
  for (int t = 0; t + 1 < g.T; ++t) s->dpartial[t] = c->Take<AccT<T>>(items * g.S[t]);
  s->pieces = c->Take<AccT<T>>(piece_values);
}

// Bytes of the index part alone (with_work false) or of both parts, the work part at its
// upper bounds (the single-buffer layout).
template <typename T>
size_t CarveGrad(const Geo& g, int64_t nmax, void* base, GradScratch<T>* s, bool with_work) {
  Carver c(base);
  int64_t max_piece_values = 0;
  CarveGradIndex(g, nmax, &c, s, &max_piece_values);
  if (with_work) CarveGradWork(g, nmax, max_piece_values, &c, s);
  return c.bytes();
}

// The work sizes: the upper bounds, or the needs Prepare reported (never above the bounds;
// clamped all the same, so a corrupted report cannot ask for more).
template <typename T>
void WorkSizes(const Geo& g, int64_t nmax, const TTReport* prepared, int64_t* items,
               int64_t* piece_values) {
  GradScratch<T> s;
  Carver c(nullptr);
  int64_t max_values = 0;
  CarveGradIndex(g, nmax, &c, &s, &max_values);
  *items = nmax;
  *piece_values = max_values;
  if (prepared != nullptr) {
    *items = std::min(nmax, std::max<int64_t>(0, prepared->work_items));
    *piece_values = std::min(max_values, std::max<int64_t>(0, prepared->work_values));
  }
}

template <typename T>
size_t CarveWork(const Geo& g, int64_t nmax, const TTReport* prepared, void* base,
                 GradScratch<T>* s) {
  int64_t items = 0, values = 0;
  WorkSizes<T>(g, nmax, prepared, &items, &values);
  Carver c(base);
  CarveGradWork(g, items, values, &c, s);
  return c.bytes();
}

}  // namespace
}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_TT_EMBEDDING_GRAD_PLAN_CUH_
