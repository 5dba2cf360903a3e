// The second half of the TT embedding backward (TTRowsGrad): LaunchRowsGradCompute
// recomputes the partial products and sums the core and parent gradients piece by
// piece, in a fixed order, over the piece lists LaunchRowsGradPrepare
// (tt_embedding_backward_prepare.cu) built. See tt_embedding_kernels.cuh for the
// contract and tt_embedding_common.cuh for the levels.

#include "cuda/tt_embedding_grad_plan.cuh"

namespace tf_ttemb {
namespace gpu {
namespace {

// Core-gradient pieces of core t >= 1: one block per piece, threads over the
// width (k, c); piece_out[p] = sum over the piece's items of A_n^T @ dC_n.
template <typename TA, typename TG, typename T>
__global__ void __launch_bounds__(kBlock)
    CorePieceKernel(Geo g, int t, const int64_t* __restrict__ ids,
                    const int64_t* __restrict__ piece_count,  // [1]
                    const int32_t* __restrict__ piece_pos,    // [pieces + 1]
                    const int32_t* __restrict__ sorted_items,
                    const int32_t* __restrict__ par_t,          // level t
                    const int32_t* __restrict__ row0,           // level 0
                    const TA* __restrict__ prev,                // t == 1: core 0; else P_{t-1}
                    const TG* __restrict__ dC,                  // [n_t, S_t]
                    AccT<T>* __restrict__ piece_out,            // [pieces, width_t]
                    const int32_t* __restrict__ piece_order) {  // or null (PieceOrderKeys)
  using C = AccT<T>;
  const bool last = t == g.T - 1;
  const int64_t M = g.M[t], K = g.K[t], Nc = g.Nc[t], S = g.S[t], W = g.width[t];
  const int64_t pieces = *piece_count;
  for (int64_t q = blockIdx.x; q < pieces; q += gridDim.x) {
    const int64_t pc = piece_order != nullptr ? piece_order[q] : q;
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    for (int64_t e = threadIdx.x; e < W; e += blockDim.x) {
      const int64_t k = e / Nc, c = e % Nc;
      C acc = C(0);
      for (int64_t s = begin; s < end; ++s) {
        const int64_t n = sorted_items[s];
        if (last && !ValidAt(g, ids, n)) continue;
        const TA* a = AOf(g, t, prev, par_t, row0, n);
        const TG* d = dC + n * S;
        for (int64_t m = 0; m < M; ++m) acc = fma(ToAcc(a[m * K + k]), ToAcc(d[m * Nc + c]), acc);
      }
      piece_out[pc * W + e] = acc;
    }
  }
}

// 4 consecutive values from shared memory (16-byte aligned for float, double).
template <typename C>
__device__ __forceinline__ void Load4(const C* p, C v[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = p[i];
}
template <>
__device__ __forceinline__ void Load4<float>(const float* p, float v[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  v[0] = x.x;
  v[1] = x.y;
  v[2] = x.z;
  v[3] = x.w;
}
template <>
__device__ __forceinline__ void Load4<double>(const double* p, double v[4]) {
  const double2 x = reinterpret_cast<const double2*>(p)[0];
  const double2 y = reinterpret_cast<const double2*>(p)[1];
  v[0] = x.x;
  v[1] = x.y;
  v[2] = y.x;
  v[3] = y.y;
}

// Warp 0 of a block: of the `count` (<= 32) candidate items `first + lane` (or
// sorted_items[first + lane] when sorted_items is not null), writes the valid ones (all,
// except bad ids at the last level) to item_s in order and their number to *n_valid_s.
// The caller brackets it with __syncthreads().
__device__ __forceinline__ void CompactBatch(const Geo& g, bool last, const int64_t* ids,
                                             const int32_t* sorted_items, int64_t first, int count,
                                             int32_t* item_s, int* n_valid_s) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int32_t n = 0;
  bool ok = false;
  if (lane < count) {
    n = sorted_items != nullptr ? sorted_items[first + lane] : static_cast<int32_t>(first + lane);
    ok = !last || ValidAt(g, ids, n);
  }
  const unsigned mask = __ballot_sync(0xffffffffu, ok);
  if (ok) item_s[__popc(mask & ((1u << lane) - 1u))] = n;
  if (lane == 0) *n_valid_s = __popc(mask);
}

// dst[e] = load(e) for e < n, over the block's threads: R loads in flight per thread
// before their shared-memory stores (staging from L2 is latency-bound otherwise: each
// iteration would wait for its own load).
template <int R, typename C, typename F>
__device__ __forceinline__ void StageUnrolled(C* dst, int n, F load) {
  for (int e0 = threadIdx.x; e0 < n; e0 += R * blockDim.x) {
    C v[R];
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int e = e0 + u * static_cast<int>(blockDim.x);
      v[u] = e < n ? load(e) : C(0);
    }
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int e = e0 + u * static_cast<int>(blockDim.x);
      if (e < n) dst[e] = v[u];
    }
  }
}

// A 4 x 4 output tile in registers: acc[i][j] += a[i] * b[j], one fma each, in call
// order (so a kernel's summation order is its loop order), stored with a row stride.
template <typename C>
struct Tile4 {
  C acc[4][4];
  __device__ __forceinline__ Tile4() {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = C(0);
    }
  }
  __device__ __forceinline__ void Fma(const C a[4], const C b[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
  }
  __device__ __forceinline__ void Store(C* o, int64_t row_stride) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) o[i * row_stride + j] = acc[i][j];
    }
  }
};

// The same sums, tiled: the piece's items are staged kCoreTileItems at a time
// in shared memory (A_n [M, K] and dC_n [M, Nc], in the compute type), and
// each thread owns a 4 x 4 tile of the output (rows k0..k0+3, columns
// c0..c0+3), reading 4 values of A and 4 of dC per m for 16 FMAs. Every
// output is still one fma chain over the items in piece order, then m in
// order: the same arithmetic, in the same order, as CorePieceKernel (bitwise
// equal), with operands from shared memory instead of one global load each.
// Needs K % 4 == 0 and Nc % 4 == 0 (see LaunchCorePieces).
constexpr int kCoreTileItems = 8;
// Below this many tiles a block would idle: the register-direct kernel takes over (or the
// plain one for the half types).
constexpr int64_t kCoreTiledMinTiles = 64;
constexpr int64_t kRegMinLanes = int64_t{1} << 18;

template <typename TA, typename TG, typename T>
__global__ void __launch_bounds__(kBlock)
    CorePieceTiledKernel(Geo g, int t, const int64_t* __restrict__ ids,
                         const int64_t* __restrict__ piece_count,
                         const int32_t* __restrict__ piece_pos,
                         const int32_t* __restrict__ sorted_items,
                         const int32_t* __restrict__ par_t, const int32_t* __restrict__ row0,
                         const TA* __restrict__ prev, const TG* __restrict__ dC,
                         AccT<T>* __restrict__ piece_out) {
  using C = AccT<T>;
  extern __shared__ __align__(16) unsigned char core_tile_smem[];
  const bool last = t == g.T - 1;
  const int M = static_cast<int>(g.M[t]), K = static_cast<int>(g.K[t]);
  const int Nc = static_cast<int>(g.Nc[t]);
  const int64_t S = g.S[t], W = g.width[t];
  const int MK = M * K, MN = M * Nc;
  C* a_s = reinterpret_cast<C*>(core_tile_smem);  // [kCoreTileItems, M, K]
  C* d_s = a_s + kCoreTileItems * MK;             // [kCoreTileItems, M, Nc]
  __shared__ int32_t item_s[kCoreTileItems];
  __shared__ int n_valid_s;
  const int ct_count = Nc / 4;
  const int tiles = (K / 4) * ct_count;
  const int64_t pieces = *piece_count;
  for (int64_t pc = blockIdx.x; pc < pieces; pc += gridDim.x) {
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    for (int tile0 = 0; tile0 < tiles; tile0 += blockDim.x) {
      const int tile = tile0 + static_cast<int>(threadIdx.x);
      const bool active = tile < tiles;
      const int k0 = active ? (tile / ct_count) * 4 : 0;
      const int c0 = active ? (tile % ct_count) * 4 : 0;
      Tile4<C> tile4;
      for (int64_t s0 = begin; s0 < end; s0 += kCoreTileItems) {
        const int batch = static_cast<int>(end - s0 < kCoreTileItems ? end - s0 : kCoreTileItems);
        __syncthreads();  // the previous batch's readers are done
        CompactBatch(g, last, ids, sorted_items, s0, batch, item_s, &n_valid_s);
        __syncthreads();
        const int nv = n_valid_s;
        StageUnrolled<4>(a_s, nv * MK, [&](int e) {
          const int b = e / MK, w = e - b * MK;
          return ToAcc(AOf(g, t, prev, par_t, row0, item_s[b])[w]);
        });
        StageUnrolled<8>(d_s, nv * MN, [&](int e) {
          const int b = e / MN, w = e - b * MN;
          return ToAcc(dC[int64_t{item_s[b]} * S + w]);
        });
        __syncthreads();
        if (active) {
          for (int b = 0; b < nv; ++b) {
            const C* ab = a_s + b * MK + k0;
            const C* db = d_s + b * MN + c0;
            for (int m = 0; m < M; ++m) {
              C av[4], dv[4];
              Load4(ab + m * K, av);
              Load4(db + m * Nc, dv);
              tile4.Fma(av, dv);
            }
          }
        }
      }
      if (active) {
        tile4.Store(piece_out + pc * W + int64_t{k0} * Nc + c0, Nc);
      }
    }
  }
}

// Core-0 gradient pieces: piece_out[p] = sum over the piece's level-0 items of dP_0.
template <typename C>
__global__ void __launch_bounds__(kBlock)
    Core0PieceKernel(int64_t W, const int64_t* __restrict__ piece_count,
                     const int32_t* __restrict__ piece_pos,
                     const int32_t* __restrict__ sorted_items,
                     const C* __restrict__ dP0,    // [n_0, W]
                     C* __restrict__ piece_out) {  // [pieces, W]
  const int64_t pieces = *piece_count;
  for (int64_t pc = blockIdx.x; pc < pieces; pc += gridDim.x) {
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    for (int64_t e = threadIdx.x; e < W; e += blockDim.x) {
      C acc = C(0);
      for (int64_t s = begin; s < end; ++s) acc += dP0[int64_t{sorted_items[s]} * W + e];
      piece_out[pc * W + e] = acc;
    }
  }
}

// Adds each row's pieces in order; writes (indices, values) or the dense row.
template <typename T>
__global__ void CombinePiecesKernel(int64_t W, const int64_t* __restrict__ row_count,
                                    const int32_t* __restrict__ seg_first_piece,  // [rows + 1]
                                    const int64_t* __restrict__ seg_row,          // [rows]
                                    const AccT<T>* __restrict__ piece_out,
                                    int64_t* __restrict__ indices, T* __restrict__ values,
                                    T* __restrict__ dense) {
  using C = AccT<T>;
  const int64_t rows = *row_count;
  const int64_t total = rows * W;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t s = e / W, w = e % W;
    C acc = C(0);
    for (int64_t pc = seg_first_piece[s]; pc < seg_first_piece[s + 1]; ++pc) {
      acc += piece_out[pc * W + w];
    }
    const int64_t row = seg_row[s];
    if (dense != nullptr) {
      dense[row * W + w] = FromAcc<T>(acc);
    } else {
      values[e] = FromAcc<T>(acc);
      if (w == 0) indices[s] = row;
    }
  }
}

// One block per piece of children: piece_out[pc] = sum over the piece's children n
// of dC_n @ B_n^T [M, K]; threads over (row m, k). For narrow B (Nc < 32).
template <typename TG, typename T>
__global__ void __launch_bounds__(kBlock)
    ParentPieceKernel(Geo g, int t, const int64_t* __restrict__ ids,
                      const int64_t* __restrict__ piece_count,
                      const int32_t* __restrict__ piece_pos,
                      const int32_t* __restrict__ row_t,  // level t
                      const TG* __restrict__ dC,          // [n_t, S_t]
                      const T* __restrict__ core,         // core t
                      AccT<T>* __restrict__ piece_out) {  // [pieces, S_{t-1}]
  using C = AccT<T>;
  const bool last = t == g.T - 1;
  const int64_t K = g.K[t], Nc = g.Nc[t], S = g.S[t], Sp = g.S[t - 1];
  const int64_t pieces = *piece_count;
  for (int64_t pc = blockIdx.x; pc < pieces; pc += gridDim.x) {
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    for (int64_t e = threadIdx.x; e < Sp; e += blockDim.x) {
      const int64_t m = e / K, k = e % K;
      C acc = C(0);
      for (int64_t n = begin; n < end; ++n) {
        if (last && !ValidAt(g, ids, n)) continue;
        const T* b = core + int64_t{row_t[n]} * g.width[t] + k * Nc;
        const TG* d = dC + n * S + m * Nc;
        for (int64_t c = 0; c < Nc; ++c) acc = fma(ToAcc(d[c]), ToAcc(b[c]), acc);
      }
      piece_out[pc * Sp + e] = acc;
    }
  }
}

// ParentPieceKernel's sums, tiled: the piece's children (at most
// kChildPieceItems) are staged in shared memory transposed, dC_n^T [Nc, M] and
// B_n^T [Nc, K], and each thread owns a 4 x 4 tile of the output (rows
// m0..m0+3, columns k0..k0+3), reading 4 + 4 values per c for 16 FMAs. Every
// output is still one fma chain over the children in order, then c in order:
// bitwise equal to ParentPieceKernel. Needs M % 4 == 0 and K % 4 == 0.
template <typename TG, typename T>
__global__ void __launch_bounds__(kBlock)
    ParentPieceTiledKernel(Geo g, int t, const int64_t* __restrict__ ids,
                           const int64_t* __restrict__ piece_count,
                           const int32_t* __restrict__ piece_pos, const int32_t* __restrict__ row_t,
                           const TG* __restrict__ dC, const T* __restrict__ core,
                           AccT<T>* __restrict__ piece_out) {
  using C = AccT<T>;
  extern __shared__ __align__(16) unsigned char parent_tile_smem[];
  const bool last = t == g.T - 1;
  const int M = static_cast<int>(g.M[t]), K = static_cast<int>(g.K[t]);
  const int Nc = static_cast<int>(g.Nc[t]);
  const int64_t S = g.S[t], Sp = g.S[t - 1];
  const int NM = Nc * M, NK = Nc * K;
  C* d_s = reinterpret_cast<C*>(parent_tile_smem);  // [kChildPieceItems, Nc, M]
  C* b_s = d_s + kChildPieceItems * NM;             // [kChildPieceItems, Nc, K]
  __shared__ int32_t item_s[kChildPieceItems];
  __shared__ int n_valid_s;
  const int kt_count = K / 4;
  const int tiles = (M / 4) * kt_count;
  const int64_t pieces = *piece_count;
  for (int64_t pc = blockIdx.x; pc < pieces; pc += gridDim.x) {
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    const int batch = static_cast<int>(end - begin);  // <= kChildPieceItems
    __syncthreads();                                  // the previous piece's readers are done
    CompactBatch(g, last, ids, nullptr, begin, batch, item_s, &n_valid_s);
    __syncthreads();
    const int nv = n_valid_s;
    for (int e = threadIdx.x; e < nv * NM; e += blockDim.x) {
      const int b = e / NM, w = e - b * NM;  // w = m * Nc + c (coalesced reads)
      const int m = w / Nc, c = w - m * Nc;
      d_s[b * NM + c * M + m] = ToAcc(dC[int64_t{item_s[b]} * S + w]);
    }
    for (int e = threadIdx.x; e < nv * NK; e += blockDim.x) {
      const int b = e / NK, w = e - b * NK;  // w = k * Nc + c
      const int k = w / Nc, c = w - k * Nc;
      b_s[b * NK + c * K + k] = ToAcc(core[int64_t{row_t[item_s[b]]} * g.width[t] + w]);
    }
    __syncthreads();
    for (int tile = threadIdx.x; tile < tiles; tile += blockDim.x) {
      const int m0 = (tile / kt_count) * 4, k0 = (tile % kt_count) * 4;
      Tile4<C> tile4;
      for (int b = 0; b < nv; ++b) {
        const C* db = d_s + b * NM + m0;
        const C* bb = b_s + b * NK + k0;
        for (int c = 0; c < Nc; ++c) {
          C dv[4], bv[4];
          Load4(db + c * M, dv);
          Load4(bb + c * K, bv);
          tile4.Fma(dv, bv);
        }
      }
      tile4.Store(piece_out + pc * Sp + int64_t{m0} * K + k0, K);
    }
  }
}

// Register-direct versions of the two piece kernels, for float and double with
// 16-byte-aligned operands and M, K, Nc multiples of 4. A group of `group`
// lanes (a power of two <= 32; several groups per warp) owns a piece, each lane
// a 4 x 4 output tile, and reads its operands straight from global memory as
// 4-vectors: no shared memory and no barriers, so every group runs
// independently and many loads are in flight (the tiled kernels above stall on
// staging when a tile row is narrow). Each output is the same fma chain, in
// the same order, as in CorePieceKernel / ParentPieceKernel: bitwise equal.
__device__ __forceinline__ int64_t GroupIndex(int group) {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
}

template <typename C>
__global__ void __launch_bounds__(kBlock)
    CorePieceRegKernel(Geo g, int t, int group, const int64_t* __restrict__ ids,
                       const int64_t* __restrict__ piece_count,
                       const int32_t* __restrict__ piece_pos,
                       const int32_t* __restrict__ sorted_items, const int32_t* __restrict__ par_t,
                       const int32_t* __restrict__ row0, const C* __restrict__ prev,
                       const C* __restrict__ dC, C* __restrict__ piece_out,
                       const int32_t* __restrict__ piece_order) {
  const bool last = t == g.T - 1;
  const int M = static_cast<int>(g.M[t]), K = static_cast<int>(g.K[t]);
  const int Nc = static_cast<int>(g.Nc[t]);
  const int64_t S = g.S[t], W = g.width[t];
  const int ct_count = Nc / 4, tiles = (K / 4) * ct_count;
  const int lane = static_cast<int>(threadIdx.x) % group;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (blockDim.x / group);
  const int64_t pieces = *piece_count;
  for (int64_t q = GroupIndex(group); q < pieces; q += stride) {
    const int64_t pc = piece_order != nullptr ? piece_order[q] : q;
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    for (int tile = lane; tile < tiles; tile += group) {
      const int k0 = (tile / ct_count) * 4, c0 = (tile % ct_count) * 4;
      Tile4<C> tile4;
      for (int64_t s = begin; s < end; ++s) {
        const int64_t n = sorted_items[s];
        if (last && !ValidAt(g, ids, n)) continue;
        const C* a = AOf(g, t, prev, par_t, row0, n) + k0;
        const C* d = dC + n * S + c0;
#pragma unroll 4
        for (int m = 0; m < M; ++m) {
          C av[4], dv[4];
          Load4(a + m * K, av);
          Load4(d + m * Nc, dv);
          tile4.Fma(av, dv);
        }
      }
      tile4.Store(piece_out + pc * W + int64_t{k0} * Nc + c0, Nc);
    }
  }
}

template <typename C>
__global__ void __launch_bounds__(kBlock)
    ParentPieceRegKernel(Geo g, int t, int group, const int64_t* __restrict__ ids,
                         const int64_t* __restrict__ piece_count,
                         const int32_t* __restrict__ piece_pos, const int32_t* __restrict__ row_t,
                         const C* __restrict__ dC, const C* __restrict__ core,
                         C* __restrict__ piece_out) {
  const bool last = t == g.T - 1;
  const int K = static_cast<int>(g.K[t]), Nc = static_cast<int>(g.Nc[t]);
  const int M = static_cast<int>(g.M[t]);
  const int64_t S = g.S[t], Sp = g.S[t - 1];
  const int kt_count = K / 4, tiles = (M / 4) * kt_count;
  const int lane = static_cast<int>(threadIdx.x) % group;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (blockDim.x / group);
  const int64_t pieces = *piece_count;
  for (int64_t pc = GroupIndex(group); pc < pieces; pc += stride) {
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    for (int tile = lane; tile < tiles; tile += group) {
      const int m0 = (tile / kt_count) * 4, k0 = (tile % kt_count) * 4;
      Tile4<C> tile4;
      for (int64_t n = begin; n < end; ++n) {
        if (last && !ValidAt(g, ids, n)) continue;
        const C* b = core + int64_t{row_t[n]} * g.width[t] + k0 * Nc;  // B rows k0..k0+3
        const C* d = dC + n * S + m0 * Nc;                             // dC rows m0..m0+3
        for (int c0 = 0; c0 < Nc; c0 += 4) {
          C dv[4][4], bv[4][4];
#pragma unroll
          for (int i = 0; i < 4; ++i) Load4(d + i * Nc + c0, dv[i]);
#pragma unroll
          for (int j = 0; j < 4; ++j) Load4(b + j * Nc + c0, bv[j]);
#pragma unroll
          for (int cc = 0; cc < 4; ++cc) {
            const C dc[4] = {dv[0][cc], dv[1][cc], dv[2][cc], dv[3][cc]};
            const C bc[4] = {bv[0][cc], bv[1][cc], bv[2][cc], bv[3][cc]};
            tile4.Fma(dc, bc);
          }
        }
      }
      tile4.Store(piece_out + pc * Sp + int64_t{m0} * K + k0, K);
    }
  }
}

// Lanes per piece of the register-direct kernels: the tiles rounded up to a power of two, at
// most a warp.
int RegGroup(int64_t tiles) { return Pow2AtLeast(tiles, 32); }

// The same for wide B (Nc >= 32): warp w of the block owns the outputs (rows
// m0 .. m0+MM-1, k) in turn; its lanes split the columns c (coalesced loads of
// dC and B), accumulate over the piece's children, and reduce across lanes by
// a fixed shuffle tree at the end (deterministic).
template <int MM, typename TG, typename T>
__global__ void __launch_bounds__(kBlock)
    ParentPieceWideKernel(Geo g, int t, const int64_t* __restrict__ ids,
                          const int64_t* __restrict__ piece_count,
                          const int32_t* __restrict__ piece_pos, const int32_t* __restrict__ row_t,
                          const TG* __restrict__ dC, const T* __restrict__ core,
                          AccT<T>* __restrict__ piece_out) {
  using C = AccT<T>;
  const bool last = t == g.T - 1;
  const int64_t M = g.M[t], K = g.K[t], Nc = g.Nc[t], S = g.S[t], Sp = g.S[t - 1];
  const int64_t mchunks = (M + MM - 1) / MM;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t pieces = *piece_count;
  for (int64_t pc = blockIdx.x; pc < pieces; pc += gridDim.x) {
    const int64_t begin = piece_pos[pc], end = piece_pos[pc + 1];
    for (int64_t o = warp; o < mchunks * K; o += warps) {
      const int64_t m0 = (o / K) * MM, k = o % K;
      C acc[MM];
#pragma unroll
      for (int mm = 0; mm < MM; ++mm) acc[mm] = C(0);
      for (int64_t n = begin; n < end; ++n) {
        if (last && !ValidAt(g, ids, n)) continue;
        const T* b = core + int64_t{row_t[n]} * g.width[t] + k * Nc;
        const TG* d = dC + n * S;
        for (int64_t c = lane; c < Nc; c += 32) {
          const C bv = ToAcc(b[c]);
#pragma unroll
          for (int mm = 0; mm < MM; ++mm) {
            if (m0 + mm < M) acc[mm] = fma(ToAcc(d[(m0 + mm) * Nc + c]), bv, acc[mm]);
          }
        }
      }
#pragma unroll
      for (int mm = 0; mm < MM; ++mm) {
        C v = acc[mm];
#pragma unroll
        for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0 && m0 + mm < M) piece_out[pc * Sp + (m0 + mm) * K + k] = v;
      }
    }
  }
}

// Parent gradient of a wide level (Nc >= 32), by core row. The children (items of
// level t) are taken in the core-row order of the core-gradient pieces (s.core[t]:
// sorted by row, pieces never cross a row). A work item is one batch of at most
// `ib` consecutive children of a piece (batch `sub` of piece pc), so a piece's
// batches run in parallel blocks: the block stages its row B = G_t[row] [K, Nc]
// transposed to [Nc, KP] and the batch's dC_n transposed to [Nc, RP]
// (RP >= ib * M), then computes dA_n = dC_n @ B^T [M, K]. Each thread owns a 4 x 4
// tile (rows m0 .. m0+3 of one child, columns k0 .. k0+3) and reads two 16-byte
// values of shared memory per 16 FMAs; all threads walk c together, so the reads
// are contiguous across a warp. The paddings (KP = K + 4, RP = ib * M + 4) keep
// the staging stores free of bank conflicts. One fma chain per output, over c in
// order, into child_out[n] (n = the child's item index); ChildCombineKernel then
// adds each parent's children in item order. A bad id's child (last level) is left
// out of the batch and skipped by the combine. Needs M, K, Nc % 4 == 0.
template <typename C>
__device__ __forceinline__ void Store4(C* p, const C v[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = v[i];
}
template <>
__device__ __forceinline__ void Store4<float>(float* p, const float v[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

// Staging rounds of the by-row kernels whose global loads are issued before any of their
// shared-memory stores (the loads come from L2: latency, not bandwidth, bounds a block).
constexpr int kStage = 4;

// The by-row kernels' products: out[rows r0..r0+3 of an item, cols j0..j0+3] = sum over i
// (in order) of x[i, r] y[i, j], with x = x_s[i * xs + r] (r = b * M + m) and y = y_s[i * ys + j]
// in shared memory; thread = one 4 x 4 tile of the batch's nv items, written to
// out + item_s[b] * item_stride + m0 * cols + j0.
template <typename C>
__device__ __forceinline__ void ByRowTiles(const C* x_s, int xs, const C* y_s, int ys, int inner,
                                           int nv, int M, int cols, const int32_t* item_s,
                                           int64_t item_stride, C* out) {
  const int jt_count = cols / 4;
  const int tiles = nv * (M / 4) * jt_count;
  for (int tile = threadIdx.x; tile < tiles; tile += blockDim.x) {
    const int r0 = (tile / jt_count) * 4, j0 = (tile % jt_count) * 4;
    Tile4<C> tile4;
    const C* xp = x_s + r0;
    const C* yp = y_s + j0;
#pragma unroll 4
    for (int i = 0; i < inner; ++i) {
      C xv[4], yv[4];
      Load4(xp + i * xs, xv);
      Load4(yp + i * ys, yv);
      tile4.Fma(xv, yv);
    }
    const int b = r0 / M, m0 = r0 - b * M;
    tile4.Store(out + int64_t{item_s[b]} * item_stride + m0 * cols + j0, cols);
  }
}

template <typename TG, typename T>
__global__ void __launch_bounds__(kBlock)
    ParentByRowKernel(Geo g, int t, int ib, int nsub, const int64_t* __restrict__ ids,
                      const int64_t* __restrict__ piece_count,
                      const int32_t* __restrict__ piece_pos,
                      const int32_t* __restrict__ sorted_items,
                      const int32_t* __restrict__ row_t,  // level t
                      const TG* __restrict__ dC,          // [n_t, S_t]
                      const T* __restrict__ core,         // core t
                      AccT<T>* __restrict__ child_out) {  // [n_t, M * K]
  using C = AccT<T>;
  extern __shared__ __align__(16) unsigned char by_row_smem[];
  const bool last = t == g.T - 1;
  const int M = static_cast<int>(g.M[t]), K = static_cast<int>(g.K[t]);
  const int Nc = static_cast<int>(g.Nc[t]);
  const int64_t S = g.S[t], W = g.width[t];
  const int KP = K + 4, RP = ib * M + 4, MK = M * K;
  C* b_s = reinterpret_cast<C*>(by_row_smem);  // [Nc, KP]: b_s[c * KP + k] = B[k, c]
  C* d_s = b_s + Nc * KP;                      // [Nc, RP]: d_s[c * RP + b * M + m] = dC_b[m, c]
  __shared__ int32_t item_s[kByRowMaxItems];
  __shared__ int n_valid_s;
  const int kt_count = K / 4, m4 = M / 4;
  const int64_t work = *piece_count * nsub;
  for (int64_t wi = blockIdx.x; wi < work; wi += gridDim.x) {
    const int64_t pc = wi / nsub;
    const int64_t s0 = piece_pos[pc] + (wi - pc * nsub) * ib, end = piece_pos[pc + 1];
    if (s0 >= end) continue;  // uniform across the block
    const int batch = static_cast<int>(end - s0 < ib ? end - s0 : ib);
    const T* brow = core + int64_t{row_t[sorted_items[s0]]} * W;
    __syncthreads();  // the previous item's readers are done
    CompactBatch(g, last, ids, sorted_items, s0, batch, item_s, &n_valid_s);
    // Staging: kStage rounds of loads in flight per thread before their stores.
    const int nb = kt_count * Nc;
    for (int e0 = threadIdx.x; e0 < nb; e0 += kStage * blockDim.x) {
      C v[kStage][4];
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        const int e = e0 + u * blockDim.x;
        const int c = e % Nc, k0 = (e / Nc) * 4;  // coalesced over c
#pragma unroll
        for (int i = 0; i < 4; ++i) v[u][i] = e < nb ? ToAcc(brow[(k0 + i) * Nc + c]) : C(0);
      }
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        const int e = e0 + u * blockDim.x;
        if (e < nb) Store4(b_s + (e % Nc) * KP + (e / Nc) * 4, v[u]);
      }
    }
    __syncthreads();
    const int nv = n_valid_s;
    const int nd = nv * m4 * Nc;
    for (int e0 = threadIdx.x; e0 < nd; e0 += kStage * blockDim.x) {
      C v[kStage][4];
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        const int e = e0 + u * blockDim.x;
        const int c = e % Nc, r = e / Nc;  // r = b * (M / 4) + m0 / 4
        const int b = r / m4, m0 = (r - b * m4) * 4;
        const TG* d = dC + int64_t{item_s[e < nd ? b : 0]} * S + c;
#pragma unroll
        for (int i = 0; i < 4; ++i) v[u][i] = e < nd ? ToAcc(d[(m0 + i) * Nc]) : C(0);
      }
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        const int e = e0 + u * blockDim.x;
        if (e >= nd) continue;
        const int c = e % Nc, r = e / Nc;
        const int b = r / m4, m0 = (r - b * m4) * 4;
        Store4(d_s + c * RP + b * M + m0, v[u]);
      }
    }
    __syncthreads();
    ByRowTiles(d_s, RP, b_s, KP, Nc, nv, M, K, item_s, MK, child_out);
  }
}

// Forward partial products of a wide level t (1 <= t <= T-2) in the backward, by core
// row: the same (piece, batch) work items over s.core[t] as ParentByRowKernel. The
// block stages its row B = G_t[row] [K, Nc] as it is and the batch's A_n (core 0's
// row or the parent's partial, [M, K]) transposed to [K, RP]; thread = 4 x 4 tile
// (rows m0 .. m0+3 of one item, columns c0 .. c0+3), 16 FMAs per two 16-byte shared
// loads. Each output is one fma chain over k in order, as in LevelForwardKernel: the
// same bits. Needs M, Nc % 4 == 0.
template <typename TA, typename T>
__global__ void __launch_bounds__(kBlock)
    LevelForwardByRowKernel(Geo g, int t, int ib, int nsub, const int64_t* __restrict__ piece_count,
                            const int32_t* __restrict__ piece_pos,
                            const int32_t* __restrict__ sorted_items,
                            const int32_t* __restrict__ row_t, const int32_t* __restrict__ par_t,
                            const int32_t* __restrict__ row0, const TA* __restrict__ prev,
                            const T* __restrict__ core, AccT<T>* __restrict__ out) {  // P_t
  using C = AccT<T>;
  extern __shared__ __align__(16) unsigned char fwd_row_smem[];
  const int M = static_cast<int>(g.M[t]), K = static_cast<int>(g.K[t]);
  const int Nc = static_cast<int>(g.Nc[t]);
  const int64_t S = g.S[t], W = g.width[t];
  const int RP = ib * M + 4, MK = M * K;
  C* b_s = reinterpret_cast<C*>(fwd_row_smem);  // [K, Nc] = B
  C* a_s = b_s + K * Nc;                        // [K, RP]: a_s[k * RP + b * M + m] = A_b[m, k]
  __shared__ int32_t item_s[kByRowMaxItems];
  const int64_t work = *piece_count * nsub;
  for (int64_t wi = blockIdx.x; wi < work; wi += gridDim.x) {
    const int64_t pc = wi / nsub;
    const int64_t s0 = piece_pos[pc] + (wi - pc * nsub) * ib, end = piece_pos[pc + 1];
    if (s0 >= end) continue;  // uniform across the block
    const int nv = static_cast<int>(end - s0 < ib ? end - s0 : ib);
    const T* brow = core + int64_t{row_t[sorted_items[s0]]} * W;
    __syncthreads();  // the previous item's readers are done
    if (threadIdx.x < nv) item_s[threadIdx.x] = sorted_items[s0 + threadIdx.x];
    StageUnrolled<4 * kStage>(b_s, K * Nc, [&](int e) { return ToAcc(brow[e]); });
    __syncthreads();
    for (int e = threadIdx.x; e < nv * MK; e += blockDim.x) {
      const int b = e / MK, w = e - b * MK;  // w = m * K + k
      const int m = w / K, k = w - m * K;
      a_s[k * RP + b * M + m] = ToAcc(AOf(g, t, prev, par_t, row0, item_s[b])[w]);
    }
    __syncthreads();
    ByRowTiles(a_s, RP, b_s, Nc, K, nv, M, Nc, item_s, S, out);
  }
}

// dprev[m] = sum of parent m's children's child_out rows, in item order (the children
// of a parent are consecutive items: the child pieces' first and end positions).
template <typename C>
__global__ void ChildCombineKernel(Geo g, int t, const int64_t* __restrict__ ids, int64_t Sp,
                                   const int64_t* __restrict__ parent_count,
                                   const int32_t* __restrict__ seg_first_piece,  // [parents + 1]
                                   const int32_t* __restrict__ piece_pos,
                                   const C* __restrict__ child_out, C* __restrict__ dprev) {
  const bool last = t == g.T - 1;
  const int64_t total = *parent_count * Sp;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t m = e / Sp, w = e % Sp;
    const int64_t begin = piece_pos[seg_first_piece[m]], end = piece_pos[seg_first_piece[m + 1]];
    C acc = C(0);
    for (int64_t n = begin; n < end; ++n) {
      if (last && !ValidAt(g, ids, n)) continue;
      acc += child_out[n * Sp + w];
    }
    dprev[e] = acc;
  }
}

// Work items of the by-row kernels: (piece, batch) pairs, grid-strided.
int ByRowGrid(int64_t max_pieces, int nsub) {
  return static_cast<int>(std::max<int64_t>(1, std::min(max_pieces * nsub, 4 * kMaxGridBlocks)));
}

// dprev[m] = sum of parent m's pieces, in order.
template <typename C>
__global__ void ParentCombineKernel(int64_t Sp, const int64_t* __restrict__ parent_count,
                                    const int32_t* __restrict__ first_piece,  // [parents + 1]
                                    const C* __restrict__ piece_out, C* __restrict__ dprev) {
  const int64_t total = *parent_count * Sp;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t m = e / Sp, w = e % Sp;
    C acc = C(0);
    for (int64_t pc = first_piece[m]; pc < first_piece[m + 1]; ++pc) acc += piece_out[pc * Sp + w];
    dprev[e] = acc;
  }
}

}  // namespace

// Core-gradient pieces of core t >= 1: the tiled kernel where the shapes allow
// (K and Nc multiples of 4, a batch of items fits in shared memory), else the
// plain one. Both give the same bits.
template <typename TA, typename TG, typename T>
cudaError_t LaunchCorePieces(const Geo& g, int t, const int64_t* ids, const CoreSort& cs,
                             const LevelBuffers& b, const TA* prev, const TG* dC,
                             AccT<T>* piece_out, cudaStream_t stream) {
  using C = AccT<T>;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(cs.max_pieces, kMaxGridBlocks)));
  const int64_t smem =
      int64_t{kCoreTileItems} * g.M[t] * (g.K[t] + g.Nc[t]) * static_cast<int64_t>(sizeof(C));
  const int64_t tiles = (g.K[t] / 4) * (g.Nc[t] / 4);
  const bool shapes4 = g.K[t] % 4 == 0 && g.Nc[t] % 4 == 0;
  // Narrow outputs (few 4 x 4 tiles): a group of lanes per piece, operands from registers.
  if constexpr (std::is_same<TA, C>::value && std::is_same<TG, C>::value &&
                std::is_same<T, C>::value) {
    const int group = RegGroup(tiles);
    // Only with enough pieces to fill the GPU: with few, the plain kernel's thread per
    // output hides latency better (run 9: 120 vs 366 us at B=512).
    if (shapes4 && tiles < kCoreTiledMinTiles && cs.max_pieces * group >= kRegMinLanes &&
        Aligned16(prev) && Aligned16(dC)) {
      const int64_t blocks = CeilDiv(cs.max_pieces, kBlock / group);
      CorePieceRegKernel<C>
          <<<static_cast<int>(std::max<int64_t>(1, std::min(blocks, kMaxGridBlocks))), kBlock, 0,
             stream>>>(g, t, group, ids, cs.piece_count, cs.piece_pos, cs.sorted_items, b.par[t],
                       b.row[0], prev, dC, piece_out, cs.piece_order);
      return cudaGetLastError();
    }
  }
  // Wide outputs: a block per piece, items staged in shared memory.
  if (shapes4 && smem <= 40 * 1024 && tiles >= kCoreTiledMinTiles) {
    const int threads = static_cast<int>(std::min<int64_t>(kBlock, ((tiles + 31) / 32) * 32));
    CorePieceTiledKernel<TA, TG, T><<<grid, threads, static_cast<size_t>(smem), stream>>>(
        g, t, ids, cs.piece_count, cs.piece_pos, cs.sorted_items, b.par[t], b.row[0], prev, dC,
        piece_out);
    return cudaGetLastError();
  }
  const int threads = static_cast<int>(std::min<int64_t>(kBlock, ((g.width[t] + 31) / 32) * 32));
  CorePieceKernel<TA, TG, T><<<grid, threads, 0, stream>>>(g, t, ids, cs.piece_count, cs.piece_pos,
                                                           cs.sorted_items, b.par[t], b.row[0],
                                                           prev, dC, piece_out, cs.piece_order);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchRowsGradCompute(const TTProblem& p, const int64_t* ids, int64_t max_ids,
                                  const int64_t* num_ids, const T* const* cores, const T* grad,
                                  int64_t* const* core_indices, T* const* core_values,
                                  T* const* core_dense, void* scratch, size_t scratch_bytes,
                                  const TTReport* prepared, void* work, size_t work_bytes,
                                  cudaStream_t stream) {
  using C = AccT<T>;
  Geo g;
  if (!MakeGeo(p, &g) || !ValidIdsCount(max_ids) || cores == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool dense = core_dense != nullptr;
  if (dense == (core_indices != nullptr || core_values != nullptr)) return cudaErrorInvalidValue;
  if (!dense && (core_indices == nullptr || core_values == nullptr)) return cudaErrorInvalidValue;
  for (int k = 0; k < g.T; ++k) {
    if (cores[k] == nullptr) return cudaErrorInvalidValue;
  }
  GradScratch<T> s;
  const bool own_work = work != nullptr;
  if (CarveGrad<T>(g, max_ids, nullptr, &s, !own_work) > scratch_bytes) {
    return cudaErrorInvalidValue;
  }
  if (own_work && CarveWork<T>(g, max_ids, prepared, nullptr, &s) > work_bytes) {
    return cudaErrorInvalidValue;
  }
  CarveGrad<T>(g, max_ids, scratch, &s, !own_work);
  if (own_work) CarveWork<T>(g, max_ids, prepared, work, &s);
  const int64_t nmax = max_ids;
  LevelBuffers& b = s.levels;
  if (dense) {
    for (int k = 0; k < g.T; ++k) {
      if (core_dense[k] == nullptr) return cudaErrorInvalidValue;
      TTEMB_RETURN_IF_CUDA_ERROR(
          cudaMemsetAsync(core_dense[k], 0,
                          sizeof(T) * static_cast<size_t>(g.tables * g.p[k] * g.width[k]), stream));
    }
  }
  if (nmax == 0) return cudaSuccess;
  // Forward partial products of levels 1 .. T-2: by core row where B is wide (B staged once
  // per batch of a row's items, using the core sort), else LaunchLevelForward. Same bits.
  for (int t = 1; t + 1 < g.T; ++t) {
    int64_t fwd_smem = 0;
    const int fib = ForwardByRowItems<C>(g, t, &fwd_smem);
    if (fib > 0) {
      const CoreSort& cs = s.core[t];
      const int nsub = static_cast<int>(CeilDiv(CorePieceItems(g, t), fib));
      const int64_t tiles = fib * (g.M[t] / 4) * (g.Nc[t] / 4);
      const int threads = static_cast<int>(std::min<int64_t>(kBlock, ((tiles + 31) / 32) * 32));
      if (t == 1) {
        LevelForwardByRowKernel<T, T>
            <<<ByRowGrid(cs.max_pieces, nsub), threads, static_cast<size_t>(fwd_smem), stream>>>(
                g, t, fib, nsub, cs.piece_count, cs.piece_pos, cs.sorted_items, b.row[t], b.par[t],
                b.row[0], cores[0], cores[t], s.partial[t]);
      } else {
        LevelForwardByRowKernel<C, T>
            <<<ByRowGrid(cs.max_pieces, nsub), threads, static_cast<size_t>(fwd_smem), stream>>>(
                g, t, fib, nsub, cs.piece_count, cs.piece_pos, cs.sorted_items, b.row[t], b.par[t],
                b.row[0], s.partial[t - 1], cores[t], s.partial[t]);
      }
      TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
      continue;
    }
    cudaError_t err = t == 1 ? LaunchLevelForward<T, T, C>(g, t, ids, nmax, b, cores[0], cores[t],
                                                           s.partial[t], stream)
                             : LaunchLevelForward<C, T, C>(g, t, ids, nmax, b, s.partial[t - 1],
                                                           cores[t], s.partial[t], stream);
    TTEMB_RETURN_IF_CUDA_ERROR(err);
  }
  auto combine = [&](int k) -> cudaError_t {
    const CoreSort& cs = s.core[k];
    const int64_t W = g.width[k];
    CombinePiecesKernel<T><<<GridFor(cs.max_rows * W), kBlock, 0, stream>>>(
        W, cs.row_count, cs.seg_first_piece, cs.seg_row, s.pieces,
        dense ? nullptr : core_indices[k], dense ? nullptr : core_values[k],
        dense ? core_dense[k] : nullptr);
    return cudaGetLastError();
  };
  // Levels T-1 .. 1: parent gradient and core gradient.
  for (int t = g.T - 1; t >= 1; --t) {
    const bool last = t == g.T - 1;
    {
      const CoreSort& ch = s.child[t];
      const int grid =
          static_cast<int>(std::max<int64_t>(1, std::min(ch.max_pieces, kMaxGridBlocks)));
      bool launched = false;  // the parent-gradient kernel of this level
      bool by_row = false;
      int64_t by_row_smem = 0;
      const int ib = ByRowItems<C>(g, t, &by_row_smem);
      if (ib > 0) {
        // Wide B: children by core row, B staged once per piece (replaces the wide kernel).
        const CoreSort& cs = s.core[t];
        const int nsub = static_cast<int>(CeilDiv(CorePieceItems(g, t), ib));
        const int cgrid = ByRowGrid(cs.max_pieces, nsub);
        const int64_t tiles = ib * (g.M[t] / 4) * (g.K[t] / 4);
        const int threads = static_cast<int>(std::min<int64_t>(kBlock, ((tiles + 31) / 32) * 32));
        if (last) {
          ParentByRowKernel<T, T><<<cgrid, threads, static_cast<size_t>(by_row_smem), stream>>>(
              g, t, ib, nsub, ids, cs.piece_count, cs.piece_pos, cs.sorted_items, b.row[t], grad,
              cores[t], s.pieces);
        } else {
          ParentByRowKernel<C, T><<<cgrid, threads, static_cast<size_t>(by_row_smem), stream>>>(
              g, t, ib, nsub, ids, cs.piece_count, cs.piece_pos, cs.sorted_items, b.row[t],
              s.dpartial[t], cores[t], s.pieces);
        }
        by_row = true;
        launched = true;
      }
      if constexpr (std::is_same<T, C>::value) {
        const C* dC = last ? grad : s.dpartial[t];
        // Narrow B only: for Nc >= 32 the wide kernel's lanes across c win (run 9).
        if (!launched && g.Nc[t] < 32 && g.M[t] % 4 == 0 && g.K[t] % 4 == 0 && g.Nc[t] % 4 == 0 &&
            Aligned16(dC) && Aligned16(cores[t])) {
          const int group = RegGroup((g.M[t] / 4) * (g.K[t] / 4));
          const int64_t blocks = CeilDiv(ch.max_pieces, kBlock / group);
          ParentPieceRegKernel<C>
              <<<static_cast<int>(std::max<int64_t>(1, std::min(blocks, kMaxGridBlocks))), kBlock,
                 0, stream>>>(g, t, group, ids, ch.piece_count, ch.piece_pos, b.row[t], dC,
                              cores[t], s.pieces);
          launched = true;
        }
      }
      if (launched) {
        // by row or by register tiles, above
      } else if (g.Nc[t] >= 32) {
        auto wide = [&](auto mm_tag, auto tg_tag) {
          constexpr int MM = decltype(mm_tag)::value;
          using TG = typename decltype(tg_tag)::type;
          // The rows' gradient at the last level, else dP_t (T may equal C).
          const TG* dC = nullptr;
          if constexpr (std::is_same<TG, T>::value) {
            if (last) dC = grad;
          }
          if constexpr (std::is_same<TG, C>::value) {
            if (!last) dC = s.dpartial[t];
          }
          const int64_t outputs = CeilDiv(g.M[t], MM) * g.K[t];
          const int threads = static_cast<int>(std::min<int64_t>(kBlock, outputs * 32));
          ParentPieceWideKernel<MM, TG, T><<<grid, threads, 0, stream>>>(
              g, t, ids, ch.piece_count, ch.piece_pos, b.row[t], dC, cores[t], s.pieces);
        };
        auto by_type = [&](auto mm_tag) {
          if (last) {
            wide(mm_tag, TypeTag<T>{});
          } else {
            wide(mm_tag, TypeTag<C>{});
          }
        };
        if (g.M[t] >= 4) {
          by_type(std::integral_constant<int, 4>{});
        } else if (g.M[t] >= 2) {
          by_type(std::integral_constant<int, 2>{});
        } else {
          by_type(std::integral_constant<int, 1>{});
        }
      } else {
        const int64_t smem = int64_t{kChildPieceItems} * g.Nc[t] * (g.M[t] + g.K[t]) *
                             static_cast<int64_t>(sizeof(C));
        if (g.M[t] % 4 == 0 && g.K[t] % 4 == 0 && smem <= 40 * 1024) {
          const int64_t tiles = (g.M[t] / 4) * (g.K[t] / 4);
          const int threads = static_cast<int>(std::min<int64_t>(kBlock, ((tiles + 31) / 32) * 32));
          if (last) {
            ParentPieceTiledKernel<T, T><<<grid, threads, static_cast<size_t>(smem), stream>>>(
                g, t, ids, ch.piece_count, ch.piece_pos, b.row[t], grad, cores[t], s.pieces);
          } else {
            ParentPieceTiledKernel<C, T><<<grid, threads, static_cast<size_t>(smem), stream>>>(
                g, t, ids, ch.piece_count, ch.piece_pos, b.row[t], s.dpartial[t], cores[t],
                s.pieces);
          }
        } else {
          const int threads =
              static_cast<int>(std::min<int64_t>(kBlock, ((g.S[t - 1] + 31) / 32) * 32));
          if (last) {
            ParentPieceKernel<T, T><<<grid, threads, 0, stream>>>(
                g, t, ids, ch.piece_count, ch.piece_pos, b.row[t], grad, cores[t], s.pieces);
          } else {
            ParentPieceKernel<C, T>
                <<<grid, threads, 0, stream>>>(g, t, ids, ch.piece_count, ch.piece_pos, b.row[t],
                                               s.dpartial[t], cores[t], s.pieces);
          }
        }
      }
      TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
      if (by_row) {
        ChildCombineKernel<C><<<GridFor(nmax * g.S[t - 1]), kBlock, 0, stream>>>(
            g, t, ids, g.S[t - 1], &b.counts[t], ch.seg_first_piece, ch.piece_pos, s.pieces,
            s.dpartial[t - 1]);
      } else {
        ParentCombineKernel<C><<<GridFor(nmax * g.S[t - 1]), kBlock, 0, stream>>>(
            g.S[t - 1], &b.counts[t], ch.seg_first_piece, s.pieces, s.dpartial[t - 1]);
      }
      TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    }
    const CoreSort& cs = s.core[t];
    cudaError_t err;
    if (t == 1 && last) {
      err = LaunchCorePieces<T, T, T>(g, t, ids, cs, b, cores[0], grad, s.pieces, stream);
    } else if (t == 1) {
      err = LaunchCorePieces<T, C, T>(g, t, ids, cs, b, cores[0], s.dpartial[t], s.pieces, stream);
    } else if (last) {
      err = LaunchCorePieces<C, T, T>(g, t, ids, cs, b, s.partial[t - 1], grad, s.pieces, stream);
    } else {
      err = LaunchCorePieces<C, C, T>(g, t, ids, cs, b, s.partial[t - 1], s.dpartial[t], s.pieces,
                                      stream);
    }
    TTEMB_RETURN_IF_CUDA_ERROR(err);
    TTEMB_RETURN_IF_CUDA_ERROR(combine(t));
  }
  // Core 0: sum of dP_0 over the level-0 items of each row.
  {
    const CoreSort& cs = s.core[0];
    const int grid =
        static_cast<int>(std::max<int64_t>(1, std::min(cs.max_pieces, kMaxGridBlocks)));
    const int threads = static_cast<int>(std::min<int64_t>(kBlock, ((g.width[0] + 31) / 32) * 32));
    Core0PieceKernel<C><<<grid, threads, 0, stream>>>(g.width[0], cs.piece_count, cs.piece_pos,
                                                      cs.sorted_items, s.dpartial[0], s.pieces);
    TTEMB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    TTEMB_RETURN_IF_CUDA_ERROR(combine(0));
  }
  return cudaSuccess;
}

#define TT_INSTANTIATE_VALUE(T)                                                             \
  template cudaError_t LaunchRowsGradCompute<T>(                                            \
      const TTProblem&, const int64_t*, int64_t, const int64_t*, const T* const*, const T*, \
      int64_t* const*, T* const*, T* const*, void*, size_t, const TTReport*, void*, size_t, \
      cudaStream_t);

TTEMB_FOR_EACH_VALUE_TYPE(TT_INSTANTIATE_VALUE)

}  // namespace gpu
}  // namespace tf_ttemb
