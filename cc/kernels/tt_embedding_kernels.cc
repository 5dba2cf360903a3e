// CPU kernels of the TT embedding family and the validation shared with the
// GPU glue. See docs/tt_embedding_contract.md for the layout.
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

#include "cc/kernels/tt_embedding_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "Eigen/Core"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {

// ---------------------------------------------------------------------------
// Attributes and validation (shared with the GPU glue).

namespace {

// a * b, or an error when it exceeds 2^62 (ids and sizes stay far from
// int64 overflow).
Status CheckedMul(int64_t a, int64_t b, const char* what, int64_t* out) {
  constexpr int64_t kLimit = int64_t{1} << 62;
  if (a != 0 && b > kLimit / a) {
    return errors::InvalidArgument(what, " is too large: ", a, " * ", b,
                                   " exceeds 2^62");
  }
  *out = a * b;
  return OkStatus();
}

}  // namespace

Status GetTTShape(OpKernelConstruction* ctx, TTShape* shape) {
  std::vector<int64_t> p, q, ranks;
  int64_t num_cores;
  TF_RETURN_IF_ERROR(ctx->GetAttr("p_shapes", &p));
  TF_RETURN_IF_ERROR(ctx->GetAttr("q_shapes", &q));
  TF_RETURN_IF_ERROR(ctx->GetAttr("ranks", &ranks));
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_cores", &num_cores));
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_tables", &shape->num_tables));
  if (static_cast<int64_t>(p.size()) != num_cores ||
      static_cast<int64_t>(q.size()) != num_cores ||
      static_cast<int64_t>(ranks.size()) != num_cores - 1) {
    return errors::InvalidArgument(
        "p_shapes and q_shapes need num_cores = ", num_cores,
        " entries and ranks num_cores - 1, got ", p.size(), ", ", q.size(),
        " and ", ranks.size());
  }
  for (int k = 0; k < num_cores; ++k) {
    if (p[k] < 1) {
      return errors::InvalidArgument("p_shapes[", k, "] = ", p[k],
                                     " must be >= 1");
    }
    if (q[k] < 1) {
      return errors::InvalidArgument("q_shapes[", k, "] = ", q[k],
                                     " must be >= 1");
    }
  }
  for (int k = 0; k + 1 < num_cores; ++k) {
    if (ranks[k] < 1) {
      return errors::InvalidArgument("ranks[", k, "] = ", ranks[k],
                                     " must be >= 1");
    }
  }
  const int T = static_cast<int>(num_cores);
  shape->num_cores = T;
  shape->p = p;
  shape->q = q;
  shape->r.assign(T + 1, 1);
  for (int k = 1; k < T; ++k) shape->r[k] = ranks[k - 1];
  shape->stride.assign(T, 1);
  for (int k = T - 2; k >= 0; --k) {
    TF_RETURN_IF_ERROR(CheckedMul(shape->stride[k + 1], p[k + 1],
                                  "prod(p_shapes)", &shape->stride[k]));
  }
  TF_RETURN_IF_ERROR(CheckedMul(shape->stride[0], p[0], "prod(p_shapes)",
                                &shape->rows_per_table));
  int64_t unused;
  TF_RETURN_IF_ERROR(CheckedMul(shape->rows_per_table, shape->num_tables,
                                "num_tables * prod(p_shapes)", &unused));
  shape->width.resize(T);
  shape->cols.resize(T);
  int64_t cols = 1;
  for (int k = 0; k < T; ++k) {
    int64_t width;
    TF_RETURN_IF_ERROR(CheckedMul(shape->r[k] * q[k], shape->r[k + 1],
                                  "a core's row width", &width));
    shape->width[k] = width;
    TF_RETURN_IF_ERROR(CheckedMul(cols, q[k], "prod(q_shapes)", &cols));
    shape->cols[k] = cols;
  }
  shape->dim = cols;
  return OkStatus();
}

Status ValidateCore(const Tensor& core, int k, const TTShape& shape) {
  const int64_t rows = shape.num_tables * shape.p[k];
  if (core.dims() != 2 || core.dim_size(0) != rows ||
      core.dim_size(1) != shape.width[k]) {
    return errors::InvalidArgument(
        "cores[", k, "] must be [num_tables * p_shapes[", k, "], r_", k,
        " * q_", k, " * r_", k + 1, "] = [", rows, ", ", shape.width[k],
        "], got shape ", core.shape().DebugString());
  }
  return OkStatus();
}

Status ValidateGlobalIds(const Tensor& ids, const TTShape& shape) {
  if (ids.dims() != 1) {
    return errors::InvalidArgument("ids must be a vector [U], got shape ",
                                   ids.shape().DebugString());
  }
  const auto flat = ids.flat<int64_t>();
  const int64_t limit = shape.num_ids();
  for (int64_t j = 0; j < flat.size(); ++j) {
    if (flat(j) < 0 || flat(j) >= limit) {
      return errors::InvalidArgument("ids[", j, "] = ", flat(j),
                                     " is not in [0, ", limit, ")");
    }
  }
  return OkStatus();
}

namespace {

// Temporaries of one chunk of ids (prefix products and their gradients) stay
// under this many bytes.
constexpr int64_t kChunkBytes = int64_t{32} << 20;

template <typename Acc>
using RowMajorMatrix =
    Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
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
  int64_t count() const { return static_cast<int64_t>(parent.size()); }
  int64_t num_groups() const {
    return static_cast<int64_t>(groups.size()) - 1;
  }
};

// The prefix tree of ids[0, n): nodes are runs of consecutive ids with equal
// leading digits; leaf[j] is id j's node at the last level.
struct PrefixTree {
  std::vector<Level> levels;
  std::vector<int64_t> leaf;

  void Build(const int64_t* ids, int64_t n, const TTShape& s) {
    const int T = s.num_cores;
    levels.assign(T, Level());
    leaf.resize(n);
    std::vector<int64_t> current(T, -1);
    for (int64_t j = 0; j < n; ++j) {
      int first_new = 0;
      if (j > 0) {
        // Equal keys at level k imply equal keys at every level below it.
        while (first_new < T && s.PrefixKey(ids[j], first_new) ==
                                    s.PrefixKey(ids[j - 1], first_new)) {
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
                       [&](int64_t a, int64_t b) {
                         return level.core_row[a] < level.core_row[b];
                       });
      level.slot.resize(count);
      for (int64_t i = 0; i < count; ++i) level.slot[level.order[i]] = i;
      level.groups.clear();
      for (int64_t i = 0; i < count; ++i) {
        if (i == 0 || level.core_row[level.order[i]] !=
                          level.core_row[level.order[i - 1]]) {
          level.groups.push_back(i);
        }
      }
      level.groups.push_back(count);
    }
  }
};

// Ids per chunk so that `bytes_per_id` of temporaries per id fit kChunkBytes.
int64_t ChunkSize(int64_t bytes_per_id) {
  return std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes_per_id));
}

// Runs fn(g) for every group of `level`, spread over the pool.
template <typename Fn>
void ForGroups(thread::ThreadPool* pool, const Level& level,
               int64_t flops_per_node, Fn fn) {
  const int64_t num_groups = level.num_groups();
  if (num_groups <= 0) return;
  const int64_t cost =
      std::max<int64_t>(1, level.count() * flops_per_node / num_groups);
  pool->ParallelFor(num_groups, cost, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) fn(g);
  });
}

// Fills prefix[k] ([count_k, cols_k * r_{k+1}], node blocks at their slots)
// for k = 0..last_level.
template <typename T, typename Acc>
void ForwardLevels(thread::ThreadPool* pool, const TTShape& s,
                   const Cores<T, Acc>& cores, const PrefixTree& tree,
                   int last_level, std::vector<std::vector<Acc>>* prefix) {
  prefix->resize(last_level + 1);
  {
    const Level& level = tree.levels[0];
    std::vector<Acc>& out = (*prefix)[0];
    const int64_t width = s.width[0];
    out.resize(level.count() * width);
    for (int64_t i = 0; i < level.count(); ++i) {
      std::copy_n(cores.Row(0, level.core_row[level.order[i]]), width,
                  out.data() + i * width);
    }
  }
  for (int k = 1; k <= last_level; ++k) {
    const Level& level = tree.levels[k];
    const Level& up = tree.levels[k - 1];
    const int64_t rows = s.cols[k - 1];         // rows of one node's block
    const int64_t inner = s.r[k];               // contracted rank
    const int64_t out_cols = s.q[k] * s.r[k + 1];
    const int64_t in_size = rows * inner;
    const int64_t out_size = rows * out_cols;
    const std::vector<Acc>& in = (*prefix)[k - 1];
    std::vector<Acc>& out = (*prefix)[k];
    out.resize(level.count() * out_size);
    ForGroups(pool, level, 2 * in_size * out_cols, [&](int64_t g) {
      const int64_t first = level.groups[g];
      const int64_t n = level.groups[g + 1] - first;
      const ConstMatrixMap<Acc> core(
          cores.Row(k, level.core_row[level.order[first]]), inner, out_cols);
      MatrixMap<Acc> c(out.data() + first * out_size, n * rows, out_cols);
      if (n == 1) {
        const int64_t parent = up.slot[level.parent[level.order[first]]];
        const ConstMatrixMap<Acc> a(in.data() + parent * in_size, rows, inner);
        c.noalias() = a * core;
        return;
      }
      std::vector<Acc> a_buf(n * in_size);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t parent = up.slot[level.parent[level.order[first + i]]];
        std::copy_n(in.data() + parent * in_size, in_size,
                    a_buf.data() + i * in_size);
      }
      const ConstMatrixMap<Acc> a(a_buf.data(), n * rows, inner);
      c.noalias() = a * core;
    });
  }
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

Status TableSplitsError(int64_t position, int64_t value, const char* rule) {
  return errors::InvalidArgument("table_splits[", position, "] = ", value,
                                 " ", rule);
}

template <typename Tindex>
class TTUniqueIdsOp : public OpKernel {
 public:
  explicit TTUniqueIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_embeddings", &num_embeddings_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stride", &stride_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("padding_id", &attrs_.padding_id));
    OP_REQUIRES_OK(ctx,
                   ctx->GetAttr("has_padding_id", &attrs_.has_padding_id));
    OP_REQUIRES(ctx, stride_ >= num_embeddings_,
                errors::InvalidArgument("stride (", stride_,
                                        ") must be >= num_embeddings (",
                                        num_embeddings_, ")"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_t = ctx->input(0);
    const Tensor& splits_t = ctx->input(1);
    OP_REQUIRES(ctx, ids_t.dims() == 1,
                errors::InvalidArgument("ids must be a vector [nnz], got shape ",
                                        ids_t.shape().DebugString()));
    OP_REQUIRES(ctx, splits_t.dims() == 1 && splits_t.NumElements() >= 2,
                errors::InvalidArgument(
                    "table_splits must be a vector [num_tables + 1] with at "
                    "least 2 elements, got shape ",
                    splits_t.shape().DebugString()));
    const auto ids = ids_t.flat<Tindex>();
    const auto splits = splits_t.flat<int64_t>();
    const int64_t nnz = ids.size();
    const int64_t num_tables = splits.size() - 1;
    OP_REQUIRES(ctx, splits(0) == 0,
                TableSplitsError(0, splits(0), "must be 0"));
    for (int64_t t = 0; t < num_tables; ++t) {
      OP_REQUIRES(ctx, splits(t + 1) >= splits(t),
                  TableSplitsError(t + 1, splits(t + 1),
                                   "must be >= the previous split"));
    }
    OP_REQUIRES(ctx, splits(num_tables) == nnz,
                TableSplitsError(num_tables, splits(num_tables),
                                 "must equal the number of ids"));
    int64_t unused;
    OP_REQUIRES_OK(ctx, CheckedMul(num_tables, stride_,
                                   "num_tables * stride", &unused));

    // Global id of every entry, -1 for padding; the first bad id fails.
    std::vector<int64_t> global(nnz);
    for (int64_t t = 0; t < num_tables; ++t) {
      for (int64_t j = splits(t); j < splits(t + 1); ++j) {
        const int64_t id = static_cast<int64_t>(ids(j));
        if (IsPadding(ids(j), attrs_)) {
          global[j] = -1;
          continue;
        }
        OP_REQUIRES(ctx, id >= 0 && id < num_embeddings_,
                    BadIndexError(j, id, num_embeddings_, attrs_));
        global[j] = t * stride_ + id;
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
    Tensor* slots_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(sorted.size())}),
                            &unique_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, ids_t.shape(), &slots_t));
    std::copy(sorted.begin(), sorted.end(), unique_t->flat<int64_t>().data());
    Tindex* slots = slots_t->flat<Tindex>().data();
    auto assign = [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        slots[j] = global[j] < 0
                       ? Tindex(-1)
                       : static_cast<Tindex>(
                             std::lower_bound(sorted.begin(), sorted.end(),
                                              global[j]) -
                             sorted.begin());
      }
    };
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        nnz, 40, assign);
  }

 private:
  int64_t num_embeddings_ = 1;
  int64_t stride_ = 1;
  BagAttrs attrs_;
};

// ---------------------------------------------------------------------------
// TTRows

template <typename T>
class TTRowsOp : public OpKernel {
 public:
  using Acc = typename AccumulatorType<T>::type;

  explicit TTRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetTTShape(ctx, &shape_));
  }

  void Compute(OpKernelContext* ctx) override {
    const TTShape& s = shape_;
    const Tensor& ids_t = ctx->input(0);
    OpInputList cores_in;
    OP_REQUIRES_OK(ctx, ctx->input_list("cores", &cores_in));
    for (int k = 0; k < s.num_cores; ++k) {
      OP_REQUIRES_OK(ctx, ValidateCore(cores_in[k], k, s));
    }
    OP_REQUIRES_OK(ctx, ValidateGlobalIds(ids_t, s));
    const int64_t num_ids = ids_t.NumElements();
    Tensor* rows_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_ids, s.dim}),
                                             &rows_t));
    if (num_ids == 0) return;
    const int64_t* ids = ids_t.flat<int64_t>().data();
    T* rows = rows_t->flat<T>().data();
    thread::ThreadPool* pool =
        ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const Cores<T, Acc> cores(cores_in, s);
    const int T_last = s.num_cores - 1;
    const int64_t chunk = ChunkSize(BytesPerId(s, sizeof(Acc), false));
    PrefixTree tree;
    std::vector<std::vector<Acc>> prefix;
    for (int64_t begin = 0; begin < num_ids; begin += chunk) {
      const int64_t n = std::min(chunk, num_ids - begin);
      tree.Build(ids + begin, n, s);
      ForwardLevels(pool, s, cores, tree, T_last, &prefix);
      const std::vector<Acc>& last = prefix[T_last];
      const int64_t dim = s.dim;
      pool->ParallelFor(n, dim, [&](int64_t first, int64_t end) {
        for (int64_t j = first; j < end; ++j) {
          const Acc* src =
              last.data() + tree.levels[T_last].slot[tree.leaf[j]] * dim;
          T* dst = rows + (begin + j) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(src[d]);
        }
      });
    }
  }

 private:
  TTShape shape_;
};

// ---------------------------------------------------------------------------
// TTRowsGrad

template <typename T>
class TTRowsGradOp : public OpKernel {
 public:
  using Acc = typename AccumulatorType<T>::type;

  explicit TTRowsGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, GetTTShape(ctx, &shape_));
  }

  void Compute(OpKernelContext* ctx) override {
    const TTShape& s = shape_;
    const int T_count = s.num_cores;
    const Tensor& ids_t = ctx->input(0);
    OpInputList cores_in;
    OP_REQUIRES_OK(ctx, ctx->input_list("cores", &cores_in));
    for (int k = 0; k < T_count; ++k) {
      OP_REQUIRES_OK(ctx, ValidateCore(cores_in[k], k, s));
    }
    OP_REQUIRES_OK(ctx, ValidateGlobalIds(ids_t, s));
    const Tensor& grad_t = ctx->input(1 + T_count);
    const int64_t num_ids = ids_t.NumElements();
    OP_REQUIRES(ctx,
                grad_t.dims() == 2 && grad_t.dim_size(0) == num_ids &&
                    grad_t.dim_size(1) == s.dim,
                errors::InvalidArgument("grad must be [", num_ids, ", ", s.dim,
                                        "] like the rows, got shape ",
                                        grad_t.shape().DebugString()));
    const int64_t* ids = ids_t.flat<int64_t>().data();
    const T* grad = grad_t.flat<T>().data();
    thread::ThreadPool* pool =
        ctx->device()->tensorflow_cpu_worker_threads()->workers;

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
      const int64_t slot =
          std::lower_bound(rows.begin(), rows.end(), core_row) - rows.begin();
      return core_grad[k].data() + slot * s.width[k];
    };

    if (num_ids > 0) {
      const Cores<T, Acc> cores(cores_in, s);
      const int64_t chunk = ChunkSize(BytesPerId(s, sizeof(Acc), true));
      PrefixTree tree;
      std::vector<std::vector<Acc>> prefix;
      std::vector<Acc> d_prefix, d_parent, contrib;
      for (int64_t begin = 0; begin < num_ids; begin += chunk) {
        const int64_t n = std::min(chunk, num_ids - begin);
        tree.Build(ids + begin, n, s);
        ForwardLevels(pool, s, cores, tree, T_count - 2, &prefix);

        // dP_{T-1} per leaf: the grad rows of its ids, in id order.
        const int64_t dim = s.dim;
        const Level& leaves = tree.levels[T_count - 1];
        d_prefix.assign(leaves.count() * dim, Acc(0));
        for (int64_t j = 0; j < n; ++j) {
          Acc* dst = d_prefix.data() + leaves.slot[tree.leaf[j]] * dim;
          const T* src = grad + (begin + j) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] += static_cast<Acc>(src[d]);
        }

        for (int k = T_count - 1; k >= 1; --k) {
          const Level& level = tree.levels[k];
          const Level& up = tree.levels[k - 1];
          const int64_t rows = s.cols[k - 1];
          const int64_t inner = s.r[k];
          const int64_t out_cols = s.q[k] * s.r[k + 1];
          const int64_t in_size = rows * inner;
          const int64_t out_size = rows * out_cols;
          const std::vector<Acc>& parents = prefix[k - 1];
          contrib.resize(level.count() * in_size);
          ForGroups(pool, level, 4 * in_size * out_cols, [&](int64_t g) {
            const int64_t first = level.groups[g];
            const int64_t count = level.groups[g + 1] - first;
            const int64_t core_row = level.core_row[level.order[first]];
            std::vector<Acc> a_buf(count * in_size);
            for (int64_t i = 0; i < count; ++i) {
              const int64_t parent =
                  up.slot[level.parent[level.order[first + i]]];
              std::copy_n(parents.data() + parent * in_size, in_size,
                          a_buf.data() + i * in_size);
            }
            const ConstMatrixMap<Acc> a(a_buf.data(), count * rows, inner);
            const ConstMatrixMap<Acc> d(d_prefix.data() + first * out_size,
                                        count * rows, out_cols);
            MatrixMap<Acc> g_core(grad_block(k, core_row), inner, out_cols);
            g_core.noalias() += a.transpose() * d;
            const ConstMatrixMap<Acc> core(cores.Row(k, core_row), inner,
                                           out_cols);
            MatrixMap<Acc> c(contrib.data() + first * in_size, count * rows,
                             inner);
            c.noalias() = d * core.transpose();
          });
          // dP_{k-1} of each parent: its children's contributions in node
          // order (children of a parent are consecutive nodes).
          d_parent.assign(up.count() * in_size, Acc(0));
          for (int64_t node = 0; node < level.count(); ++node) {
            Acc* dst = d_parent.data() + up.slot[level.parent[node]] * in_size;
            const Acc* src = contrib.data() + level.slot[node] * in_size;
            for (int64_t i = 0; i < in_size; ++i) dst[i] += src[i];
          }
          d_prefix.swap(d_parent);
        }
        // Level 0: dG_0[row] = sum of dP_0 over its nodes, in node order.
        const Level& level0 = tree.levels[0];
        const int64_t width0 = s.width[0];
        for (int64_t g = 0; g < level0.num_groups(); ++g) {
          Acc* dst =
              grad_block(0, level0.core_row[level0.order[level0.groups[g]]]);
          for (int64_t i = level0.groups[g]; i < level0.groups[g + 1]; ++i) {
            const Acc* src = d_prefix.data() + i * width0;
            for (int64_t w = 0; w < width0; ++w) dst[w] += src[w];
          }
        }
      }
    }

    OpOutputList indices_out, values_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("core_grad_indices", &indices_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("core_grad_values", &values_out));
    for (int k = 0; k < T_count; ++k) {
      const int64_t count = static_cast<int64_t>(touched[k].size());
      Tensor* indices_t = nullptr;
      Tensor* values_t = nullptr;
      OP_REQUIRES_OK(ctx, indices_out.allocate(k, TensorShape({count}),
                                               &indices_t));
      OP_REQUIRES_OK(ctx, values_out.allocate(
                              k, TensorShape({count, s.width[k]}), &values_t));
      std::copy(touched[k].begin(), touched[k].end(),
                indices_t->flat<int64_t>().data());
      T* values = values_t->flat<T>().data();
      const std::vector<Acc>& acc = core_grad[k];
      for (size_t i = 0; i < acc.size(); ++i) values[i] = static_cast<T>(acc[i]);
    }
  }

 private:
  TTShape shape_;
};

// ---------------------------------------------------------------------------
// TTCacheCount

// Makes the variable's buffer exclusively owned before an in-place update (a
// tensor read from it earlier may still share it).
Status EnsureExclusive(OpKernelContext* ctx, Var* var) {
  Tensor* tensor = var->tensor();
  if (tensor->RefCountIsOne()) return OkStatus();
  Tensor copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy));
  std::memcpy(copy.data(), tensor->data(), tensor->TotalBytes());
  *tensor = copy;
  return OkStatus();
}

Status LookupInt64Vector(OpKernelContext* ctx, int input, const char* name,
                         core::RefCountPtr<Var>* var) {
  TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input), var));
  const Tensor* t = (*var)->tensor();
  if (t->dtype() != DT_INT64 || t->dims() != 1) {
    return errors::InvalidArgument(name, " must be an int64 vector variable, got ",
                                   DataTypeString(t->dtype()), " ",
                                   t->shape().DebugString());
  }
  if (!(*var)->is_initialized) {
    return errors::FailedPrecondition(name, " variable is not initialized");
  }
  return OkStatus();
}

// Fixed 64-bit mixer (splitmix64's finaliser): which set an id belongs to.
inline uint64_t MixId(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

class TTCacheCountOp : public OpKernel {
 public:
  explicit TTCacheCountOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_t = ctx->input(2);
    OP_REQUIRES(ctx, ids_t.dims() == 1,
                errors::InvalidArgument("ids must be a vector, got shape ",
                                        ids_t.shape().DebugString()));
    core::RefCountPtr<Var> keys_var, counts_var;
    OP_REQUIRES_OK(ctx, LookupInt64Vector(ctx, 0, "keys", &keys_var));
    OP_REQUIRES_OK(ctx, LookupInt64Vector(ctx, 1, "counts", &counts_var));
    OP_REQUIRES(ctx, keys_var.get() != counts_var.get(),
                errors::InvalidArgument("keys and counts must be different "
                                        "variables"));
    mutex_lock keys_lock(*keys_var->mu());
    mutex_lock counts_lock(*counts_var->mu());
    const int64_t size = keys_var->tensor()->NumElements();
    OP_REQUIRES(ctx, counts_var->tensor()->NumElements() == size,
                errors::InvalidArgument(
                    "keys and counts must have the same size, got ", size,
                    " and ", counts_var->tensor()->NumElements()));
    if (size == 0) return;
    OP_REQUIRES_OK(ctx, EnsureExclusive(ctx, keys_var.get()));
    OP_REQUIRES_OK(ctx, EnsureExclusive(ctx, counts_var.get()));
    int64_t* keys = keys_var->tensor()->flat<int64_t>().data();
    int64_t* counts = counts_var->tensor()->flat<int64_t>().data();

    const auto ids = ids_t.flat<int64_t>();
    std::vector<int64_t> sorted;
    sorted.reserve(ids.size());
    for (int64_t j = 0; j < ids.size(); ++j) {
      if (ids(j) >= 0) sorted.push_back(ids(j));
    }
    std::sort(sorted.begin(), sorted.end());

    const int64_t ways = std::min<int64_t>(32, size);
    const int64_t num_sets = size / ways;
    for (size_t i = 0; i < sorted.size();) {
      size_t end = i;
      while (end < sorted.size() && sorted[end] == sorted[i]) ++end;
      const int64_t id = sorted[i];
      const int64_t multiplicity = static_cast<int64_t>(end - i);
      i = end;
      const int64_t base =
          static_cast<int64_t>(MixId(static_cast<uint64_t>(id)) %
                               static_cast<uint64_t>(num_sets)) *
          ways;
      int64_t found = -1, empty = -1, smallest = base;
      for (int64_t w = base; w < base + ways; ++w) {
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
  }
};

}  // namespace

#define REGISTER_TT_UNIQUE_IDS(Tindex)                                \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTUniqueIds")                 \
                              .Device(DEVICE_CPU)                     \
                              .TypeConstraint<Tindex>("Tindices"),    \
                          TTUniqueIdsOp<Tindex>);
REGISTER_TT_UNIQUE_IDS(int32_t)
REGISTER_TT_UNIQUE_IDS(int64_t)
#undef REGISTER_TT_UNIQUE_IDS

#define REGISTER_TT_ROWS(T)                                                   \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("TfTtemb>TTRows").Device(DEVICE_CPU).TypeConstraint<T>("T"),       \
      TTRowsOp<T>);                                                           \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("TfTtemb>TTRowsGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),   \
      TTRowsGradOp<T>);
REGISTER_TT_ROWS(Eigen::half)
REGISTER_TT_ROWS(Eigen::bfloat16)
REGISTER_TT_ROWS(float)
REGISTER_TT_ROWS(double)
#undef REGISTER_TT_ROWS

REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTCacheCount").Device(DEVICE_CPU),
                        TTCacheCountOp);

}  // namespace tf_ttemb
}  // namespace tensorflow
