// CPU kernels of the TT embedding family (TTUniqueIds, TTRows, TTRowsGrad,
// TTCacheCount); their validation is tt_embedding_kernels.cc.
//
// TTRows / TTRowsGrad work on chunks of ids (sized so the temporaries stay
// under kChunkBytes) and, per chunk, on a prefix tree: level k has one node
// per run of consecutive ids with the same leading digits i_0..i_k (for sorted
// ids: one node per distinct prefix), so each partial product
//   P_k = G_0[i_0] G_1[i_1] ... G_k[i_k]       ((q_0..q_k) x r_{k+1})
// is computed once per node from its parent's. The nodes of a level are
// grouped by the core row they multiply with; a group is one GEMM
//   [n * q_0..q_{k-1}, r_k] x [r_k, q_k r_{k+1}]
// (its parents' P_{k-1} stacked, times the core row), run by one thread of
// TF's CPU pool. The backward recomputes P_0..P_{T-2}, walks the levels from
// the last, and per group computes the core row's gradient (P_{k-1}^T dP_k,
// summed over the group in node order) and the parents' contributions
// (dP_k G_k^T), which are summed per parent in child order. Every sum has a
// fixed order that does not depend on the thread count, and every core row's
// gradient is written by one thread: the result is bitwise reproducible
// without atomics.

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "Eigen/Core"
#include "cc/kernels/check_report_op.h"
#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/tt_embedding_kernels.h"
#include "cc/kernels/tt_embedding_op.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {

namespace {

// Temporaries of one chunk of ids (prefix products and their gradients) stay
// under this many bytes.
constexpr int64_t kChunkBytes = int64_t{32} << 20;

template <typename Acc>
using RowMajorMatrix = Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename Acc>
using ConstMatrixMap = Eigen::Map<const RowMajorMatrix<Acc>>;
template <typename Acc>
using MatrixMap = Eigen::Map<RowMajorMatrix<Acc>>;

// The cores as Acc arrays: the tensors' own data when T is Acc, float copies
// for float16/bfloat16.
template <typename T, typename Acc>
class Cores {
 public:
  Cores(const OpInputList& cores, const TTShape& shape) : width_(shape.width) {
    for (int k = 0; k < shape.num_cores; ++k) {
      const auto flat = cores[k].flat<T>();
      if (std::is_same<T, Acc>::value) {
        data_.push_back(reinterpret_cast<const Acc*>(flat.data()));
      } else {
        copies_.emplace_back(flat.size());
        std::vector<Acc>& copy = copies_.back();
        for (int64_t i = 0; i < flat.size(); ++i) {
          copy[i] = static_cast<Acc>(flat(i));
        }
        data_.push_back(copy.data());
      }
    }
  }
  // Block G_k[row], r_k x (q_k r_{k+1}) row-major.
  const Acc* Row(int k, int64_t row) const { return data_[k] + row * width_[k]; }

 private:
  std::vector<int64_t> width_;
  std::vector<std::vector<Acc>> copies_;
  std::vector<const Acc*> data_;
};

// One level of a chunk's prefix tree.
//
// Nodes are numbered in creation order (children of a parent are consecutive);
// their products are stored at their position in `order`, so that a group's
// products are one contiguous block.
struct Level {
  std::vector<int64_t> parent;    // [count] node at the previous level
  std::vector<int64_t> core_row;  // [count] row of core k it multiplies with
  std::vector<int64_t> order;     // [count] nodes sorted by (core_row, node)
  std::vector<int64_t> slot;      // [count] position of each node in order
  std::vector<int64_t> groups;    // offsets into order of each core row's run
  std::vector<int64_t> children;  // [count + 1] offsets of each node's children
                                  // among the next level's nodes
  int64_t count() const { return static_cast<int64_t>(parent.size()); }
  int64_t num_groups() const { return static_cast<int64_t>(groups.size()) - 1; }
};

// The prefix tree of ids[0, n): nodes are runs of consecutive ids with equal
// leading digits; leaf[j] is id j's node at the last level.
struct PrefixTree {
  std::vector<Level> levels;
  std::vector<int64_t> leaf;
  std::vector<int64_t> leaf_ids;  // [num_leaves + 1] offsets of each leaf's ids

  void Build(const int64_t* ids, int64_t n, const TTShape& s) {
    const int T = s.num_cores;
    levels.assign(T, Level());
    leaf.resize(n);
    std::vector<int64_t> current(T, -1);
    for (int64_t j = 0; j < n; ++j) {
      int first_new = 0;
      if (j > 0) {
        // Equal keys at level k imply equal keys at every level below it.
        while (first_new < T &&
               s.PrefixKey(ids[j], first_new) == s.PrefixKey(ids[j - 1], first_new)) {
          ++first_new;
        }
      }
      for (int k = first_new; k < T; ++k) {
        Level& level = levels[k];
        level.parent.push_back(k == 0 ? -1 : current[k - 1]);
        level.core_row.push_back(s.CoreRow(ids[j], k));
        current[k] = level.count() - 1;
      }
      leaf[j] = current[T - 1];
    }
    for (Level& level : levels) {
      const int64_t count = level.count();
      level.order.resize(count);
      std::iota(level.order.begin(), level.order.end(), 0);
      std::stable_sort(level.order.begin(), level.order.end(),
                       [&](int64_t a, int64_t b) { return level.core_row[a] < level.core_row[b]; });
      level.slot.resize(count);
      for (int64_t i = 0; i < count; ++i) level.slot[level.order[i]] = i;
      level.groups.clear();
      for (int64_t i = 0; i < count; ++i) {
        if (i == 0 || level.core_row[level.order[i]] != level.core_row[level.order[i - 1]]) {
          level.groups.push_back(i);
        }
      }
      level.groups.push_back(count);
    }
    // Parents are non-decreasing along a level's nodes: children are runs.
    for (int k = 0; k + 1 < T; ++k) {
      Offsets(levels[k + 1].parent, levels[k].count(), &levels[k].children);
    }
    Offsets(leaf, levels[T - 1].count(), &leaf_ids);
  }

  // offsets[v] = first position of value v in the non-decreasing `values`.
  static void Offsets(const std::vector<int64_t>& values, int64_t num_values,
                      std::vector<int64_t>* offsets) {
    offsets->assign(num_values + 1, 0);
    int64_t v = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i) {
      while (v <= values[i]) (*offsets)[v++] = i;
    }
    while (v <= num_values) (*offsets)[v++] = static_cast<int64_t>(values.size());
  }
};

// Products with few output columns: the last core has r_T = 1, so its block
// is r_{T-1} x q_{T-1}, often only 4 columns wide, and a blocked GEMM spends
// more time packing its operands than multiplying. For float32 with AVX2+FMA
// (configure.sh compiles for the build machine's CPU) and a contracted
// dimension that is a multiple of 8 (every power-of-two rank >= 8), these
// run as register-blocked loops; everything else goes to Eigen's GEMM.
constexpr int64_t kSkinny = 8;

// The kernels for n = N <= kSkinny columns, defined only with AVX2 and FMA, where
// RunSkinny (below) runs them.
template <int N>
void SkinnyProduct(const float* __restrict a, const float* __restrict b, float* __restrict c,
                   int64_t m, int64_t k);
template <int N>
void SkinnyTransposedProduct(const float* __restrict a, const float* __restrict d,
                             float* __restrict g, int64_t m, int64_t k);
template <int N>
void SkinnyProductTransposed(const float* __restrict d, const float* __restrict b,
                             float* __restrict c, int64_t m, int64_t k);

#if defined(__AVX2__) && defined(__FMA__)
#define TF_TTEMB_TT_AVX2 1

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// c [m, N] = a [m, k] * b [k, N]: N dot products of length k per row of a.
template <int N>
void SkinnyProduct(const float* __restrict a, const float* __restrict b, float* __restrict c,
                   int64_t m, int64_t k) {
  std::vector<float> bt(N * k);  // b transposed: [N, k]
  for (int j = 0; j < N; ++j) {
    for (int64_t x = 0; x < k; ++x) bt[j * k + x] = b[x * N + j];
  }
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = a + i * k;
    __m256 acc[N];
    for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t x = 0; x < k; x += 8) {
      const __m256 av = _mm256_loadu_ps(ai + x);
      for (int j = 0; j < N; ++j) {
        acc[j] = _mm256_fmadd_ps(av, _mm256_loadu_ps(&bt[j * k + x]), acc[j]);
      }
    }
    if constexpr (N == 4) {
      const __m256 s =
          _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      _mm_storeu_ps(c + i * N, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    } else {
      for (int j = 0; j < N; ++j) c[i * N + j] = HorizontalSum(acc[j]);
    }
  }
}

// g [k, N] += a [m, k]^T * d [m, N], summed over the rows of a in order.
template <int N>
void SkinnyTransposedProduct(const float* __restrict a, const float* __restrict d,
                             float* __restrict g, int64_t m, int64_t k) {
  for (int64_t x = 0; x < k; x += 8) {
    __m256 acc[N];
    for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < m; ++i) {
      const __m256 av = _mm256_loadu_ps(a + i * k + x);
      for (int j = 0; j < N; ++j) {
        acc[j] = _mm256_fmadd_ps(av, _mm256_broadcast_ss(d + i * N + j), acc[j]);
      }
    }
    alignas(32) float lanes[8];
    for (int j = 0; j < N; ++j) {
      _mm256_store_ps(lanes, acc[j]);
      for (int l = 0; l < 8; ++l) g[(x + l) * N + j] += lanes[l];
    }
  }
}

// c [m, k] = d [m, N] * b [k, N]^T.
template <int N>
void SkinnyProductTransposed(const float* __restrict d, const float* __restrict b,
                             float* __restrict c, int64_t m, int64_t k) {
  std::vector<float> bt(N * k);  // b transposed: [N, k]
  for (int j = 0; j < N; ++j) {
    for (int64_t x = 0; x < k; ++x) bt[j * k + x] = b[x * N + j];
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t x = 0; x < k; x += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int j = 0; j < N; ++j) {
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(d + i * N + j), _mm256_loadu_ps(&bt[j * k + x]),
                              acc);
      }
      _mm256_storeu_ps(c + i * k + x, acc);
    }
  }
}

// Calls fn(std::integral_constant<int, N>()) for N = n when n < kSkinny, else for
// N = kSkinny.
template <int N = 1, typename Fn>
void WithSkinnyWidth(int64_t n, Fn fn) {
  if constexpr (N < kSkinny) {
    if (n != N) return WithSkinnyWidth<N + 1>(n, fn);
  }
  fn(std::integral_constant<int, N>());
}

#endif  // __AVX2__ && __FMA__

// Whether the AVX2 kernels above take a product of inner size k and n columns (float,
// n <= kSkinny, k % 8 == 0); if so, runs kernel(std::integral_constant<int, n>()).
template <typename Acc, typename Kernel>
bool RunSkinny(int64_t k, int64_t n, Kernel kernel) {
#ifdef TF_TTEMB_TT_AVX2
  if constexpr (std::is_same<Acc, float>::value) {
    if (n <= kSkinny && k % 8 == 0) {
      WithSkinnyWidth(n, kernel);
      return true;
    }
  }
#endif
  return false;
}

// c [m, n] = a [m, k] * b [k, n].
template <typename Acc>
void Product(const Acc* a, const Acc* b, Acc* c, int64_t m, int64_t k, int64_t n) {
  if (RunSkinny<Acc>(k, n, [&](auto w) { SkinnyProduct<decltype(w)::value>(a, b, c, m, k); })) {
    return;
  }
  MatrixMap<Acc>(c, m, n).noalias() = ConstMatrixMap<Acc>(a, m, k) * ConstMatrixMap<Acc>(b, k, n);
}

// g [k, n] += a [m, k]^T * d [m, n].
template <typename Acc>
void AddTransposedProduct(const Acc* a, const Acc* d, Acc* g, int64_t m, int64_t k, int64_t n) {
  if (RunSkinny<Acc>(k, n,
                     [&](auto w) { SkinnyTransposedProduct<decltype(w)::value>(a, d, g, m, k); })) {
    return;
  }
  MatrixMap<Acc>(g, k, n).noalias() +=
      ConstMatrixMap<Acc>(a, m, k).transpose() * ConstMatrixMap<Acc>(d, m, n);
}

// c [m, k] = d [m, n] * b [k, n]^T.
template <typename Acc>
void ProductTransposed(const Acc* d, const Acc* b, Acc* c, int64_t m, int64_t k, int64_t n) {
  if (RunSkinny<Acc>(k, n,
                     [&](auto w) { SkinnyProductTransposed<decltype(w)::value>(d, b, c, m, k); })) {
    return;
  }
  MatrixMap<Acc>(c, m, k).noalias() =
      ConstMatrixMap<Acc>(d, m, n) * ConstMatrixMap<Acc>(b, k, n).transpose();
}

// A growable array that is written before it is read: resizing keeps no
// contents and never zero-fills (a std::vector would memset every chunk).
template <typename Acc>
class Buffer {
 public:
  void Resize(int64_t size) {
    if (size > capacity_) {
      data_.reset(new Acc[size]);
      capacity_ = size;
    }
  }
  Acc* data() { return data_.get(); }
  const Acc* data() const { return data_.get(); }
  void swap(Buffer& other) {
    data_.swap(other.data_);
    std::swap(capacity_, other.capacity_);
  }

 private:
  std::unique_ptr<Acc[]> data_;
  int64_t capacity_ = 0;
};

// Scratch that is written before it is read: no zero-initialisation.
template <typename Acc>
std::unique_ptr<Acc[]> Scratch(int64_t size) {
  return std::unique_ptr<Acc[]>(new Acc[size]);
}

// Ids per chunk so that `bytes_per_id` of temporaries per id fit kChunkBytes.
int64_t ChunkSize(int64_t bytes_per_id) {
  return std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes_per_id));
}

// Runs fn(g) for every group of `level`, spread over the pool.
template <typename Fn>
void ForGroups(thread::ThreadPool* pool, const Level& level, int64_t flops_per_node, Fn fn) {
  const int64_t num_groups = level.num_groups();
  if (num_groups <= 0) return;
  const int64_t cost = std::max<int64_t>(1, level.count() * flops_per_node / num_groups);
  pool->ParallelFor(num_groups, cost, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) fn(g);
  });
}

// Computes the partial products P_0..P_last_level of a chunk's tree (node
// blocks at their slots, [count_k, cols_k * r_{k+1}]) into `buffers`, or, for
// level `external_level`, into `external`; data[k] points at level k's.
template <typename T, typename Acc>
void ForwardLevels(thread::ThreadPool* pool, const TTShape& s, const Cores<T, Acc>& cores,
                   const PrefixTree& tree, int last_level, int external_level, Acc* external,
                   std::vector<Buffer<Acc>>* buffers, std::vector<const Acc*>* data) {
  buffers->resize(s.num_cores);
  data->assign(s.num_cores, nullptr);
  auto storage = [&](int k, int64_t size) {
    if (k == external_level) return external;
    (*buffers)[k].Resize(size);
    return (*buffers)[k].data();
  };
  if (last_level < 0) return;
  {
    const Level& level = tree.levels[0];
    const int64_t width = s.width[0];
    Acc* out = storage(0, level.count() * width);
    for (int64_t i = 0; i < level.count(); ++i) {
      std::copy_n(cores.Row(0, level.core_row[level.order[i]]), width, out + i * width);
    }
    (*data)[0] = out;
  }
  for (int k = 1; k <= last_level; ++k) {
    const Level& level = tree.levels[k];
    const Level& up = tree.levels[k - 1];
    const int64_t rows = s.cols[k - 1];  // rows of one node's block
    const int64_t inner = s.r[k];        // contracted rank
    const int64_t out_cols = s.q[k] * s.r[k + 1];
    const int64_t in_size = rows * inner;
    const int64_t out_size = rows * out_cols;
    const Acc* in = (*data)[k - 1];
    Acc* out = storage(k, level.count() * out_size);
    (*data)[k] = out;
    ForGroups(pool, level, 2 * in_size * out_cols, [&](int64_t g) {
      const int64_t first = level.groups[g];
      const int64_t n = level.groups[g + 1] - first;
      const Acc* core = cores.Row(k, level.core_row[level.order[first]]);
      Acc* c = out + first * out_size;
      if (n == 1) {
        const int64_t parent = up.slot[level.parent[level.order[first]]];
        Product(in + parent * in_size, core, c, rows, inner, out_cols);
        return;
      }
      auto a_buf = Scratch<Acc>(n * in_size);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t parent = up.slot[level.parent[level.order[first + i]]];
        std::copy_n(in + parent * in_size, in_size, a_buf.get() + i * in_size);
      }
      Product(a_buf.get(), core, c, n * rows, inner, out_cols);
    });
  }
}

// The products TTRows saves for TTRowsGrad: level T-2's, when the table is
// float32/float64 (no rounding to a half type), has >= 3 cores (for 2 cores
// they are rows of the first core) and they fit kSavedBytes.
constexpr int64_t kSavedBytes = int64_t{64} << 20;

// Number of level-`level` nodes of each chunk: runs of equal prefix keys.
std::vector<int64_t> NodesPerChunk(const int64_t* ids, int64_t num_ids, int64_t chunk, int level,
                                   const TTShape& s) {
  std::vector<int64_t> counts;
  for (int64_t begin = 0; begin < num_ids; begin += chunk) {
    const int64_t end = std::min(num_ids, begin + chunk);
    int64_t count = 1;
    for (int64_t j = begin + 1; j < end; ++j) {
      count += s.PrefixKey(ids[j], level) != s.PrefixKey(ids[j - 1], level);
    }
    counts.push_back(count);
  }
  return counts;
}

// Elements of the saved products per level-(T-2) node.
int64_t SavedNodeSize(const TTShape& s) { return s.cols[s.num_cores - 2] * s.r[s.num_cores - 1]; }

// `saved` starts with a 64-bit fingerprint of the ids and of the cores it was
// computed from (cores 0..T-2, those level T-2's products read), so that
// TTRowsGrad refuses products saved for other ids or other cores instead of
// silently using them; this many elements of Acc hold it.
template <typename Acc>
constexpr int64_t SavedHeader() {
  return static_cast<int64_t>(sizeof(uint64_t) / sizeof(Acc));
}

inline uint64_t Mix(uint64_t h, uint64_t value) {
  return h ^ (value + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
}

// A checksum of a tensor's bytes: its 64-bit words weighted by odd position
// factors and summed (vectorisable, about memory speed), so that other
// values, or the same values moved, give another sum.
uint64_t BytesChecksum(const Tensor& t) {
  const absl::string_view bytes = t.tensor_data();
  const char* data = bytes.data();
  const size_t words = bytes.size() / sizeof(uint64_t);
  uint64_t sum = bytes.size();
  for (size_t i = 0; i < words; ++i) {
    uint64_t word;
    std::memcpy(&word, data + i * sizeof(uint64_t), sizeof(word));
    sum += word * (2 * static_cast<uint64_t>(i) + 1);
  }
  for (size_t i = words * sizeof(uint64_t); i < bytes.size(); ++i) {
    sum = Mix(sum, static_cast<unsigned char>(data[i]));
  }
  return sum;
}

uint64_t SavedFingerprint(const int64_t* ids, int64_t num_ids, const OpInputList& cores,
                          int num_cores) {
  uint64_t h = 0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(num_ids);
  for (int64_t j = 0; j < num_ids; ++j) {
    h = Mix(h, static_cast<uint64_t>(ids[j]));
  }
  for (int k = 0; k + 1 < num_cores; ++k) h = Mix(h, BytesChecksum(cores[k]));
  return h;
}

// Bytes of temporaries per id of a chunk: prefix products (and, for the
// backward, their gradients and the parents' contributions).
int64_t BytesPerId(const TTShape& s, int64_t acc_size, bool backward) {
  int64_t per_id = 0;
  for (int k = 0; k < s.num_cores; ++k) {
    per_id += s.cols[k] * s.r[k + 1];
  }
  return per_id * acc_size * (backward ? 4 : 2);
}

// ---------------------------------------------------------------------------
// TTUniqueIds

template <typename Tindex>
Status UniqueIds(OpKernelContext* ctx, const UniqueIdsAttrs& attrs, const UniqueIdsArgs& a,
                 thread::ThreadPool* pool) {
  const auto ids = a.ids->flat<Tindex>();
  const auto splits = a.table_splits->flat<int64_t>();
  const int64_t nnz = a.nnz;
  const int64_t num_embeddings = attrs.num_embeddings;

  // Global id of every entry, -1 for padding; the first bad id fails.
  std::vector<int64_t> global(nnz);
  for (int64_t t = 0; t < a.num_tables; ++t) {
    for (int64_t j = splits(t); j < splits(t + 1); ++j) {
      const int64_t id = static_cast<int64_t>(ids(j));
      if (IsPadding(ids(j), attrs.bag)) {
        global[j] = -1;
        continue;
      }
      if (id < 0 || id >= num_embeddings) return BadIndexError(j, id, num_embeddings, attrs.bag);
      global[j] = t * attrs.stride + id;
    }
  }
  std::vector<int64_t> sorted;
  sorted.reserve(nnz);
  for (int64_t g : global) {
    if (g >= 0) sorted.push_back(g);
  }
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());

  Tensor* unique_t = nullptr;
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(0, TensorShape({static_cast<int64_t>(sorted.size())}), &unique_t));
  std::copy(sorted.begin(), sorted.end(), unique_t->flat<int64_t>().data());
  Tindex* slots = a.slots->flat<Tindex>().data();
  auto assign = [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      slots[j] =
          global[j] < 0
              ? Tindex(-1)
              : static_cast<Tindex>(std::lower_bound(sorted.begin(), sorted.end(), global[j]) -
                                    sorted.begin());
    }
  };
  pool->ParallelFor(nnz, 40, assign);
  return OkStatus();
}

// ---------------------------------------------------------------------------
// TTRows

template <typename T>
Status Rows(OpKernelContext* ctx, const TTShape& s, const TTRowsArgs& a, thread::ThreadPool* pool) {
  using Acc = AccT<T>;
  const int64_t num_ids = a.num_ids;
  if (num_ids == 0) {
    Tensor* saved_t = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({0}), &saved_t));
    return OkStatus();
  }
  const int64_t* ids = a.ids->flat<int64_t>().data();
  T* rows = a.rows->flat<T>().data();
  const Cores<T, Acc> cores(a.cores, s);
  const int T_last = s.num_cores - 1;
  // The same chunks as TTRowsGrad, so that it can use the saved products.
  const int64_t chunk = ChunkSize(BytesPerId(s, sizeof(Acc), true));
  const int save_level = s.num_cores - 2;
  std::vector<int64_t> saved_counts;
  int64_t saved_size = 0;
  if (std::is_same<T, Acc>::value && s.num_cores >= 3) {
    saved_counts = NodesPerChunk(ids, num_ids, chunk, save_level, s);
    const int64_t nodes = std::accumulate(saved_counts.begin(), saved_counts.end(), int64_t{0});
    if (nodes * SavedNodeSize(s) * static_cast<int64_t>(sizeof(Acc)) <= kSavedBytes) {
      saved_size = SavedHeader<Acc>() + nodes * SavedNodeSize(s);
    }
  }
  Tensor* saved_t = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({saved_size}), &saved_t));
  Acc* saved = nullptr;
  if (saved_size > 0) {
    saved = reinterpret_cast<Acc*>(saved_t->flat<T>().data());
    const uint64_t fingerprint = SavedFingerprint(ids, num_ids, a.cores, s.num_cores);
    std::memcpy(saved, &fingerprint, sizeof(fingerprint));
    saved += SavedHeader<Acc>();
  }
  PrefixTree tree;
  std::vector<Buffer<Acc>> buffers;
  std::vector<const Acc*> data;
  int64_t chunk_index = 0;
  for (int64_t begin = 0; begin < num_ids; begin += chunk, ++chunk_index) {
    const int64_t n = std::min(chunk, num_ids - begin);
    tree.Build(ids + begin, n, s);
    ForwardLevels(pool, s, cores, tree, T_last, saved ? save_level : -1, saved, &buffers, &data);
    if (saved) saved += saved_counts[chunk_index] * SavedNodeSize(s);
    const Acc* last = data[T_last];
    const int64_t dim = s.dim;
    pool->ParallelFor(n, dim, [&](int64_t first, int64_t end) {
      for (int64_t j = first; j < end; ++j) {
        const Acc* src = last + tree.levels[T_last].slot[tree.leaf[j]] * dim;
        T* dst = rows + (begin + j) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(src[d]);
      }
    });
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------
// TTRowsGrad

template <typename T>
Status RowsGrad(OpKernelContext* ctx, const TTShape& s, const TTRowsGradArgs& a,
                thread::ThreadPool* pool) {
  using Acc = AccT<T>;
  const int T_count = s.num_cores;
  const int64_t num_ids = a.num_ids;
  const Tensor& grad_t = *a.grad;
  TF_RETURN_IF_ERROR(ValidateRowsGradShape(grad_t, num_ids, s));
  const int64_t* ids = a.ids->flat<int64_t>().data();
  const T* grad = grad_t.flat<T>().data();

  // The core rows each core's gradient has: those any id touches.
  std::vector<std::vector<int64_t>> touched(T_count);
  for (int k = 0; k < T_count; ++k) {
    std::vector<int64_t>& rows = touched[k];
    rows.resize(num_ids);
    for (int64_t j = 0; j < num_ids; ++j) rows[j] = s.CoreRow(ids[j], k);
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  }
  // Core gradients accumulate here, one [n_k, width_k] block per core.
  std::vector<std::vector<Acc>> core_grad(T_count);
  for (int k = 0; k < T_count; ++k) {
    core_grad[k].assign(touched[k].size() * s.width[k], Acc(0));
  }
  auto grad_block = [&](int k, int64_t core_row) {
    const std::vector<int64_t>& rows = touched[k];
    const int64_t slot = std::lower_bound(rows.begin(), rows.end(), core_row) - rows.begin();
    return core_grad[k].data() + slot * s.width[k];
  };

  // TTRows' saved products of level T-2, when it saved them.
  const Tensor& saved_t = *a.saved;
  const int64_t chunk = ChunkSize(BytesPerId(s, sizeof(Acc), true));
  std::vector<int64_t> saved_counts;
  const Acc* saved = nullptr;
  if (saved_t.NumElements() > 0) {
    int64_t expected = 0;
    if (std::is_same<T, Acc>::value && T_count >= 3) {
      saved_counts = NodesPerChunk(ids, num_ids, chunk, T_count - 2, s);
      expected =
          SavedHeader<Acc>() +
          std::accumulate(saved_counts.begin(), saved_counts.end(), int64_t{0}) * SavedNodeSize(s);
    }
    const auto mismatch = [&](const char* what) { return SavedMismatchError(saved_t, what); };
    if (saved_t.dims() != 1 || saved_t.NumElements() != expected) {
      return mismatch("does not have the size these ids need");
    }
    saved = reinterpret_cast<const Acc*>(saved_t.flat<T>().data());
    uint64_t fingerprint;
    std::memcpy(&fingerprint, saved, sizeof(fingerprint));
    if (fingerprint != SavedFingerprint(ids, num_ids, a.cores, T_count)) {
      return mismatch("was computed for other ids or other cores");
    }
    saved += SavedHeader<Acc>();
  }

  if (num_ids > 0) {
    const Cores<T, Acc> cores(a.cores, s);
    PrefixTree tree;
    std::vector<Buffer<Acc>> buffers;
    std::vector<const Acc*> prefix;
    Buffer<Acc> d_prefix, d_parent, contrib;
    int64_t chunk_index = 0;
    for (int64_t begin = 0; begin < num_ids; begin += chunk, ++chunk_index) {
      const int64_t n = std::min(chunk, num_ids - begin);
      tree.Build(ids + begin, n, s);
      if (saved) {
        ForwardLevels(pool, s, cores, tree, T_count - 3, -1, static_cast<Acc*>(nullptr), &buffers,
                      &prefix);
        prefix[T_count - 2] = saved;
        saved += saved_counts[chunk_index] * SavedNodeSize(s);
      } else {
        ForwardLevels(pool, s, cores, tree, T_count - 2, -1, static_cast<Acc*>(nullptr), &buffers,
                      &prefix);
      }

      // dP_{T-1} per leaf: the grad rows of its ids, in id order.
      const int64_t dim = s.dim;
      const Level& leaves = tree.levels[T_count - 1];
      d_prefix.Resize(leaves.count() * dim);
      pool->ParallelFor(leaves.count(), 2 * dim, [&](int64_t lo, int64_t hi) {
        for (int64_t leaf = lo; leaf < hi; ++leaf) {
          Acc* dst = d_prefix.data() + leaves.slot[leaf] * dim;
          std::fill_n(dst, dim, Acc(0));
          for (int64_t j = tree.leaf_ids[leaf]; j < tree.leaf_ids[leaf + 1]; ++j) {
            const T* src = grad + (begin + j) * dim;
            for (int64_t d = 0; d < dim; ++d) {
              dst[d] += static_cast<Acc>(src[d]);
            }
          }
        }
      });

      for (int k = T_count - 1; k >= 1; --k) {
        const Level& level = tree.levels[k];
        const Level& up = tree.levels[k - 1];
        const int64_t rows = s.cols[k - 1];
        const int64_t inner = s.r[k];
        const int64_t out_cols = s.q[k] * s.r[k + 1];
        const int64_t in_size = rows * inner;
        const int64_t out_size = rows * out_cols;
        const Acc* parents = prefix[k - 1];
        contrib.Resize(level.count() * in_size);
        ForGroups(pool, level, 4 * in_size * out_cols, [&](int64_t g) {
          const int64_t first = level.groups[g];
          const int64_t count = level.groups[g + 1] - first;
          const int64_t core_row = level.core_row[level.order[first]];
          auto a_buf = Scratch<Acc>(count * in_size);
          for (int64_t i = 0; i < count; ++i) {
            const int64_t parent = up.slot[level.parent[level.order[first + i]]];
            std::copy_n(parents + parent * in_size, in_size, a_buf.get() + i * in_size);
          }
          const Acc* d = d_prefix.data() + first * out_size;
          AddTransposedProduct(a_buf.get(), d, grad_block(k, core_row), count * rows, inner,
                               out_cols);
          ProductTransposed(d, cores.Row(k, core_row), contrib.data() + first * in_size,
                            count * rows, inner, out_cols);
        });
        // dP_{k-1} of each parent: its children's contributions in node
        // order (children of a parent are consecutive nodes).
        d_parent.Resize(up.count() * in_size);
        pool->ParallelFor(up.count(), 2 * in_size, [&](int64_t lo, int64_t hi) {
          for (int64_t v = lo; v < hi; ++v) {
            Acc* dst = d_parent.data() + up.slot[v] * in_size;
            const int64_t first = up.children[v];
            std::copy_n(contrib.data() + level.slot[first] * in_size, in_size, dst);
            for (int64_t node = first + 1; node < up.children[v + 1]; ++node) {
              const Acc* src = contrib.data() + level.slot[node] * in_size;
              for (int64_t i = 0; i < in_size; ++i) dst[i] += src[i];
            }
          }
        });
        d_prefix.swap(d_parent);
      }
      // Level 0: dG_0[row] = sum of dP_0 over its nodes, in node order.
      const Level& level0 = tree.levels[0];
      const int64_t width0 = s.width[0];
      ForGroups(pool, level0, width0, [&](int64_t g) {
        Acc* dst = grad_block(0, level0.core_row[level0.order[level0.groups[g]]]);
        for (int64_t i = level0.groups[g]; i < level0.groups[g + 1]; ++i) {
          const Acc* src = d_prefix.data() + i * width0;
          for (int64_t w = 0; w < width0; ++w) dst[w] += src[w];
        }
      });
    }
  }

  OpOutputList indices_out, values_out;
  TF_RETURN_IF_ERROR(ctx->output_list("core_grad_indices", &indices_out));
  TF_RETURN_IF_ERROR(ctx->output_list("core_grad_values", &values_out));
  for (int k = 0; k < T_count; ++k) {
    const int64_t count = static_cast<int64_t>(touched[k].size());
    Tensor* indices_t = nullptr;
    Tensor* values_t = nullptr;
    TF_RETURN_IF_ERROR(indices_out.allocate(k, TensorShape({count}), &indices_t));
    TF_RETURN_IF_ERROR(values_out.allocate(k, TensorShape({count, s.width[k]}), &values_t));
    std::copy(touched[k].begin(), touched[k].end(), indices_t->flat<int64_t>().data());
    T* values = values_t->flat<T>().data();
    const std::vector<Acc>& acc = core_grad[k];
    for (size_t i = 0; i < acc.size(); ++i) values[i] = static_cast<T>(acc[i]);
  }
  return OkStatus();
}

// ---------------------------------------------------------------------------
// TTCacheCount

// Which set an id belongs to: MixId (cuda/common_types.h, shared with the GPU).

// With the variables locked and of `a.size` > 0 slots (the op's checks).
Status CacheCount(OpKernelContext* ctx, const CacheCountArgs& a) {
  const int64_t size = a.size;
  TF_RETURN_IF_ERROR(EnsureExclusiveHostBuffer(ctx, a.keys));
  TF_RETURN_IF_ERROR(EnsureExclusiveHostBuffer(ctx, a.counts));
  int64_t* keys = a.keys->tensor()->flat<int64_t>().data();
  int64_t* counts = a.counts->tensor()->flat<int64_t>().data();

  const auto ids = a.ids->flat<int64_t>();
  std::vector<int64_t> sorted;
  sorted.reserve(ids.size());
  for (int64_t j = 0; j < ids.size(); ++j) {
    if (ids(j) >= 0) sorted.push_back(ids(j));
  }
  std::sort(sorted.begin(), sorted.end());

  // Sets of `ways` consecutive slots; the last one holds the remainder.
  const int64_t ways = std::min<int64_t>(32, size);
  const int64_t num_sets = (size + ways - 1) / ways;
  for (size_t i = 0; i < sorted.size();) {
    size_t end = i;
    while (end < sorted.size() && sorted[end] == sorted[i]) ++end;
    const int64_t id = sorted[i];
    const int64_t multiplicity = static_cast<int64_t>(end - i);
    i = end;
    const int64_t base =
        static_cast<int64_t>(MixId(static_cast<uint64_t>(id)) % static_cast<uint64_t>(num_sets)) *
        ways;
    const int64_t set_end = std::min(size, base + ways);
    int64_t found = -1, empty = -1, smallest = base;
    for (int64_t w = base; w < set_end; ++w) {
      if (keys[w] == id) {
        found = w;
        break;
      }
      if (keys[w] < 0) {
        if (empty < 0) empty = w;
      } else if (counts[w] < counts[smallest] || keys[smallest] < 0) {
        smallest = w;
      }
    }
    if (found >= 0) {
      counts[found] += multiplicity;
    } else if (empty >= 0) {
      keys[empty] = id;
      counts[empty] = multiplicity;
    } else {
      keys[smallest] = id;
      counts[smallest] += multiplicity;
    }
  }
  return OkStatus();
}

}  // namespace

template <typename Tindex>
struct UniqueIdsLaunch<CpuDevice, Tindex> {
  static Status Run(OpKernelContext* ctx, const UniqueIdsAttrs& attrs, const UniqueIdsArgs& a,
                    const CpuStep& step) {
    return UniqueIds<Tindex>(ctx, attrs, a, step.pool);
  }
};

template <typename T>
struct TTRowsLaunch<CpuDevice, T> {
  static constexpr int64_t kReportWords = 0;  // the ids are checked here

  static Status Run(OpKernelContext* ctx, const TTShape& shape, const TTRowsArgs& a) {
    return Rows<T>(ctx, shape, a, ctx->device()->tensorflow_cpu_worker_threads()->workers);
  }
};

template <typename T>
struct TTRowsGradLaunch<CpuDevice, T> {
  static Status Run(OpKernelContext* ctx, const TTShape& shape, const TTRowsGradArgs& a,
                    const CpuStep& step) {
    return RowsGrad<T>(ctx, shape, a, step.pool);
  }
};

template <>
struct CacheCountLaunch<CpuDevice> {
  static Status Run(OpKernelContext* ctx, const CacheCountArgs& a, const CpuStep&) {
    return CacheCount(ctx, a);
  }
};

#define REGISTER_TT_UNIQUE_IDS(Tindex)                                                   \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("TfTtemb>TTUniqueIds").Device(DEVICE_CPU).TypeConstraint<Tindex>("Tindices"), \
      TTUniqueIdsOp<CpuDevice, Tindex>);
REGISTER_TT_UNIQUE_IDS(int32_t)
REGISTER_TT_UNIQUE_IDS(int64_t)
#undef REGISTER_TT_UNIQUE_IDS

TF_TTEMB_REGISTER_TT_ROWS(DEVICE_CPU, CpuDevice)

REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTCacheCount").Device(DEVICE_CPU), TTCacheCountOp<CpuDevice>);

// An empty report (a CPU TTRows') is OK; a GPU one, copied here, raises what it holds.
REGISTER_KERNEL_BUILDER(Name("TfTtemb>CheckTTRowsReport").Device(DEVICE_CPU),
                        CheckReportCpuOp<TTRowsReportTraits>);

}  // namespace tf_ttemb
}  // namespace tensorflow
