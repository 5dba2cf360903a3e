// CUDA kernels of the gather_reduce_sum forward (LaunchForward). See gather_reduce_sum_kernels.cuh
// for the contract and gather_reduce_sum_common.cuh for the column layout every row kernel shares.

#include "cuda/gather_reduce_sum_common.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// ---------------------------------------------------------------------------
// Forward.

template <typename T, typename Tindex>
struct ForwardArgs {
  const T* params;        // [N, D]
  const Tindex* ids;      // [nnz]
  const int64_t* splits;  // [B + 1]
  const T* weights;       // [nnz] or null
  T* out;                 // [B, D]
  int32_t* argmax;        // [B, D] or null
  AccT<T>* part_acc;      // [B * slices, D] when slices > 1
  int32_t* part_pos;      // [B * slices, D] when slices > 1 and max
  AccT<T>* part_w;        // [B * slices, 2] when slices > 1
  DeviceReport* report;
  BagProblem p;
  int64_t dim_vecs, chunks, slices, num_items;
  int64_t bags_per_item;  // ForwardShortBagsKernel: consecutive bags per work item
  int group;
};

// Entry j of the ids: its row, or -1 for padding and for a bad id (the first bad entry the
// caller sees is kept in *first_bad), and its weight (0 for -1).
template <typename T, typename Tindex>
__device__ __forceinline__ void EntryOf(const ForwardArgs<T, Tindex>& a, int64_t j, int64_t* row,
                                        AccT<T>* w, int64_t* first_bad) {
  *row = -1;
  *w = AccT<T>(0);
  const int64_t id = static_cast<int64_t>(a.ids[j]);
  if (a.p.has_padding_id && id == a.p.padding_id) return;
  if (id >= 0 && id < a.p.num_rows) {
    *row = id;
    *w = a.p.has_weights ? ToAcc(a.weights[j]) : AccT<T>(1);
  } else if (*first_bad < 0) {
    *first_bad = j;
  }
}

// Loads this lane's vectors (base + i * group, i < NV) of the rows row[u], u < U (none where
// row[u] < 0); returns the mask of the entries loaded.
template <typename T, bool kAligned, int NV, int U, typename Tindex>
__device__ __forceinline__ unsigned LoadRows(const ForwardArgs<T, Tindex>& a, int64_t base,
                                             const int64_t (&row)[U], Pack<T> (&x)[U][NV]) {
  constexpr int V = VecOf<T>();
  unsigned loaded = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (row[u] < 0) continue;
    loaded |= 1u << u;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t cv = base + i * a.group;
      if (NV == 1 || cv < a.dim_vecs) {
        x[u][i] = LoadVec<T, kAligned>(a.params + row[u] * a.p.dim + cv * V, cv * V, a.p.dim);
      }
    }
  }
  return loaded;
}

// Work item = (bag, slice, column chunk); a group of G lanes owns it and walks
// the slice's entries in order, kUnroll / NV entries of NV vectors each in
// flight per lane (lane vectors: chunk * G * NV + i * G + lane, i < NV). The
// ids of the next entries are loaded while the current rows are in flight.
// With one slice per bag the group writes the output row; otherwise it writes
// its partial sums (and, for max, partial argmax) for ForwardCombineKernel.
// kWarpIds (aligned rows, group == 32, not max): the warp loads the ids and
// weights of 32 entries at once, one per lane, and hands them out by shuffles
// (the next 32 are loaded while these are used) instead of every lane loading
// every id, and the rows are summed straight from the raw 16-byte words
// (FmaRawOf). Fewer instructions and registers per byte gathered: run 3 took
// the bf16 PKM forward from 1.58 to 0.96 ms with it. Every lane stays in the
// loop (vectors past the row are skipped one by one).
template <typename T, typename Tindex, bool kAligned, bool kMax, int NV, bool kWarpIds>
__global__ void __launch_bounds__(kBlock, 2) ForwardKernel(const ForwardArgs<T, Tindex> a) {
  static_assert(!(kWarpIds && kMax), "the warp-ids path has no max");
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  constexpr int U = kUnroll / NV;
  const GroupWalk walk(a.group);
  for (int64_t item = walk.first; item < a.num_items; item += walk.stride) {
    int64_t rest, chunk, bag, slice;
    DivMod(item, a.chunks, &rest, &chunk);
    DivMod(rest, a.slices, &bag, &slice);
    const int64_t base = chunk * a.group * NV + walk.lane;
    if (!kWarpIds && base >= a.dim_vecs) continue;  // no shuffles on this path
    const bool reporter = base == 0;
    int64_t begin, end;
    BagRange(a.splits, bag, a.p.nnz, &begin, &end);
    const int64_t len = end - begin;
    const int64_t s0 = begin + len * slice / a.slices;
    const int64_t s1 = begin + len * (slice + 1) / a.slices;
    int64_t first_bad = -1;

    A acc[NV][V];
    int32_t pos[NV][V];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        acc[i][e] = A(0);
        pos[i][e] = -1;
      }
    }
    A wsum = A(0), wsq = A(0);
    // row < 0: padding, bad or past s1.
    int64_t row[U];
    A w[U];
    auto load_ids = [&](int64_t j0) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + u;
        row[u] = -1;
        w[u] = A(0);
        if (j < s1) EntryOf(a, j, &row[u], &w[u], &first_bad);
      }
    };
    if constexpr (kWarpIds) {
      static_assert(kAligned, "the warp-ids path loads whole 16-byte vectors");
      // Entry j's row (-1: padding, bad or past s1) and weight.
      auto fetch = [&](int64_t j, int64_t* r, A* wt) {
        *r = -1;
        *wt = A(0);
        if (j < s1) EntryOf(a, j, r, wt, &first_bad);
      };
      int64_t next_row;
      A next_w;
      fetch(s0 + walk.lane, &next_row, &next_w);
#pragma unroll 1
      for (int64_t jb = s0; jb < s1; jb += 32) {
        const int64_t lane_row = next_row;
        const A lane_w = next_w;
        fetch(jb + 32 + walk.lane, &next_row, &next_w);
#pragma unroll 1
        for (int t = 0; t < 32 && jb + t < s1; t += U) {
          uint4 x[U][NV];
          int64_t r[U];
          A wc[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            r[u] = __shfl_sync(0xffffffffu, lane_row, t + u);
            wc[u] = __shfl_sync(0xffffffffu, lane_w, t + u);
            if (r[u] >= 0) {
#pragma unroll
              for (int i = 0; i < NV; ++i) {
                const int64_t cv = base + i * a.group;
                if (cv < a.dim_vecs) {
                  x[u][i] =
                      __ldg(reinterpret_cast<const uint4*>(a.params + r[u] * a.p.dim + cv * V));
                }
              }
            }
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (r[u] < 0) continue;  // uniform across the warp
#pragma unroll
            for (int i = 0; i < NV; ++i) {
              if (base + i * a.group >= a.dim_vecs) continue;
              FmaRawOf<T>(wc[u], x[u][i], acc[i]);
            }
            wsum += wc[u];
            wsq += wc[u] * wc[u];
          }
        }
      }
      // Each lane saw its own entries: the first of them that is bad.
      if (chunk == 0 && first_bad >= 0) ReportMin(&a.report->first_bad_index, first_bad);
    }
    if constexpr (!kWarpIds) load_ids(s0);
    for (int64_t j0 = s0; !kWarpIds && j0 < s1; j0 += U) {
      Pack<T> x[U][NV];
      A wc[U];
#pragma unroll
      for (int u = 0; u < U; ++u) wc[u] = w[u];
      const unsigned loaded = LoadRows<T, kAligned, NV>(a, base, row, x);
      load_ids(j0 + U);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!(loaded & (1u << u))) continue;
        const int32_t p = static_cast<int32_t>(j0 + u - begin);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (NV > 1 && base + i * a.group >= a.dim_vecs) continue;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const A v = ToAcc(x[u][i].v[e]);
            if (kMax) {
              const bool take = pos[i][e] < 0 || TakesMax(v, acc[i][e]);
              acc[i][e] = take ? v : acc[i][e];
              pos[i][e] = take ? p : pos[i][e];
            } else {
              acc[i][e] = fma(wc[u], v, acc[i][e]);
            }
          }
        }
        if (!kMax) {
          wsum += wc[u];
          wsq += wc[u] * wc[u];
        }
      }
    }
    if (!kWarpIds && reporter && first_bad >= 0) {
      ReportMin(&a.report->first_bad_index, first_bad);
    }

    const A scale = BagScale(a.p.combiner, wsum, wsq);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t cv = base + i * a.group;
      if (cv >= a.dim_vecs) continue;
      const int64_t col = cv * V;
      if (a.slices == 1) {
        Pack<T> o;
        if (kMax) {
          Ints<V> pp;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            o.v[e] = FromAcc<T>(pos[i][e] < 0 ? A(0) : acc[i][e]);
            pp.v[e] = pos[i][e];
          }
          StoreInts<V, kAligned>(a.argmax + bag * a.p.dim + col, pp, col, a.p.dim);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            o.v[e] = FromAcc<T>(scale == A(0) ? A(0) : acc[i][e] * scale);
          }
        }
        StoreVec<T, kAligned>(a.out + bag * a.p.dim + col, o, col, a.p.dim);
      } else {
        const int64_t part = bag * a.slices + slice;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          if (col + e >= a.p.dim) break;
          a.part_acc[part * a.p.dim + col + e] = acc[i][e];
          if (kMax) a.part_pos[part * a.p.dim + col + e] = pos[i][e];
        }
      }
    }
    if (a.slices > 1 && reporter && !kMax) {
      const int64_t part = bag * a.slices + slice;
      a.part_w[2 * part] = wsum;
      a.part_w[2 * part + 1] = wsq;
    }
  }
}

// Short bags (sum, mean, sqrtn; one slice per bag; aligned rows). ForwardKernel keeps one bag's
// entries in flight per group, so with bags of 1 to a few entries a group has one row
// in flight and waits for it. Here a work item is (`bags_per_item` consecutive bags,
// column chunk): the group walks their entries as one stream, kUnroll / NV entries
// in flight whatever the bags' lengths (the next entries' ids are loaded while the
// current rows are in flight, as there), and writes a bag's output row when the stream
// leaves it. Each bag's sums are ForwardKernel's, in the same order, so the output has
// the same bits; empty bags and bags of padding get ForwardKernel's zeros.
template <typename T, typename Tindex, int NV>
__global__ void __launch_bounds__(kBlock, 2)
    ForwardShortBagsKernel(const ForwardArgs<T, Tindex> a) {
  using A = AccT<T>;
  constexpr int V = VecOf<T>();
  constexpr int U = kUnroll / NV;
  const GroupWalk walk(a.group);
  for (int64_t item = walk.first; item < a.num_items; item += walk.stride) {
    int64_t bags, chunk;
    DivMod(item, a.chunks, &bags, &chunk);
    const int64_t base = chunk * a.group * NV + walk.lane;
    if (base >= a.dim_vecs) continue;
    const int64_t first_bag = bags * a.bags_per_item;
    const int64_t last_bag = min(first_bag + a.bags_per_item, a.p.num_bags) - 1;
    int64_t first_bad = -1;

    // The stream's cursor: entry j of bag `bag`, whose entries end at `end`.
    int64_t bag = first_bag, j, end;
    BagRange(a.splits, bag, a.p.nnz, &j, &end);
    // The next U entries of the stream: their bag, counted from first_bag (-1 past the
    // item's last bag), row (-1: padding, bad or none) and weight.
    int bag_of[U];
    int64_t row[U];
    A w[U];
    auto next_entries = [&]() {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        while (j >= end && bag < last_bag) {
          ++bag;
          BagRange(a.splits, bag, a.p.nnz, &j, &end);
        }
        bag_of[u] = row[u] = -1;
        w[u] = A(0);
        if (j < end) {
          bag_of[u] = static_cast<int>(bag - first_bag);
          EntryOf(a, j, &row[u], &w[u], &first_bad);
          ++j;
        }
      }
    };

    A acc[NV][V];
    A wsum, wsq;
    auto reset = [&]() {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
#pragma unroll
        for (int e = 0; e < V; ++e) acc[i][e] = A(0);
      }
      wsum = wsq = A(0);
    };
    // Writes the rows of bags [out_bag, upto): out_bag's sums, then zeros.
    int64_t out_bag = first_bag;
    auto write_until = [&](int64_t upto) {
      for (; out_bag < upto; ++out_bag) {
        const A scale = BagScale(a.p.combiner, wsum, wsq);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int64_t cv = base + i * a.group;
          if (NV > 1 && cv >= a.dim_vecs) continue;
          const int64_t col = cv * V;
          Pack<T> o;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            o.v[e] = FromAcc<T>(scale == A(0) ? A(0) : acc[i][e] * scale);
          }
          StoreVec<T, true>(a.out + out_bag * a.p.dim + col, o, col, a.p.dim);
        }
        reset();
      }
    };

    reset();
    next_entries();
    while (bag_of[0] >= 0) {
      Pack<T> x[U][NV];
      int cur_bag[U];
      A wc[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        cur_bag[u] = bag_of[u];
        wc[u] = w[u];
      }
      const unsigned loaded = LoadRows<T, true, NV>(a, base, row, x);
      next_entries();
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (cur_bag[u] < 0) break;  // the stream ended (uniform across the group)
        write_until(first_bag + cur_bag[u]);
        if (!(loaded & (1u << u))) continue;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (NV > 1 && base + i * a.group >= a.dim_vecs) continue;
#pragma unroll
          for (int e = 0; e < V; ++e) acc[i][e] = fma(wc[u], ToAcc(x[u][i].v[e]), acc[i][e]);
        }
        wsum += wc[u];
        wsq += wc[u] * wc[u];
      }
    }
    write_until(last_bag + 1);
    if (base == 0 && first_bad >= 0) ReportMin(&a.report->first_bad_index, first_bad);
  }
}

// One thread per output element (bag, d): combines the bag's slices in slice
// order, so ties in max (and NaN) still go to the first entry of the bag.
template <typename T>
__global__ void ForwardCombineKernel(const AccT<T>* __restrict__ part_acc,  // [B * S, D]
                                     const int32_t* __restrict__ part_pos,  // [B * S, D] or null
                                     const AccT<T>* __restrict__ part_w,    // [B * S, 2]
                                     int64_t num_bags, int64_t dim, int64_t slices,
                                     Combiner combiner,
                                     T* __restrict__ out,             // [B, D]
                                     int32_t* __restrict__ argmax) {  // [B, D] or null
  using A = AccT<T>;
  const int64_t total = num_bags * dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t bag = i / dim, d = i - bag * dim;
    const int64_t base = bag * slices;
    if (combiner == Combiner::kMax) {
      A best = A(0);
      int32_t pos = -1;
      for (int64_t s = 0; s < slices; ++s) {
        const int32_t p = part_pos[(base + s) * dim + d];
        const A v = part_acc[(base + s) * dim + d];
        if (p >= 0 && (pos < 0 || TakesMax(v, best))) {
          best = v;
          pos = p;
        }
      }
      out[i] = FromAcc<T>(pos < 0 ? A(0) : best);
      argmax[i] = pos;
    } else {
      A acc = A(0), wsum = A(0), wsq = A(0);
      for (int64_t s = 0; s < slices; ++s) {
        acc += part_acc[(base + s) * dim + d];
        wsum += part_w[2 * (base + s)];
        wsq += part_w[2 * (base + s) + 1];
      }
      const A scale = BagScale(combiner, wsum, wsq);
      out[i] = FromAcc<T>(scale == A(0) ? A(0) : acc * scale);
    }
  }
}

// Short bags (ForwardShortBagsKernel, for batches with at least twice kTargetGroups
// groups): about this many entries and at most this many bags to a work item. Picked, not
// swept: with them the grouped forward of bench_grouped_kernels.py went from 0.31 to
// 0.14 ms on an H100 (BENCHMARKS.md, session of 2026-12-06, third).
constexpr int64_t kShortBagsEntries = 32;
constexpr int64_t kMaxBagsPerItem = 32;

// Forward plan: columns, and how many slices each bag is split into.
struct ForwardPlan {
  Columns cols;
  int64_t slices = 1;
  int64_t bags_per_item = 1;  // > 1: ForwardShortBagsKernel where rows are aligned
  int64_t num_items = 0;      // ForwardKernel's
};

template <typename T>
ForwardPlan PlanForward(const BagProblem& p) {
  ForwardPlan plan;
  // Two vectors per lane per entry (run 3 measured one for 2-byte types:
  // slower, 1.17 against 0.96 ms for the bf16 PKM forward).
  plan.cols = ColumnsFor<T>(p.dim, 2);
  if (plan.cols.chunks == 0 || p.num_bags == 0) return plan;
  const int64_t groups = p.num_bags * plan.cols.chunks;
  if (groups < kTargetGroups) {
    const int64_t by_length = p.nnz / p.num_bags / kMinSliceEntries;
    const int64_t wanted = CeilDiv(kTargetGroups, groups);
    plan.slices = std::max<int64_t>(1, std::min({by_length, wanted, kMaxSlices}));
  }
  plan.num_items = groups * plan.slices;
  // Short bags (not max): kShortBagsEntries entries per work item, while the items
  // still number kTargetGroups.
  const int64_t mean_length = std::max<int64_t>(1, p.nnz / p.num_bags);
  if (p.combiner != Combiner::kMax && plan.slices == 1 && 2 * mean_length <= kShortBagsEntries) {
    const int64_t by_length = kShortBagsEntries / mean_length;
    const int64_t by_groups = std::max<int64_t>(1, groups / kTargetGroups);
    plan.bags_per_item = std::min({by_length, by_groups, kMaxBagsPerItem});
  }
  return plan;
}

template <typename T>
struct ForwardScratch {
  AccT<T>* part_acc = nullptr;
  int32_t* part_pos = nullptr;
  AccT<T>* part_w = nullptr;
};

template <typename T>
size_t CarveForward(const BagProblem& p, const ForwardPlan& plan, void* base,
                    ForwardScratch<T>* s) {
  Carver carver(base);
  if (plan.slices > 1) {
    const int64_t parts = p.num_bags * plan.slices;
    s->part_acc = carver.Take<AccT<T>>(parts * p.dim);
    if (p.combiner == Combiner::kMax) s->part_pos = carver.Take<int32_t>(parts * p.dim);
    s->part_w = carver.Take<AccT<T>>(parts * 2);
  }
  return carver.bytes();
}

}  // namespace

// ---------------------------------------------------------------------------
// Public launchers.

template <typename T>
size_t ForwardScratchBytes(const BagProblem& p) {
  ForwardScratch<T> s;
  return CarveForward<T>(p, PlanForward<T>(p), nullptr, &s);
}

template <typename T, typename Tindex>
cudaError_t LaunchForward(const BagProblem& p, const T* params, const Tindex* ids,
                          const int64_t* splits, const T* weights, T* out, int32_t* argmax,
                          DeviceReport* report, void* scratch, size_t scratch_bytes,
                          cudaStream_t stream) {
  if (!ValidProblem(p) ||
      (p.combiner == Combiner::kMax && p.num_bags * p.dim > 0 && argmax == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const ForwardPlan plan = PlanForward<T>(p);
  ForwardScratch<T> s;
  if (CarveForward<T>(p, plan, nullptr, &s) > scratch_bytes) return cudaErrorInvalidValue;
  CarveForward<T>(p, plan, scratch, &s);
  TTEMB_RETURN_IF_CUDA_ERROR(InitReport(p, report, stream));
  TTEMB_RETURN_IF_CUDA_ERROR(CheckSplits(splits, p.num_bags, report, stream));
  if (plan.num_items == 0) {
    // No output elements: the ids are still checked.
    if (p.nnz > 0) {
      CheckIdsKernel<Tindex><<<GridFor(p.nnz), kBlock, 0, stream>>>(
          ids, p.nnz, p.num_rows, p.has_padding_id, p.padding_id, report);
      TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    }
  } else {
    ForwardArgs<T, Tindex> a;
    a.params = params;
    a.ids = ids;
    a.splits = splits;
    a.weights = p.has_weights ? weights : nullptr;
    a.out = out;
    a.argmax = argmax;
    a.part_acc = s.part_acc;
    a.part_pos = s.part_pos;
    a.part_w = s.part_w;
    a.report = report;
    a.p = p;
    a.dim_vecs = plan.cols.dim_vecs;
    a.chunks = plan.cols.chunks;
    a.slices = plan.slices;
    a.group = plan.cols.group;
    const bool aligned = p.dim % VecOf<T>() == 0 && Aligned16(params) && Aligned16(out) &&
                         (argmax == nullptr || Aligned16(argmax));
    const bool short_bags = aligned && plan.bags_per_item > 1;
    a.bags_per_item = short_bags ? plan.bags_per_item : 1;
    a.num_items =
        short_bags ? CeilDiv(p.num_bags, plan.bags_per_item) * plan.cols.chunks : plan.num_items;
    const int grid = GridFor(a.num_items * plan.cols.group);
    const bool is_max = p.combiner == Combiner::kMax;
    const bool wide = plan.cols.nv == 2;
    const bool warp_ids = plan.cols.group == 32;
    if (short_bags) {
      if (wide) {
        ForwardShortBagsKernel<T, Tindex, 2><<<grid, kBlock, 0, stream>>>(a);
      } else {
        ForwardShortBagsKernel<T, Tindex, 1><<<grid, kBlock, 0, stream>>>(a);
      }
    } else if (aligned && !is_max && warp_ids) {
      if (wide) {
        ForwardKernel<T, Tindex, true, false, 2, true><<<grid, kBlock, 0, stream>>>(a);
      } else {
        ForwardKernel<T, Tindex, true, false, 1, true><<<grid, kBlock, 0, stream>>>(a);
      }
    } else if (aligned && is_max) {
      if (wide) {
        ForwardKernel<T, Tindex, true, true, 2, false><<<grid, kBlock, 0, stream>>>(a);
      } else {
        ForwardKernel<T, Tindex, true, true, 1, false><<<grid, kBlock, 0, stream>>>(a);
      }
    } else if (aligned) {
      if (wide) {
        ForwardKernel<T, Tindex, true, false, 2, false><<<grid, kBlock, 0, stream>>>(a);
      } else {
        ForwardKernel<T, Tindex, true, false, 1, false><<<grid, kBlock, 0, stream>>>(a);
      }
    } else if (is_max) {
      if (wide) {
        ForwardKernel<T, Tindex, false, true, 2, false><<<grid, kBlock, 0, stream>>>(a);
      } else {
        ForwardKernel<T, Tindex, false, true, 1, false><<<grid, kBlock, 0, stream>>>(a);
      }
    } else if (wide) {
      ForwardKernel<T, Tindex, false, false, 2, false><<<grid, kBlock, 0, stream>>>(a);
    } else {
      ForwardKernel<T, Tindex, false, false, 1, false><<<grid, kBlock, 0, stream>>>(a);
    }
    TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    if (plan.slices > 1) {
      ForwardCombineKernel<T><<<GridFor(p.num_bags * p.dim), kBlock, 0, stream>>>(
          s.part_acc, s.part_pos, s.part_w, p.num_bags, p.dim, plan.slices, p.combiner, out,
          argmax);
      TTEMB_RETURN_IF_CUDA_ERROR(LastLaunchError());
    }
  }
  return FinishReport<Tindex>(ids, p.nnz, splits, p.num_bags, report, stream);
}

// ---------------------------------------------------------------------------
// Instantiations.

#define TTEMB_INSTANTIATE_T(T) template size_t ForwardScratchBytes<T>(const BagProblem&);
#define TTEMB_INSTANTIATE(T, Tindex)                                                        \
  template cudaError_t LaunchForward<T, Tindex>(const BagProblem&, const T*, const Tindex*, \
                                                const int64_t*, const T*, T*, int32_t*,     \
                                                DeviceReport*, void*, size_t, cudaStream_t);

TTEMB_INSTANTIATE_BAG_LAUNCHERS(TTEMB_INSTANTIATE_T, TTEMB_INSTANTIATE)

#undef TTEMB_INSTANTIATE_T
#undef TTEMB_INSTANTIATE

}  // namespace gpu
}  // namespace tf_ttemb
