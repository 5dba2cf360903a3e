// Internal to the TT embedding CUDA kernels (tt_embedding_forward.cu and
// tt_embedding_backward.cu): the constants, the factorisation's geometry, the report and
// level-building kernels, the forward product of a level (TTRows computes the rows with it
// and TTRowsGrad recomputes its partial products with it) and their launch helpers. All in
// an anonymous namespace: each .cu file has its own copy. The launchers' contract is
// tt_embedding_kernels.cuh.
//
// Levels. For a run of ids j = 0 .. n-1 (a chunk), the key of id g at level t
// is g / L_t (the table and the leading digits i_0..i_t). An *item* of level t
// is a maximal run of consecutive ids with equal keys: with sorted ids every
// distinct prefix is one item. flags -> inclusive scan gives each id's item
// (incl_t[j] - 1) and each item's first id (heads_t). The items of level t
// nest in those of level t-1 (equal keys at t imply equal keys at t-1), so
// the children of an item are a contiguous run of items of the next level.
// Level 0's partial product is core 0's row itself (no buffer); levels
// 1 .. T-2 keep one partial product P_t [prod q_0..q_t, r_{t+1}] per item;
// level T-1 is one item per id (its row).
//
// Per-item metadata (LevelMetaKernel, once per chunk): the core row each item
// multiplies and its parent item, so the math kernels divide nothing.
//
// Forward of level t: P_t[i] = A @ B with A = P_{t-1}[parent] [M, K] and
// B = G_t[row] [K, Nc] (M = q_0..q_{t-1}, K = r_t, Nc = q_t r_{t+1}). Narrow B
// (Nc <= 8, the last level) with A fitting in shared memory: one block per
// parent, A staged once in shared memory for all the parent's children
// (contiguous), thread = (child, row of A) computing the row's Nc outputs.
// Otherwise: one thread per (item, MM consecutive rows of A, column c), B[k, c]
// loaded once per k (coalesced across the warp's columns) and used for MM rows.
//
// Backward of level t (dC = dL/dP_t, or the rows' gradient at the last level):
//   * parent gradient dP_{t-1}[m] = sum over m's children n (in item order) of
//     dC_n @ B_n^T: the children (contiguous) are cut into pieces of at most
//     kChildPieceItems that never cross a parent, one block per piece, then a
//     combine kernel adds each parent's pieces in order (a parent with
//     hundreds of children, e.g. a level-0 digit at a large batch, is spread
//     over many blocks). Wide B (Nc >= 32): a warp per output group, lanes
//     across c (coalesced), a fixed shuffle tree at the end;
//   * core gradient of core row c = sum over the items n using c (in item
//     order) of A_n^T @ dC_n. The items are sorted by core row (stable radix
//     sort), the sorted list is cut into pieces of at most CorePieceItems items
//     that never cross a row, one block per piece sums its items into a piece
//     buffer, and a combine kernel adds each row's pieces in piece order.
// The piece lists depend only on the ids: LaunchRowsGradPrepare builds them.
// Everything runs in a fixed order: bitwise deterministic, no float atomics.

#ifndef TF_TTEMB_CUDA_TT_EMBEDDING_COMMON_CUH_
#define TF_TTEMB_CUDA_TT_EMBEDDING_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <limits>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/tt_embedding_kernels.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// TTRows processes the ids in chunks whose scratch fits this budget.
constexpr size_t kRowsScratchBudget = size_t{512} << 20;
constexpr int64_t kMinRowsChunk = 4096;
constexpr int64_t kNoBad = std::numeric_limits<int64_t>::max();

template <typename U>
struct TypeTag {
  using type = U;
};

int GridFor(int64_t work, int threads = kBlock) {
  return GridBlocks(work, threads, kMaxGridBlocks);
}

// ---------------------------------------------------------------------------
// Geometry of the factorisation, passed to kernels by value.
struct Geo {
  int T = 0;
  int64_t tables = 1;
  int64_t P = 1;      // rows per table
  int64_t total = 1;  // tables * P: global ids are [0, total)
  int64_t D = 1;
  int64_t p[kMaxTTCores] = {};
  int64_t L[kMaxTTCores] = {};      // prod_{j > k} p_j
  int64_t width[kMaxTTCores] = {};  // r_k q_k r_{k+1}
  int64_t M[kMaxTTCores] = {};      // q_0 ... q_{t-1}
  int64_t K[kMaxTTCores] = {};      // r_t
  int64_t Nc[kMaxTTCores] = {};     // q_t r_{t+1}
  int64_t S[kMaxTTCores] = {};      // M[t] * Nc[t]: size of P_t
};

bool MakeGeo(const TTProblem& pr, Geo* g) {
  if (pr.num_cores < 2 || pr.num_cores > kMaxTTCores || pr.num_tables < 1) return false;
  const int T = pr.num_cores;
  if (pr.r[0] != 1 || pr.r[T] != 1) return false;
  const int64_t kLimit = int64_t{1} << 62;
  g->T = T;
  g->tables = pr.num_tables;
  int64_t P = 1, D = 1;
  for (int k = 0; k < T; ++k) {
    if (pr.p[k] < 1 || pr.q[k] < 1 || pr.r[k] < 1 || pr.r[k + 1] < 1) return false;
    if (P > kLimit / pr.p[k] || D > kLimit / pr.q[k]) return false;
    P *= pr.p[k];
    D *= pr.q[k];
  }
  if (P > kLimit / pr.num_tables || D > (int64_t{1} << 31)) return false;
  g->P = P;
  g->total = P * pr.num_tables;
  g->D = D;
  int64_t L = 1;
  for (int k = T - 1; k >= 0; --k) {
    g->L[k] = L;
    L *= pr.p[k];
  }
  int64_t M = 1;
  for (int k = 0; k < T; ++k) {
    g->p[k] = pr.p[k];
    g->width[k] = pr.r[k] * pr.q[k] * pr.r[k + 1];
    if (g->width[k] > (int64_t{1} << 31)) return false;
    if (pr.p[k] > ((int64_t{1} << 31) - 1) / pr.num_tables) return false;  // int32 core rows
    g->M[k] = M;
    g->K[k] = pr.r[k];
    g->Nc[k] = pr.q[k] * pr.r[k + 1];
    g->S[k] = M * g->Nc[k];
    if (g->S[k] > (int64_t{1} << 31)) return false;
    M *= pr.q[k];
  }
  return true;
}

__host__ __device__ __forceinline__ int64_t CoreRow(const Geo& g, int64_t id, int k) {
  return (id / g.P) * g.p[k] + (id / g.L[k]) % g.p[k];
}

// ids[j], or 0 (a harmless row) for an id outside [0, total).
__device__ __forceinline__ int64_t SafeId(const Geo& g, const int64_t* ids, int64_t j,
                                          bool* valid) {
  const int64_t v = ids[j];
  const bool ok = v >= 0 && v < g.total;
  *valid = ok;
  return ok ? v : 0;
}

// ---------------------------------------------------------------------------
// Small kernels: counts and the report.

__global__ void InitReportKernel(TTReport* report) {
  report->first_bad_index = kNoBad;
  report->bad_index_value = -1;
  report->work_items = 0;
  report->work_values = 0;
}

// counts[0] = number of ids of the chunk starting at `begin`.
__global__ void ChunkCountKernel(const int64_t* num_ids, int64_t max_ids, int64_t begin,
                                 int64_t chunk, int64_t* counts) {
  int64_t n = num_ids == nullptr ? max_ids : min(*num_ids, max_ids);
  n = max(int64_t{0}, min(n - begin, chunk));
  counts[0] = n;
}

// Smallest j < counts[0] (offset by `begin`) with a bad id.
__global__ void CheckIdsKernel(Geo g, const int64_t* ids, const int64_t* counts, int64_t begin,
                               TTReport* report) {
  const int64_t n = counts[0];
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < n;
       j += int64_t{gridDim.x} * blockDim.x) {
    const int64_t v = ids[j];
    if (v < 0 || v >= g.total) {
      atomicMin(reinterpret_cast<unsigned long long*>(&report->first_bad_index),
                static_cast<unsigned long long>(begin + j));
    }
  }
}

// The report's bad id once the checks have run: its value, or -1 and -1 for none
// (one thread; `ids` the full, not offset, array).
template <typename Tindex>
__device__ void FinishBadIndex(const Tindex* ids, TTReport* report) {
  const int64_t first = report->first_bad_index;
  if (first == kNoBad) {
    report->first_bad_index = -1;
    report->bad_index_value = -1;
  } else {
    report->bad_index_value = static_cast<int64_t>(ids[first]);
  }
}

__global__ void FinishReportKernel(const int64_t* ids, const int64_t* num_ids, int64_t max_ids,
                                   TTReport* report) {
  FinishBadIndex(ids, report);
  report->num_ids = num_ids == nullptr ? max_ids : min(*num_ids, max_ids);
}

// ---------------------------------------------------------------------------
// Levels.

// flags[j] = 1 where item of level t starts (j < n), else 0.
__global__ void LevelFlagsKernel(Geo g, int t, const int64_t* ids, const int64_t* counts,
                                 int64_t nmax, int32_t* flags) {
  const int64_t n = counts[0];
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < nmax;
       j += int64_t{gridDim.x} * blockDim.x) {
    int32_t f = 0;
    if (j < n) {
      bool v;
      const int64_t key = SafeId(g, ids, j, &v) / g.L[t];
      if (j == 0) {
        f = 1;
      } else {
        const int64_t prev = SafeId(g, ids, j - 1, &v) / g.L[t];
        f = key != prev;
      }
    }
    flags[j] = f;
  }
}

// heads[item] = first id of the item; counts[1 + t] = number of items.
__global__ void LevelHeadsKernel(int t, const int64_t* counts, int64_t nmax, const int32_t* flags,
                                 const int32_t* incl, int32_t* heads, int64_t* counts_out) {
  const int64_t n = counts[0];
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < n;
       j += int64_t{gridDim.x} * blockDim.x) {
    if (flags[j]) heads[incl[j] - 1] = static_cast<int32_t>(j);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) counts_out[1 + t] = n > 0 ? incl[n - 1] : 0;
}

// Per-item metadata of level t, so that kernels divide nothing: row[i] = the
// core-t row of item i (ids at the last level), par[i] = its parent's item
// index at level t-1 (t >= 1).
__global__ void LevelMetaKernel(Geo g, int t, const int64_t* ids, const int64_t* counts,
                                const int32_t* heads_t,    // level t, null at the last
                                const int32_t* incl_prev,  // level t-1, null for t == 0
                                int32_t* row, int32_t* par) {
  const bool last = t == g.T - 1;
  const int64_t n_items = last ? counts[0] : counts[1 + t];
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n_items;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t j = last ? i : heads_t[i];
    bool valid;
    const int64_t id = SafeId(g, ids, j, &valid);
    row[i] = static_cast<int32_t>(CoreRow(g, id, t));
    if (t > 0) par[i] = incl_prev[j] - 1;
  }
}

__device__ __forceinline__ bool ValidAt(const Geo& g, const int64_t* ids, int64_t j) {
  const int64_t v = ids[j];
  return v >= 0 && v < g.total;
}

// A of item i at level t >= 1: core 0's row (t == 1) or the parent's partial.
template <typename TA>
__device__ __forceinline__ const TA* AOf(const Geo& g, int t, const TA* prev, const int32_t* par,
                                         const int32_t* row0, int64_t i) {
  return t == 1 ? prev + int64_t{row0[par[i]]} * g.width[0] : prev + int64_t{par[i]} * g.S[t - 1];
}

// Forward of level t >= 1. Thread = (item i, rows m0 .. m0+MM-1 of A, column c).
template <int MM, typename TA, typename T, typename TO>
__global__ void __launch_bounds__(kBlock)
    LevelForwardKernel(Geo g, int t, const int64_t* __restrict__ ids,
                       const int64_t* __restrict__ counts,
                       const int32_t* __restrict__ row_t,  // level t
                       const int32_t* __restrict__ par_t,  // level t
                       const int32_t* __restrict__ row0,   // level 0
                       const TA* __restrict__ prev,        // t == 1: core 0; else P_{t-1}
                       const T* __restrict__ core,         // core t
                       TO* __restrict__ out) {             // P_t [n_t, S_t] or rows [n, D]
  using C = AccT<T>;
  const bool last = t == g.T - 1;
  const int64_t M = g.M[t], K = g.K[t], Nc = g.Nc[t], S = g.S[t];
  const int64_t mchunks = (M + MM - 1) / MM;
  const int64_t per_item = mchunks * Nc;
  const int64_t n_items = last ? counts[0] : counts[1 + t];
  const int64_t total = n_items * per_item;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / per_item;
    const int64_t rem = e - i * per_item;
    const int64_t m0 = (rem / Nc) * MM;
    const int64_t c = rem % Nc;
    const TA* a = AOf(g, t, prev, par_t, row0, i);
    const T* b = core + int64_t{row_t[i]} * g.width[t];
    C acc[MM];
#pragma unroll
    for (int mm = 0; mm < MM; ++mm) acc[mm] = C(0);
    for (int64_t k = 0; k < K; ++k) {
      const C bv = ToAcc(b[k * Nc + c]);
#pragma unroll
      for (int mm = 0; mm < MM; ++mm) {
        if (m0 + mm < M) acc[mm] = fma(ToAcc(a[(m0 + mm) * K + k]), bv, acc[mm]);
      }
    }
    const bool zero = last && !ValidAt(g, ids, i);
    TO* o = out + i * S;
#pragma unroll
    for (int mm = 0; mm < MM; ++mm) {
      if (m0 + mm < M) {
        if constexpr (std::is_same<TO, T>::value) {
          o[(m0 + mm) * Nc + c] = FromAcc<T>(zero ? C(0) : acc[mm]);
        } else {
          o[(m0 + mm) * Nc + c] = acc[mm];
        }
      }
    }
  }
}

// Forward of level t >= 1 by parents: one block per parent item m (level
// t-1), whose children (items of level t) are contiguous. A = the parent's
// partial (or core 0's row) is staged once in shared memory (rows padded to
// K + 1: conflict-free), then thread = (child, row m of A) computes the NC
// outputs of that row, B's row k shared by the child's threads. Used when A
// fits in shared memory and Nc <= 8 (the last level). f32 with Nc == 4 and
// 16-byte aligned rows (vec4): B's row k and the output row are one 16-byte
// load and store (H200, FBTT's shape, 1.24M ids: 117 -> 80 us per chunk of
// ~155K ids; the same fmas, the same bits).
template <int NC, typename TA, typename T, typename TO>
__global__ void __launch_bounds__(kBlock)
    LevelForwardByParentKernel(Geo g, int t, const int64_t* __restrict__ ids,
                               const int64_t* __restrict__ counts,
                               const int32_t* __restrict__ row_t,
                               const int32_t* __restrict__ first_child,  // level t-1: [n_{t-1}]
                               const int32_t* __restrict__ row0, const TA* __restrict__ prev,
                               const T* __restrict__ core, TO* __restrict__ out, bool vec4) {
  using C = AccT<T>;
  extern __shared__ unsigned char smem_raw[];
  C* a_s = reinterpret_cast<C*>(smem_raw);
  const bool last = t == g.T - 1;
  const int64_t M = g.M[t], K = g.K[t], Nc = g.Nc[t], S = g.S[t];
  const int64_t n_parents = counts[t];
  const int64_t n_items = last ? counts[0] : counts[1 + t];
  const int64_t per_pass = blockDim.x / M;  // children per pass
  for (int64_t m = blockIdx.x; m < n_parents; m += gridDim.x) {
    const TA* a = t == 1 ? prev + int64_t{row0[m]} * g.width[0] : prev + m * g.S[t - 1];
    __syncthreads();
    for (int64_t e = threadIdx.x; e < M * K; e += blockDim.x) {
      a_s[(e / K) * (K + 1) + e % K] = ToAcc(a[e]);
    }
    __syncthreads();
    const int64_t begin = first_child[m];
    const int64_t end = m + 1 < n_parents ? first_child[m + 1] : n_items;
    const int64_t local = threadIdx.x / M, r = threadIdx.x % M;
    if (local >= per_pass) continue;
    for (int64_t i = begin + local; i < end; i += per_pass) {
      const T* b = core + int64_t{row_t[i]} * g.width[t];
      const C* ar = a_s + r * (K + 1);
      C acc[NC];
#pragma unroll
      for (int cc = 0; cc < NC; ++cc) acc[cc] = C(0);
      bool done = false;
      if constexpr (NC == 4 && std::is_same<T, float>::value) {
        // Nc == 4 with 16-byte aligned core rows: B's row k is one float4 load instead of
        // four (the same fmas in the same order).
        if (vec4) {
          const float4* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll 8
          for (int64_t k = 0; k < K; ++k) {
            const C av = ar[k];
            const float4 bv = __ldg(b4 + k);
            acc[0] = fma(av, bv.x, acc[0]);
            acc[1] = fma(av, bv.y, acc[1]);
            acc[2] = fma(av, bv.z, acc[2]);
            acc[3] = fma(av, bv.w, acc[3]);
          }
          done = true;
        }
      }
      if (!done) {
        for (int64_t k = 0; k < K; ++k) {
          const C av = ar[k];
#pragma unroll
          for (int cc = 0; cc < NC; ++cc) {
            if (cc < Nc) acc[cc] = fma(av, ToAcc(b[k * Nc + cc]), acc[cc]);
          }
        }
      }
      const bool zero = last && !ValidAt(g, ids, i);
      TO* o = out + i * S + r * Nc;
      if constexpr (NC == 4 && std::is_same<T, float>::value && std::is_same<TO, float>::value) {
        if (vec4) {
          const float4 v =
              zero ? make_float4(0.f, 0.f, 0.f, 0.f) : make_float4(acc[0], acc[1], acc[2], acc[3]);
          *reinterpret_cast<float4*>(o) = v;
          continue;
        }
      }
#pragma unroll
      for (int cc = 0; cc < NC; ++cc) {
        if (cc < Nc) {
          if constexpr (std::is_same<TO, T>::value) {
            o[cc] = FromAcc<T>(zero ? C(0) : acc[cc]);
          } else {
            o[cc] = acc[cc];
          }
        }
      }
    }
  }
}

// first_child[m] = first item of level t whose parent is m (items are grouped by
// parent, in order).
__global__ void FirstChildKernel(Geo g, int t, const int64_t* counts, const int32_t* par_t,
                                 int32_t* first_child) {
  const bool last = t == g.T - 1;
  const int64_t n_items = last ? counts[0] : counts[1 + t];
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n_items;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (i == 0 || par_t[i] != par_t[i - 1]) first_child[par_t[i]] = static_cast<int32_t>(i);
  }
}

// ---------------------------------------------------------------------------
// Launch helpers.

// Buffers of the levels of one chunk of at most nmax ids.
struct LevelBuffers {
  int64_t* counts = nullptr;         // [kMaxTTCores + 1]
  int32_t* flags = nullptr;          // [nmax]
  int32_t* incl[kMaxTTCores] = {};   // levels 0 .. T-2, [nmax]
  int32_t* heads[kMaxTTCores] = {};  // levels 0 .. T-2, [nmax]
  int32_t* row[kMaxTTCores] = {};    // levels 0 .. T-1, [nmax]
  int32_t* par[kMaxTTCores] = {};    // levels 1 .. T-1, [nmax]
  int32_t* first_child = nullptr;    // [nmax], scratch of the by-parent forward
  void* cub_temp = nullptr;
  size_t cub_bytes = 0;
};

template <typename C>
int64_t ByParentSmemBytes(const Geo& g, int t) {
  return g.M[t] * (g.K[t] + 1) * static_cast<int64_t>(sizeof(C));
}

template <typename TA, typename T, typename TO>
cudaError_t LaunchLevelForward(const Geo& g, int t, const int64_t* ids, int64_t nmax,
                               const LevelBuffers& b, const TA* prev, const T* core, TO* out,
                               cudaStream_t stream) {
  using C = AccT<T>;
  const int64_t M = g.M[t];
  const int64_t work_items = nmax;  // upper bound of the items
  if (g.Nc[t] <= 8 && M <= kBlock && ByParentSmemBytes<C>(g, t) <= 32 * 1024) {
    FirstChildKernel<<<GridFor(nmax), kBlock, 0, stream>>>(g, t, b.counts, b.par[t], b.first_child);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    // Blocks of a multiple of M threads, at least 64 and at most kBlock.
    const int threads = static_cast<int>(
        std::max<int64_t>(M, (std::min<int64_t>(kBlock, std::max<int64_t>(64, M * 4)) / M) * M));
    const int smem = static_cast<int>(ByParentSmemBytes<C>(g, t));
    const bool vec4 =
        g.Nc[t] == 4 && g.width[t] % 4 == 0 && (reinterpret_cast<uintptr_t>(core) & 15) == 0;
    auto go_rows = [&](auto nc_tag) {
      constexpr int NC = decltype(nc_tag)::value;
      LevelForwardByParentKernel<NC, TA, T, TO>
          <<<static_cast<int>(std::max<int64_t>(1, std::min(nmax, 8 * kMaxGridBlocks))), threads,
             smem, stream>>>(g, t, ids, b.counts, b.row[t], b.first_child, b.row[0], prev, core,
                             out, vec4);
    };
    if (g.Nc[t] <= 1) {
      go_rows(std::integral_constant<int, 1>{});
    } else if (g.Nc[t] <= 2) {
      go_rows(std::integral_constant<int, 2>{});
    } else if (g.Nc[t] <= 4) {
      go_rows(std::integral_constant<int, 4>{});
    } else {
      go_rows(std::integral_constant<int, 8>{});
    }
    return cudaGetLastError();
  }
  auto go = [&](auto mm_tag) {
    constexpr int MM = decltype(mm_tag)::value;
    const int64_t work = work_items * CeilDiv(M, MM) * g.Nc[t];
    LevelForwardKernel<MM, TA, T, TO><<<GridFor(work), kBlock, 0, stream>>>(
        g, t, ids, b.counts, b.row[t], b.par[t], b.row[0], prev, core, out);
  };
  if (M >= 8) {
    go(std::integral_constant<int, 8>{});
  } else if (M >= 4) {
    go(std::integral_constant<int, 4>{});
  } else if (M >= 2) {
    go(std::integral_constant<int, 2>{});
  } else {
    go(std::integral_constant<int, 1>{});
  }
  return cudaGetLastError();
}

size_t ScanTempBytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceScan::InclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                static_cast<int32_t*>(nullptr),
                                static_cast<int>(std::max<int64_t>(n, 1)));
  return bytes;
}

size_t SortTempBytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int>(std::max<int64_t>(n, 1)));
  return bytes;
}

void CarveLevels(const Geo& g, int64_t nmax, size_t cub_bytes, Carver* c, LevelBuffers* b) {
  b->counts = c->Take<int64_t>(kMaxTTCores + 1);
  b->flags = c->Take<int32_t>(nmax);
  for (int t = 0; t + 1 < g.T; ++t) {
    b->incl[t] = c->Take<int32_t>(nmax);
    b->heads[t] = c->Take<int32_t>(nmax);
  }
  for (int t = 0; t < g.T; ++t) {
    b->row[t] = c->Take<int32_t>(nmax);
    if (t > 0) b->par[t] = c->Take<int32_t>(nmax);
  }
  b->first_child = c->Take<int32_t>(nmax);
  b->cub_bytes = cub_bytes;
  b->cub_temp = c->TakeBytes(cub_bytes);
}

// Builds levels 0 .. T-2 of the chunk ids[0 .. counts[0]) and the metadata of
// levels 0 .. T-1.
cudaError_t BuildLevels(const Geo& g, const int64_t* ids, int64_t nmax, LevelBuffers* b,
                        cudaStream_t stream) {
  for (int t = 0; t + 1 < g.T; ++t) {
    LevelFlagsKernel<<<GridFor(nmax), kBlock, 0, stream>>>(g, t, ids, b->counts, nmax, b->flags);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    size_t bytes = b->cub_bytes;
    TTEMB_RETURN_IF_CUDA_ERROR(cub::DeviceScan::InclusiveSum(
        b->cub_temp, bytes, b->flags, b->incl[t], static_cast<int>(nmax), stream));
    LevelHeadsKernel<<<GridFor(nmax), kBlock, 0, stream>>>(t, b->counts, nmax, b->flags, b->incl[t],
                                                           b->heads[t], b->counts);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  }
  for (int t = 0; t < g.T; ++t) {
    LevelMetaKernel<<<GridFor(nmax), kBlock, 0, stream>>>(
        g, t, ids, b->counts, t + 1 < g.T ? b->heads[t] : nullptr, t > 0 ? b->incl[t - 1] : nullptr,
        b->row[t], b->par[t]);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  }
  return cudaSuccess;
}

// ---------------------------------------------------------------------------
// TTRows.

template <typename T>
size_t CarveRows(const Geo& g, int64_t chunk, void* base, LevelBuffers* b,
                 AccT<T>* partial[kMaxTTCores]) {
  Carver c(base);
  CarveLevels(g, chunk, ScanTempBytes(chunk), &c, b);
  for (int t = 1; t + 1 < g.T; ++t) partial[t] = c.Take<AccT<T>>(chunk * g.S[t]);
  return c.bytes();
}

template <typename T>
int64_t RowsChunk(const Geo& g, int64_t max_ids) {
  LevelBuffers b;
  AccT<T>* partial[kMaxTTCores] = {};
  int64_t chunk = std::max<int64_t>(max_ids, 1);
  while (chunk > kMinRowsChunk &&
         CarveRows<T>(g, chunk, nullptr, &b, partial) > kRowsScratchBudget) {
    chunk = CeilDiv(chunk, 2);
  }
  return chunk;
}

bool ValidIdsCount(int64_t max_ids) { return max_ids >= 0 && max_ids < (int64_t{1} << 31) - 2; }

}  // namespace
}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_TT_EMBEDDING_COMMON_CUH_
