// CUDA kernels of the params gradient's reduction: LaunchParamsGradReduce sums each
// segment of equal ids (found by LaunchParamsGradPrepare, gather_reduce_sum_backward.cu) in
// a fixed order into the deduplicated or dense gradient, optionally with the weights
// gradient fused in; LaunchParamsGradApply applies an optimizer step to each row where its
// sum is complete instead. See gather_reduce_sum_kernels.cuh for the contract and
// gather_reduce_sum_common.cuh for the column layout every row kernel shares.

#include "cuda/gather_reduce_sum_grad_plan.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// ---------------------------------------------------------------------------
// Params gradient: reduction.

template <typename T>
struct ReduceArgs {
  const T* grad;                // [B, D]
  const int32_t* argmax;        // [B, D] or null
  const int32_t* sorted_bag;    // [m]
  const AccT<T>* sorted_coef;   // [m] (not max)
  const int32_t* sorted_inbag;  // [m] (max)
  const int32_t* seg_start;     // [U + 1]
  const int64_t* seg_id;        // [U]
  const int32_t* hot;           // [nnz + 1]
  const int32_t* hot_off;       // [nnz + 1]
  const int64_t* meta;          // [2]: U, m
  AccT<T>* part;                // [hot pieces, D]
  T* values;                    // [U, D] or null
  T* dense;                     // [N, D] or null
  const T* params;              // [N, D] (fusion) or null
  AccT<T>* pdot;                // [chunks, nnz] (fusion) or null
  int64_t dim, dim_vecs, chunks, nnz, num_items;
  int64_t seg_blocks;  // run kernel: blocks of kRunSegments segments
  int group;
  bool is_max;
  // LaunchParamsGradApply: a row's sums update table[row] (and state) by
  // `update` instead of being written to values.
  bool apply;
  RowUpdate<AccT<T>> update;
  T* table;        // [N, D] or null
  AccT<T>* state;  // [N] / [N, D] or null
};

// Adds the entries k0..k1 of the sorted order to acc, in order. The lane's
// vectors are base + i * G, i < NV. With fusion, also writes each entry's
// partial dot <grad_b, params_row> over this column chunk to pdot. All lanes
// of the group run this together (the shuffles need them); inactive vectors
// read nothing and count as zeros. The bags and coefficients of the next
// entries are loaded while the current grad rows are in flight.
template <typename T, bool kAligned, int NV>
__device__ __forceinline__ void ReduceEntries(const ReduceArgs<T>& a, int64_t k0, int64_t k1,
                                              int64_t base, int64_t chunk, unsigned mask, int lane,
                                              const AccT<T> (&prow)[NV][VecOf<T>()],
                                              AccT<T> (&acc)[NV][VecOf<T>()]) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  constexpr int U = kUnroll / NV;
  // info: the entry's coefficient, or for max its position inside the bag
  // (the int's bits).
  int32_t bag[U];
  A info[U];
  auto load_info = [&](int64_t k) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      bag[u] = 0;
      info[u] = A(0);
      if (k + u < k1) {
        bag[u] = a.sorted_bag[k + u];
        info[u] = a.is_max ? IntBitsAsAcc<A>(a.sorted_inbag[k + u]) : a.sorted_coef[k + u];
      }
    }
  };
  load_info(k0);
  for (int64_t k = k0; k < k1; k += U) {
    int32_t cur_bag[U];
    A cur_info[U];
    Pack<T> dy[U][NV];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cur_bag[u] = bag[u];
      cur_info[u] = info[u];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t cv = base + i * a.group;
        if (k + u < k1 && cv < a.dim_vecs) {
          dy[u][i] = LoadVec<T, kAligned>(a.grad + static_cast<int64_t>(bag[u]) * a.dim + cv * V,
                                          cv * V, a.dim);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) dy[u][i].v[e] = FromAcc<T>(A(0));
        }
      }
    }
    load_info(k + U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k + u >= k1) continue;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t cv = base + i * a.group;
        if (cv >= a.dim_vecs) continue;
        if (a.is_max) {
          const int32_t inbag = AccBitsAsInt(cur_info[u]);
          const Ints<V> am = LoadInts<V, kAligned>(
              a.argmax + static_cast<int64_t>(cur_bag[u]) * a.dim + cv * V, cv * V, a.dim);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            acc[i][e] += am.v[e] == inbag ? ToAcc(dy[u][i].v[e]) : A(0);
          }
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) acc[i][e] = fma(cur_info[u], ToAcc(dy[u][i].v[e]), acc[i][e]);
        }
      }
    }
    if (a.pdot != nullptr) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (k + u >= k1) continue;  // uniform across the group
        A dot = A(0);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
#pragma unroll
          for (int e = 0; e < V; ++e) dot = fma(ToAcc(dy[u][i].v[e]), prow[i][e], dot);
        }
        dot = GroupSum(dot, mask, a.group);
        if (lane == 0) a.pdot[chunk * a.nnz + k + u] = dot;
      }
    }
  }
}

template <typename T, bool kAligned, int NV>
__device__ __forceinline__ void LoadParamsRow(const ReduceArgs<T>& a, int64_t row, int64_t base,
                                              AccT<T> (&prow)[NV][VecOf<T>()]) {
  constexpr int V = VecOf<T>();
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t cv = base + i * a.group;
    if (a.params != nullptr && cv < a.dim_vecs) {
      const Pack<T> x = LoadVec<T, kAligned>(a.params + row * a.dim + cv * V, cv * V, a.dim);
#pragma unroll
      for (int e = 0; e < V; ++e) prow[i][e] = ToAcc(x.v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) prow[i][e] = AccT<T>(0);
    }
  }
}

// Row-wise Adagrad's step for row `row`, whose summed gradient the lanes of
// one group hold between them (lane: vectors base + i * stride, i < NV): adds
// the row's mean g^2 to its accumulator (the sum of squares taken per lane in
// (i, e) order, then over the group in GroupSum's order) and returns
// lr / (sqrt(a) + eps), 0 for a zero denominator. Every lane of the group
// calls it; `leader` (one lane) stores the accumulator.
template <typename T, int NV>
__device__ __forceinline__ AccT<T> RowwiseStepOf(const ReduceArgs<T>& a, int64_t row, int64_t base,
                                                 int stride, unsigned mask, bool leader,
                                                 const AccT<T> (&acc)[NV][VecOf<T>()]) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  A square_sum = A(0);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t cv = base + i * stride;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      if (cv < a.dim_vecs && cv * V + e < a.dim) square_sum = fma(acc[i][e], acc[i][e], square_sum);
    }
  }
  square_sum = GroupSum(square_sum, mask, a.group);
  const A next = a.state[row] + square_sum / static_cast<A>(a.dim);
  __syncwarp(mask);
  if (leader) a.state[row] = next;
  return RowwiseStep(a.update, next);
}

// The store of LaunchParamsGradApply: row `row` of the table, this lane's
// vectors base + i * stride (i < NV), updated in place with their summed
// gradient acc. `old` holds those vectors as they were (raw 16 bytes, aligned
// rows only) or is null, and then they are read here. Every lane of the
// group calls it (row-wise Adagrad sums over the group).
template <typename T, bool kAligned, int NV>
__device__ __forceinline__ void ApplyGradRow(const ReduceArgs<T>& a, int64_t row, int64_t base,
                                             int stride, unsigned mask, bool leader,
                                             const AccT<T> (&acc)[NV][VecOf<T>()],
                                             const uint4* old = nullptr) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  if (row < 0 || row >= a.update.num_rows) return;  // uniform across the group
  const bool rowwise = a.update.optimizer == RowOptimizer::kRowwiseAdagrad;
  const A step = rowwise ? RowwiseStepOf<T, NV>(a, row, base, stride, mask, leader, acc) : A(0);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t cv = base + i * stride;
    if (cv >= a.dim_vecs) continue;
    T* dst = a.table + row * a.dim + cv * V;
    A w[V];
    if (kAligned && old != nullptr) {
      RawToAcc<T>(old[i], w);
    } else {
      const Pack<T> x = LoadVec<T, kAligned, /*kReadOnly=*/false>(dst, cv * V, a.dim);
#pragma unroll
      for (int e = 0; e < V; ++e) w[e] = ToAcc(x.v[e]);
    }
    switch (a.update.optimizer) {
      case RowOptimizer::kSgd:
#pragma unroll
        for (int e = 0; e < V; ++e) w[e] = SgdElement(a.update, w[e], acc[i][e]);
        break;
      case RowOptimizer::kRowwiseAdagrad:
#pragma unroll
        for (int e = 0; e < V; ++e) w[e] = RowwiseElement(step, w[e], acc[i][e]);
        break;
      case RowOptimizer::kAdagrad: {
        A* s = a.state + row * a.dim + cv * V;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          if (cv * V + e < a.dim) w[e] = AdagradElement(a.update, w[e], acc[i][e], s + e);
        }
        break;
      }
    }
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = FromAcc<T>(w[e]);
    StoreVec<T, kAligned>(dst, o, cv * V, a.dim);
  }
}

// Writes row u's sums (this lane's vectors of the column chunk at base) to
// values, the dense gradient, or, for LaunchParamsGradApply, into the table.
template <typename T, bool kAligned, int NV>
__device__ __forceinline__ void WriteGradRow(const ReduceArgs<T>& a, int64_t u, int64_t row,
                                             int64_t base, unsigned mask, bool leader,
                                             const AccT<T> (&acc)[NV][VecOf<T>()]) {
  constexpr int V = VecOf<T>();
  if (a.apply) {
    ApplyGradRow<T, kAligned, NV>(a, row, base, a.group, mask, leader, acc);
    return;
  }
  T* dst = a.values != nullptr ? a.values + u * a.dim : a.dense + row * a.dim;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t cv = base + i * a.group;
    if (cv >= a.dim_vecs) continue;
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = FromAcc<T>(acc[i][e]);
    StoreVec<T, kAligned>(dst + cv * V, o, cv * V, a.dim);
  }
}

// Work item = (segment u, column chunk), for segments of at most
// kPieceEntries entries: the group reduces the whole segment and writes the
// gradient row.
template <typename T, bool kAligned, int NV>
__global__ void __launch_bounds__(kBlock, 2) ReduceSegmentsKernel(const ReduceArgs<T> a) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  const GroupWalk walk(a.group);
  const unsigned mask = GroupMask(a.group);
  const int64_t num_unique = a.meta[0];
  for (int64_t item = walk.first; item < a.num_items; item += walk.stride) {
    int64_t u, chunk;
    DivMod(item, a.chunks, &u, &chunk);
    if (u >= num_unique) continue;  // uniform across the group
    const int32_t hot = a.hot[u];
    const int64_t k0 = a.seg_start[u], k1 = a.seg_start[u + 1];
    const int64_t row = a.seg_id[u];
    if (hot > 0) continue;
    const int64_t base = chunk * a.group * NV + walk.lane;
    A prow[NV][V], acc[NV][V];
    LoadParamsRow<T, kAligned, NV>(a, row, base, prow);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
      for (int e = 0; e < V; ++e) acc[i][e] = A(0);
    }
    ReduceEntries<T, kAligned, NV>(a, k0, k1, base, chunk, mask, walk.lane, prow, acc);
    WriteGradRow<T, kAligned, NV>(a, u, row, base, mask, walk.lane == 0, acc);
  }
}

// ReduceSegmentsKernel for narrow rows (a group of at most 16 lanes holds the row: the
// segments are not split into column chunks) and a plain weighted sum (no max, no fused
// weights gradient). Made for batches of mostly distinct ids (a recommendation batch over a
// large table: ~1 entry per segment), where each segment is a chain of three dependent
// loads (bounds, entry, dy row) and the time is set by how many chains are in flight:
// kNarrowEntries entries per step (the next step's bags and coefficients loading while this
// step's dy rows are in flight) instead of kUnroll, and no max or fused state, so the kernel
// needs few registers (f32: 40 against ReduceSegmentsKernel's 112) and fits
// kNarrowMinBlocks blocks per SM (against 2). Each output is the same fma chain as
// ReduceSegmentsKernel's (from zero, one fma per entry in sorted order): the same bits.
// Both values halved the deduplicated backward of ~1-entry segments on an H200
// (cuda/BENCH_NOTES.md, "Tuning constants").
constexpr int kNarrowEntries = 2;
constexpr int kNarrowMinBlocks = 6;

template <typename T, bool kAligned>
__global__ void __launch_bounds__(kBlock, kNarrowMinBlocks)
    ReduceNarrowSegmentsKernel(const ReduceArgs<T> a) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  constexpr int E = kNarrowEntries;
  const GroupWalk walk(a.group);
  const int64_t num_unique = a.meta[0];
  const int64_t cv = walk.lane;  // one column chunk, one vector per lane
  const bool active = cv < a.dim_vecs;
  const int64_t end = num_unique < a.num_items ? num_unique : a.num_items;
  for (int64_t u = walk.first; u < end; u += walk.stride) {
    if (a.hot[u] > 0) continue;  // long segment: ReducePiecesKernel's
    const int64_t k0 = a.seg_start[u], k1 = a.seg_start[u + 1];
    const int64_t row = a.seg_id[u];
    A acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = A(0);
    // The next step's bags and coefficients load while this step's dy rows are in flight.
    int32_t bag[E];
    A coef[E];
    auto load_info = [&](int64_t k) {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const bool has = k + j < k1;
        bag[j] = has ? a.sorted_bag[k + j] : 0;
        coef[j] = has ? a.sorted_coef[k + j] : A(0);
      }
    };
    load_info(k0);
    for (int64_t k = k0; k < k1; k += E) {
      Pack<T> dy[E];
      A cur[E];
#pragma unroll
      for (int j = 0; j < E; ++j) {
        cur[j] = coef[j];
        if (active && k + j < k1) {
          dy[j] = LoadVec<T, kAligned>(a.grad + static_cast<int64_t>(bag[j]) * a.dim + cv * V,
                                       cv * V, a.dim);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) dy[j].v[e] = FromAcc<T>(A(0));
        }
      }
      load_info(k + E);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if (k + j >= k1) continue;
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = fma(cur[j], ToAcc(dy[j].v[e]), acc[e]);
      }
    }
    if (a.apply) {
      const A(&acc1)[1][V] = reinterpret_cast<const A(&)[1][V]>(acc);
      ApplyGradRow<T, kAligned, 1>(a, row, cv, a.group, GroupMask(a.group), walk.lane == 0, acc1);
    } else if (active) {
      T* dst = a.values != nullptr ? a.values + u * a.dim : a.dense + row * a.dim;
      Pack<T> o;
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = FromAcc<T>(acc[e]);
      StoreVec<T, kAligned>(dst + cv * V, o, cv * V, a.dim);
    }
  }
}

// Sum over the 32 lanes of U values per lane (one per entry) at once: returns
// in each lane the total of value e = lane >> (5 - log2 U), in every lane of
// that lane's group of 32 / U. Each value gets GroupSum's additions (partners
// at offsets 16, 8, ..., 1, own value first), so the totals are bitwise
// GroupSum's; but each halving stage only sends the half of the values that
// the partner keeps: U - 1 + 5 - log2 U shuffles for U values instead of 5 U.
template <int U>
__host__ __device__ constexpr int Log2Of() {
  return U <= 1 ? 0 : 1 + Log2Of<U / 2>();
}
template <int U, typename A>
__device__ __forceinline__ A WarpSumTransposed(A (&p)[U], int lane) {
  constexpr int kStages = Log2Of<U>();
#pragma unroll
  for (int st = 0; st < kStages; ++st) {
    const int half = U >> (st + 1);
    const int offset = 16 >> st;
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < U / 2; ++i) {
      if (i < half) {
        const A send = upper ? p[i] : p[i + half];
        const A keep = upper ? p[i + half] : p[i];
        p[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
      }
    }
  }
  A x = p[0];
#pragma unroll
  for (int offset = 16 >> kStages; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// One 16-byte vector of a row, read once (params rows of the fused weights
// gradient are used by one segment and chunk only), and one of the dense or
// deduplicated gradient, written once: evict-first, so that they pass through
// L2 without pushing out the dy rows. On since run 4 measured it faster
// (cuda/BENCH_NOTES.md, "Tuning constants"); false gives plain loads and stores.
constexpr bool kRunHints = true;
__device__ __forceinline__ uint4 LoadOnce(const uint4* p) {
  if constexpr (kRunHints) {
    return __ldcs(p);
  } else {
    return __ldg(p);
  }
}
__device__ __forceinline__ void StoreOnce(uint4* p, const uint4& x) {
  if constexpr (kRunHints) {
    __stcs(p, x);
  } else {
    *p = x;
  }
}

// 16 bytes from global to shared memory without going through registers
// (cp.async, sm_80+; cached in L2 only). A thread sees its own copies once it
// has waited for their group.
__device__ __forceinline__ void CopyAsync16(uint4* smem, const uint4* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Work item = (column chunk, block of kRunSegments consecutive segments),
// chunk-major: the warps running at a time read one column chunk of dy (a
// 1 / chunks slice of it, which L2 holds). Lane l holds segment u0 + l's
// bounds, row and whether it is hot (split into pieces, done by
// ReducePiecesKernel). The warp walks each run of consecutive segments that
// are not hot as one stream of entries, in steps of U = kRunVectors / NV
// entries: lane l holds the sorted bag and coefficient of entries ib + l and
// ib + 32 + l (refilled as the walk passes them) and hands them out by
// shuffles. The dy vectors of a step go straight from global to the warp's
// ring of kRunStages steps in shared memory (cp.async, each lane its own
// vectors, so no barrier), issued kRunStages - 1 steps ahead of the step being
// summed: kRunStages * kRunVectors 16-byte loads in flight per lane without
// registers to hold them. A step adds its entries to the current segment's
// sums in entry order, writing the segment's row and starting the next one
// where a segment ends; the params row of the fused weights gradient is loaded
// one segment ahead. So no step waits on anything but loads issued steps
// earlier. The additions are ReduceSegmentsKernel's for the same column
// layout, in its order (one fma per entry in sorted order; partial dots summed
// over lanes in GroupSum's order): a fixed order per output row, whatever the
// timing. Needs 16-byte aligned rows, a full warp per item (group == 32), no
// max, and kRunSmemBytes of dynamic shared memory (LaunchRuns; where a device
// cannot give it, ReduceSegmentsKernel does the segments instead).
template <typename T, int NV, bool kFused>
__global__ void __launch_bounds__(kBlock, kRunMinBlocks) ReduceRunsKernel(const ReduceArgs<T> a) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  constexpr int U = kRunVectors / NV;
  constexpr int G = kRunStages;
  static_assert(U >= 1 && U <= 32 && (U & (U - 1)) == 0, "U must be a power of two");
  static_assert(G >= 2 && G * U <= 32, "the steps in flight must lie in two info batches");
  constexpr unsigned kAll = 0xffffffffu;
  extern __shared__ uint4 run_smem[];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  // This warp's ring: [stage][u][i][lane].
  uint4* const ring = run_smem + (threadIdx.x / 32) * (G * U * NV * 32) + lane;
  const int64_t num_unique = a.meta[0];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (kBlock / 32);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * (kBlock / 32) + threadIdx.x / 32;
       item < a.num_items; item += stride) {
    const int64_t chunk = item / a.seg_blocks;
    const int64_t u0 = (item - chunk * a.seg_blocks) * kRunSegments;
    if (u0 >= num_unique) continue;                 // uniform across the warp
    const int64_t base = chunk * (32 * NV) + lane;  // the lane's first vector
    bool vec_ok[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) vec_ok[i] = base + i * 32 < a.dim_vecs;
    // Lane l: segment u0 + l; stop: hot, or past the last segment. Entry
    // indices fit in int32 (GradSizesOk).
    int32_t s_start = 0, s_end = 0;
    int64_t s_row = 0;
    bool stop = true;
    if (u0 + lane < num_unique) {
      s_start = a.seg_start[u0 + lane];
      s_end = a.seg_start[u0 + lane + 1];
      s_row = a.seg_id[u0 + lane];
      stop = a.hot[u0 + lane] > 0;
    }
    const unsigned stops = __ballot_sync(kAll, stop);

    auto load_row = [&](int64_t row, uint4(&r)[NV]) {
      const uint4* src = reinterpret_cast<const uint4*>(a.params + row * a.dim) + base;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        r[i] = vec_ok[i] ? LoadOnce(src + i * 32) : make_uint4(0, 0, 0, 0);
      }
    };

    int sa = 0;
    while (sa < 32) {
      const unsigned avail = ~stops & (kAll << sa);
      if (avail == 0) break;
      sa = __ffs(avail) - 1;                              // first segment of the run
      const unsigned after = stops & (kAll << sa);        // sa is not in stops
      const int sb = after != 0 ? __ffs(after) - 1 : 32;  // one past its last
      const int ka = __shfl_sync(kAll, s_start, sa);
      const int kb = __shfl_sync(kAll, s_end, sb - 1);
      int cur = sa;
      int cur_end = __shfl_sync(kAll, s_end, cur);
      int64_t cur_row = __shfl_sync(kAll, s_row, cur);
      uint4 prow[NV], prow_next[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) prow[i] = prow_next[i] = make_uint4(0, 0, 0, 0);
      if constexpr (kFused) {
        load_row(cur_row, prow);
        const int64_t next_row = __shfl_sync(kAll, s_row, (cur + 1) & 31);
        if (cur + 1 < sb) load_row(next_row, prow_next);
      }
      A acc[NV][V];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
#pragma unroll
        for (int e = 0; e < V; ++e) acc[i][e] = A(0);
      }
      // Writes the current segment's sums and clears them.
      auto flush = [&]() {
        if (a.apply) {
          ApplyGradRow<T, true, NV>(a, cur_row, base, 32, kAll, lane == 0, acc,
                                    kFused ? prow : nullptr);
#pragma unroll
          for (int i = 0; i < NV; ++i) {
#pragma unroll
            for (int e = 0; e < V; ++e) acc[i][e] = A(0);
          }
          return;
        }
        T* dst = a.values != nullptr ? a.values + (u0 + cur) * a.dim : a.dense + cur_row * a.dim;
        uint4* out = reinterpret_cast<uint4*>(dst) + base;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (vec_ok[i]) StoreOnce(out + i * 32, AccToRaw<T>(acc[i]));
#pragma unroll
          for (int e = 0; e < V; ++e) acc[i][e] = A(0);
        }
      };
      // Entry info: lane l holds entries ib + l (bag0, coef0) and ib + 32 + l
      // (bag1, coef1). Every entry the walk asks for lies in [ib, ib + 64):
      // the summed one in [ib, ib + 32), the issued ones at most G * U - 1 +
      // U - 1 < 32 further.
      int ib = ka;
      int32_t bag0 = 0, bag1 = 0;
      A coef0 = A(0), coef1 = A(0);
      auto fetch = [&](int k, int32_t* bag, A* coef) {
        if (k < kb) {
          *bag = a.sorted_bag[k];
          *coef = a.sorted_coef[k];
        }
      };
      fetch(ka + lane, &bag0, &coef0);
      fetch(ka + 32 + lane, &bag1, &coef1);
      // Issues the copies of step st (entries ka + st * U + u) into ring slot
      // st % G and commits them as one group (empty past the run).
      auto issue = [&](int st) {
        uint4* slot = ring + (st % G) * (U * NV * 32);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = ka + st * U + u;
          const int idx = k - ib;  // uniform, in [0, 64) while k < kb
          const int32_t bag = __shfl_sync(kAll, idx < 32 ? bag0 : bag1, idx & 31);
          if (k < kb) {
            const uint4* src = reinterpret_cast<const uint4*>(a.grad + bag * a.dim) + base;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
              if (vec_ok[i]) CopyAsync16(slot + (u * NV + i) * 32, src + i * 32);
            }
          }
        }
        CopyAsyncCommit();
      };
      const int steps = (kb - ka + U - 1) / U;
#pragma unroll
      for (int st = 0; st < G; ++st) issue(st);
#pragma unroll 1
      for (int st = 0; st < steps; ++st) {
        CopyAsyncWait<G - 1>();  // step st has landed (this lane's copies)
        const uint4* slot = ring + (st % G) * (U * NV * 32);
        A p[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          p[u] = A(0);
          const int k = ka + st * U + u;
          if (k >= kb) continue;  // uniform across the warp
          if (k == ib + 32) {     // uniform: the walk enters the second batch
            ib += 32;
            bag0 = bag1;
            coef0 = coef1;
            fetch(ib + 32 + lane, &bag1, &coef1);
          }
          if (k == cur_end) {  // uniform: segment cur ended, k starts cur + 1
            flush();
            ++cur;
            cur_end = __shfl_sync(kAll, s_end, cur);
            cur_row = __shfl_sync(kAll, s_row, cur);
            if constexpr (kFused) {
#pragma unroll
              for (int i = 0; i < NV; ++i) prow[i] = prow_next[i];
              const int64_t next_row = __shfl_sync(kAll, s_row, (cur + 1) & 31);
              if (cur + 1 < sb) load_row(next_row, prow_next);
            }
          }
          const A c = __shfl_sync(kAll, coef0, k - ib);
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            const uint4 x = vec_ok[i] ? slot[(u * NV + i) * 32] : make_uint4(0, 0, 0, 0);
            A f[V];
            RawToAcc<T>(x, f);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[i][e] = fma(c, f[e], acc[i][e]);
            if constexpr (kFused) {
              A pf[V];
              RawToAcc<T>(prow[i], pf);
#pragma unroll
              for (int e = 0; e < V; ++e) p[u] = fma(f[e], pf[e], p[u]);
            }
          }
        }
        if constexpr (kFused) {
          const A d = WarpSumTransposed<U>(p, lane);
          const int k = ka + st * U + (lane >> (5 - Log2Of<U>()));
          if ((lane & (32 / U - 1)) == 0 && k < kb) {
            a.pdot[chunk * a.nnz + k] = d;
          }
        }
        issue(st + G);  // into the slot just summed
      }
      flush();
      sa = sb;
    }
  }
}

// The segment u of piece q: the largest u < num_unique with hot_off[u] <= q.
template <typename T>
__device__ __forceinline__ int64_t SegmentOfPiece(const ReduceArgs<T>& a, int64_t q,
                                                  int64_t num_unique) {
  int64_t lo = 0, hi = num_unique;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (a.hot_off[mid] <= q) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

// Work item = (piece q of a long segment, column chunk): the group reduces
// kPieceEntries entries into part[q].
template <typename T, bool kAligned, int NV>
__global__ void __launch_bounds__(kBlock, 2) ReducePiecesKernel(const ReduceArgs<T> a) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  const GroupWalk walk(a.group);
  const unsigned mask = GroupMask(a.group);
  const int64_t num_unique = a.meta[0];
  const int64_t num_pieces = a.hot_off[a.nnz];
  for (int64_t item = walk.first; item < a.num_items; item += walk.stride) {
    int64_t q, chunk;
    DivMod(item, a.chunks, &q, &chunk);
    if (q >= num_pieces) continue;  // uniform across the group
    const int64_t u = SegmentOfPiece(a, q, num_unique);
    const int64_t k0 = a.seg_start[u] + (q - a.hot_off[u]) * kPieceEntries;
    const int64_t k1 = min(k0 + kPieceEntries, static_cast<int64_t>(a.seg_start[u + 1]));
    const int64_t base = chunk * a.group * NV + walk.lane;
    A prow[NV][V], acc[NV][V];
    LoadParamsRow<T, kAligned, NV>(a, a.seg_id[u], base, prow);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
      for (int e = 0; e < V; ++e) acc[i][e] = A(0);
    }
    ReduceEntries<T, kAligned, NV>(a, k0, k1, base, chunk, mask, walk.lane, prow, acc);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t col = (base + i * a.group) * V;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (base + i * a.group < a.dim_vecs && col + e < a.dim) {
          a.part[q * a.dim + col + e] = acc[i][e];
        }
      }
    }
  }
}

// Work item = (piece q, column chunk), as in ReducePiecesKernel: the group
// of the first piece of a long segment sums the segment's pieces in piece
// order and writes the gradient row.
template <typename T, bool kAligned, int NV>
__global__ void __launch_bounds__(kBlock) CombinePiecesKernel(const ReduceArgs<T> a) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  const GroupWalk walk(a.group);
  const int64_t num_unique = a.meta[0];
  const int64_t num_pieces = a.hot_off[a.nnz];
  for (int64_t item = walk.first; item < a.num_items; item += walk.stride) {
    int64_t q, chunk;
    DivMod(item, a.chunks, &q, &chunk);
    if (q >= num_pieces) continue;  // uniform across the group
    const int64_t u = SegmentOfPiece(a, q, num_unique);
    if (q != a.hot_off[u]) continue;  // not the segment's first piece
    const int64_t base = chunk * a.group * NV + walk.lane;
    A acc[NV][V];
    const int64_t q0 = q, q1 = q0 + a.hot[u];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t col = (base + i * a.group) * V;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        acc[i][e] = A(0);
        if (base + i * a.group >= a.dim_vecs || col + e >= a.dim) continue;
        for (int64_t r = q0; r < q1; ++r) acc[i][e] += a.part[r * a.dim + col + e];
      }
    }
    WriteGradRow<T, kAligned, NV>(a, u, a.seg_id[u], base, GroupMask(a.group), walk.lane == 0, acc);
  }
}

// One thread per u < U: marks row seg_id[u] as written by the reduction.
__global__ void MarkRowsKernel(const int64_t* __restrict__ seg_id, const int64_t* __restrict__ meta,
                               int64_t bound, uint8_t* __restrict__ touched) {
  const int64_t num_unique = min(meta[0], bound);
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < num_unique;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    touched[seg_id[u]] = 1;
  }
}

// Work item = row: its group zeros the row of the dense gradient when no
// segment writes it (the group's lanes stride over the row's vectors).
template <typename T, bool kAligned>
__global__ void ZeroUntouchedRowsKernel(T* __restrict__ dense,                // [N, D]
                                        const uint8_t* __restrict__ touched,  // [N]
                                        int64_t dim, int64_t dim_vecs, int64_t num_rows,
                                        int group) {
  constexpr int V = VecOf<T>();
  const GroupWalk walk(group);
  Pack<T> zero;
#pragma unroll
  for (int e = 0; e < V; ++e) zero.v[e] = FromAcc<T>(AccT<T>(0));
  for (int64_t row = walk.first; row < num_rows; row += walk.stride) {
    if (touched[row]) continue;
    for (int64_t cv = walk.lane; cv < dim_vecs; cv += group) {
      StoreVec<T, kAligned>(dense + row * dim + cv * V, zero, cv * V, dim);
    }
  }
}

template <typename Tindex>
__global__ void WriteUniqueIdsKernel(const int64_t* __restrict__ seg_id,
                                     const int64_t* __restrict__ meta,
                                     Tindex* __restrict__ unique_ids) {
  const int64_t num_unique = meta[0];
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < num_unique;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    unique_ids[u] = static_cast<Tindex>(seg_id[u]);
  }
}

// One thread per sorted entry k: sums the chunk partial dots in chunk order
// and writes dw at the entry's position; 0 for padding (sorted last).
template <typename T>
__global__ void FusedWeightsGradKernel(const int32_t* __restrict__ positions,  // [nnz] sorted
                                       const int32_t* __restrict__ sorted_bag,
                                       const AccT<T>* __restrict__ pdot,   // [chunks, nnz]
                                       const AccT<T>* __restrict__ scale,  // [B] or null
                                       const AccT<T>* __restrict__ dyout,  // [B] or null
                                       const T* __restrict__ weights,      // [nnz]
                                       const int64_t* __restrict__ meta, int64_t nnz,
                                       int64_t chunks, Combiner combiner,
                                       T* __restrict__ weights_grad) {  // [nnz]
  using A = AccT<T>;
  const int64_t valid = meta[1];
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < nnz;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pos = positions[k];
    A g = A(0);
    if (k < valid) {
      const int64_t b = sorted_bag[k];
      const A s = scale != nullptr ? scale[b] : A(1);
      if (s != A(0)) {
        A dot = A(0);
        for (int64_t c = 0; c < chunks; ++c) dot += pdot[c * nnz + k];
        g = WeightGradFromDot(combiner, dot, dyout != nullptr ? dyout[b] : A(0), s,
                              ToAcc(weights[pos]));
      }
    }
    weights_grad[pos] = FromAcc<T>(g);
  }
}

template <typename T>
ReduceArgs<T> MakeReduceArgs(const BagProblem& p, const GradPlan<T>& g, const GradScratch<T>& s,
                             const T* grad, const int32_t* argmax, T* values, T* dense,
                             const WeightsGradFusion<T>* fusion) {
  ReduceArgs<T> a;
  a.grad = grad;
  a.argmax = argmax;
  a.sorted_bag = s.sorted_bag;
  a.sorted_coef = s.sorted_coef;
  a.sorted_inbag = s.sorted_inbag;
  a.seg_start = s.seg_start;
  a.seg_id = s.seg_id;
  a.hot = s.hot;
  a.hot_off = s.hot_off;
  a.meta = s.meta;
  a.part = s.part;
  a.values = values;
  a.dense = dense;
  a.params = fusion != nullptr ? fusion->params : nullptr;
  a.pdot = fusion != nullptr ? s.pdot : nullptr;
  a.dim = p.dim;
  a.dim_vecs = g.cols.dim_vecs;
  a.chunks = g.cols.chunks;
  a.nnz = p.nnz;
  a.num_items = 0;
  a.seg_blocks = 0;
  a.group = g.cols.group;
  a.is_max = p.combiner == Combiner::kMax;
  a.apply = false;
  a.table = nullptr;
  a.state = nullptr;
  return a;
}

// Launches ReduceRunsKernel<T, NV, kFused> with its shared memory; false
// (and nothing launched) if the device cannot give that much to a block.
template <typename T, int NV, bool kFused>
bool LaunchRuns(const ReduceArgs<T>& a, cudaStream_t stream) {
  auto* kernel = ReduceRunsKernel<T, NV, kFused>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRunSmemBytes) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  kernel<<<GridFor(a.num_items * 32), kBlock, kRunSmemBytes, stream>>>(a);
  return true;
}

template <typename T, bool kAligned, int NV>
cudaError_t LaunchReduceKernels(ReduceArgs<T> a, const GradPlan<T>& g, cudaStream_t stream) {
  const int64_t group = g.cols.group;
  bool runs = false;
  if constexpr (kAligned) {
    if (group == 32 && !a.is_max) {
      // Segments not split into pieces: ReduceRunsKernel, chunk-major items.
      ReduceArgs<T> r = a;
      r.seg_blocks = CeilDiv(g.unique_bound, kRunSegments);
      r.num_items = r.seg_blocks * g.cols.chunks;
      runs = r.num_items == 0 || (r.pdot != nullptr ? LaunchRuns<T, NV, true>(r, stream)
                                                    : LaunchRuns<T, NV, false>(r, stream));
      TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    }
  }
  if (!runs) {
    a.num_items = g.unique_bound * g.cols.chunks;
    if (a.num_items > 0) {
      if (NV == 1 && group <= 16 && g.cols.chunks == 1 && !a.is_max && a.pdot == nullptr) {
        ReduceNarrowSegmentsKernel<T, kAligned>
            <<<GridFor(a.num_items * group), kBlock, 0, stream>>>(a);
      } else {
        ReduceSegmentsKernel<T, kAligned, NV>
            <<<GridFor(a.num_items * group), kBlock, 0, stream>>>(a);
      }
      TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    }
  }
  // Long segments: pieces, then their combination (both over pieces).
  ReduceArgs<T> pieces = a;
  pieces.num_items = g.piece_bound * g.cols.chunks;
  if (pieces.num_items > 0) {
    ReducePiecesKernel<T, kAligned, NV>
        <<<GridCapped(pieces.num_items * group), kBlock, 0, stream>>>(pieces);
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    CombinePiecesKernel<T, kAligned, NV>
        <<<GridCapped(pieces.num_items * group), kBlock, 0, stream>>>(pieces);
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  }
  return cudaSuccess;
}

template <typename T, bool kAligned>
cudaError_t LaunchReduceKernels(const ReduceArgs<T>& a, const GradPlan<T>& g, cudaStream_t stream) {
  if (g.cols.nv > 1) return LaunchReduceKernels<T, kAligned, kReduceWideNV<T>>(a, g, stream);
  return LaunchReduceKernels<T, kAligned, 1>(a, g, stream);
}

}  // namespace

// ---------------------------------------------------------------------------
// Public launchers.

template <typename T>
bool ApplyFusesIntoReduce(const BagProblem& p, RowOptimizer optimizer) {
  return optimizer != RowOptimizer::kRowwiseAdagrad || PlanGrad<T>(p).cols.chunks <= 1;
}

namespace {

// Where LaunchParamsGradApply's sums go instead of values or dense.
template <typename T>
struct ApplyTarget {
  RowUpdate<AccT<T>> update;
  T* table;
  AccT<T>* state;
};

// LaunchParamsGradReduce (apply null) and LaunchParamsGradApply.
template <typename T, typename Tindex>
cudaError_t ReduceParamsGrad(const BagProblem& p, const T* grad, const int32_t* argmax,
                             Tindex* unique_ids, T* values, T* dense,
                             const WeightsGradFusion<T>* fusion, const ApplyTarget<T>* apply,
                             void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  const bool is_dense = dense != nullptr;
  const bool fused = fusion != nullptr;
  const bool outputs_ok =
      apply == nullptr ? is_dense != (values != nullptr)
                       : !is_dense && values == nullptr && unique_ids == nullptr &&
                             ApplyFusesIntoReduce<T>(p, apply->update.optimizer) &&
                             apply->update.num_rows == p.num_rows && apply->update.dim == p.dim &&
                             (apply->table != nullptr || p.num_rows * p.dim == 0) &&
                             (apply->update.optimizer == RowOptimizer::kSgd ||
                              apply->state != nullptr || p.num_rows == 0) &&
                             (!fused || fusion->params == apply->table);
  if (!ValidProblem(p) || !GradSizesOk(p) || !outputs_ok ||
      (p.combiner == Combiner::kMax && (argmax == nullptr || fused)) ||
      (fused && ((fusion->params == nullptr && p.num_rows * p.dim > 0) ||
                 (p.nnz > 0 && (fusion->weights == nullptr || fusion->weights_grad == nullptr)) ||
                 !p.has_weights))) {
    return cudaErrorInvalidValue;
  }
  const bool scaled = p.combiner == Combiner::kMean || p.combiner == Combiner::kSqrtn;
  if (fused && scaled && fusion->output == nullptr && p.num_bags * p.dim > 0) {
    return cudaErrorInvalidValue;
  }
  const GradPlan<T> g = PlanGrad<T>(p);
  GradScratch<T> s;
  if (CarveGrad<T>(p, g, is_dense, fused, nullptr, &s) > scratch_bytes) {
    return cudaErrorInvalidValue;
  }
  CarveGrad<T>(p, g, is_dense, fused, scratch, &s);

  if (is_dense && p.num_rows > 0 && p.dim > 0) {
    TTEMB_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(s.touched, 0, p.num_rows, stream));
    if (g.unique_bound > 0) {
      MarkRowsKernel<<<GridFor(g.unique_bound), kBlock, 0, stream>>>(s.seg_id, s.meta,
                                                                     g.unique_bound, s.touched);
      TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    }
    const Columns zc = ColumnsFor<T>(p.dim);
    const int grid = GridCapped(p.num_rows * zc.group);
    if (p.dim % VecOf<T>() == 0 && Aligned16(dense)) {
      ZeroUntouchedRowsKernel<T, true>
          <<<grid, kBlock, 0, stream>>>(dense, s.touched, p.dim, zc.dim_vecs, p.num_rows, zc.group);
    } else {
      ZeroUntouchedRowsKernel<T, false>
          <<<grid, kBlock, 0, stream>>>(dense, s.touched, p.dim, zc.dim_vecs, p.num_rows, zc.group);
    }
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  }
  if (fused && scaled && p.num_bags > 0) {
    const int64_t warps_per_block = kBlock / 32;
    BagScalesKernel<T, Tindex>
        <<<static_cast<int>(std::min(CeilDiv(p.num_bags, warps_per_block), kMaxBlocks)), kBlock, 0,
           stream>>>(nullptr, nullptr, nullptr, grad, fusion->output, p.num_bags, p.nnz, p.dim,
                     p.combiner, false, 0, nullptr, s.dyout);
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  }
  if (p.nnz > 0 && p.dim > 0 && p.num_bags > 0) {
    ReduceArgs<T> a = MakeReduceArgs<T>(p, g, s, grad, argmax, values, dense, fusion);
    const void* target = is_dense ? static_cast<const void*>(dense) : values;
    if (apply != nullptr) {
      a.apply = true;
      a.update = apply->update;
      a.table = apply->table;
      a.state = apply->state;
      target = apply->table;
    }
    const bool aligned = p.dim % VecOf<T>() == 0 && Aligned16(grad) && Aligned16(target) &&
                         (!fused || Aligned16(fusion->params)) &&
                         (argmax == nullptr || Aligned16(argmax));
    if (aligned) {
      TTEMB_RETURN_IF_CUDA_ERROR((LaunchReduceKernels<T, true>(a, g, stream)));
    } else {
      TTEMB_RETURN_IF_CUDA_ERROR((LaunchReduceKernels<T, false>(a, g, stream)));
    }
  }
  if (unique_ids != nullptr && g.unique_bound > 0) {
    WriteUniqueIdsKernel<Tindex>
        <<<GridFor(g.unique_bound), kBlock, 0, stream>>>(s.seg_id, s.meta, unique_ids);
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  }
  if (fused && p.nnz > 0 && p.num_bags > 0) {
    FusedWeightsGradKernel<T><<<GridFor(p.nnz), kBlock, 0, stream>>>(
        s.sort.vals_out, s.sorted_bag, s.pdot, s.scale, s.dyout, fusion->weights, s.meta, p.nnz,
        p.dim > 0 ? g.cols.chunks : 0, p.combiner, fusion->weights_grad);
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
  } else if (fused && p.nnz > 0) {
    // Entries but no bags: row_splits is wrong (reported by Prepare).
    TTEMB_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(fusion->weights_grad, 0, sizeof(T) * static_cast<size_t>(p.nnz), stream));
  }
  return cudaSuccess;
}

}  // namespace

template <typename T, typename Tindex>
cudaError_t LaunchParamsGradReduce(const BagProblem& p, const T* grad, const int32_t* argmax,
                                   Tindex* unique_ids, T* values, T* dense,
                                   const WeightsGradFusion<T>* fusion, void* scratch,
                                   size_t scratch_bytes, cudaStream_t stream) {
  return ReduceParamsGrad<T, Tindex>(p, grad, argmax, unique_ids, values, dense, fusion,
                                     /*apply=*/nullptr, scratch, scratch_bytes, stream);
}

template <typename T, typename Tindex>
cudaError_t LaunchParamsGradApply(const BagProblem& p, const T* grad, const int32_t* argmax,
                                  const RowUpdate<AccT<T>>& update, T* table, AccT<T>* accumulator,
                                  const WeightsGradFusion<T>* fusion, void* scratch,
                                  size_t scratch_bytes, cudaStream_t stream) {
  const ApplyTarget<T> target{update, table, accumulator};
  return ReduceParamsGrad<T, Tindex>(p, grad, argmax, /*unique_ids=*/nullptr,
                                     /*values=*/nullptr, /*dense=*/nullptr, fusion, &target,
                                     scratch, scratch_bytes, stream);
}

// ---------------------------------------------------------------------------
// Instantiations.

#define TTEMB_INSTANTIATE_T(T) \
  template bool ApplyFusesIntoReduce<T>(const BagProblem&, RowOptimizer);
#define TTEMB_INSTANTIATE(T, Tindex)                                                             \
  template cudaError_t LaunchParamsGradReduce<T, Tindex>(                                        \
      const BagProblem&, const T*, const int32_t*, Tindex*, T*, T*, const WeightsGradFusion<T>*, \
      void*, size_t, cudaStream_t);                                                              \
  template cudaError_t LaunchParamsGradApply<T, Tindex>(                                         \
      const BagProblem&, const T*, const int32_t*, const RowUpdate<AccT<T>>&, T*, AccT<T>*,      \
      const WeightsGradFusion<T>*, void*, size_t, cudaStream_t);

TTEMB_INSTANTIATE_BAG_LAUNCHERS(TTEMB_INSTANTIATE_T, TTEMB_INSTANTIATE)

#undef TTEMB_INSTANTIATE_T
#undef TTEMB_INSTANTIATE

}  // namespace gpu
}  // namespace tf_ttemb
