// TTRowsGrad's and TTRowsBagsGrad's CPU kernels: the TT cores' gradients,
// walking TTRows' prefix tree from the leaves up (the plan is in
// tt_embedding_cpu.h), from the rows' gradient [U, D] or from the bags' output
// gradient [B, D] (IdGrads).

#include "cc/kernels/gather_reduce_sum_backward_cpu.h"
#include "cc/kernels/tt_embedding_cpu.h"

namespace tensorflow {
namespace tf_ttemb {
namespace tt_cpu {
namespace {

// The core gradients: per core the sorted rows that any id touches and their
// [n_k, width_k] blocks. The first group to reach a row writes its block and
// later ones (of later chunks) add to it, so nothing needs zeroing; a row's
// group is handled by one worker, and each core's rows by one pass.
template <typename Acc>
class CoreGrads {
 public:
  CoreGrads(const int64_t* ids, int64_t n, const TTShape& s)
      : rows_(s.num_cores), written_(s.num_cores), values_(s.num_cores), width_(s.width) {
    for (int k = 0; k < s.num_cores; ++k) {
      std::vector<int64_t>& rows = rows_[k];
      const int64_t range = s.num_tables * s.p[k];
      if (range <= 4 * n + 4096) {
        std::vector<char> seen(range, 0);
        for (int64_t j = 0; j < n; ++j) seen[s.CoreRow(ids[j], k)] = 1;
        for (int64_t row = 0; row < range; ++row) {
          if (seen[row]) rows.push_back(row);
        }
      } else {
        rows.resize(n);
        for (int64_t j = 0; j < n; ++j) rows[j] = s.CoreRow(ids[j], k);
        std::sort(rows.begin(), rows.end());
        rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
      }
      written_[k].assign(rows.size(), 0);
    }
  }
  // The same from the tree of all the ids (one chunk): level k's groups.
  CoreGrads(const PrefixTree& tree, const TTShape& s)
      : rows_(s.num_cores), written_(s.num_cores), values_(s.num_cores), width_(s.width) {
    for (int k = 0; k < s.num_cores; ++k) {
      const Level& level = tree.levels[k];
      for (int64_t g = 0; g < level.num_groups(); ++g) rows_[k].push_back(level.GroupRow(g));
      written_[k].assign(rows_[k].size(), 0);
    }
  }
  const std::vector<int64_t>& rows(int k) const { return rows_[k]; }
  int64_t count(int k) const { return static_cast<int64_t>(rows_[k].size()); }
  void set_values(int k, Acc* values) { values_[k] = values; }

  // Core k's block of `row`; *accumulate says whether a group wrote it before.
  Acc* Block(int k, int64_t row, bool* accumulate) {
    const std::vector<int64_t>& rows = rows_[k];
    const int64_t i = std::lower_bound(rows.begin(), rows.end(), row) - rows.begin();
    *accumulate = written_[k][i] != 0;
    written_[k][i] = 1;
    return values_[k] + i * width_[k];
  }

 private:
  std::vector<std::vector<int64_t>> rows_;
  std::vector<std::vector<char>> written_;
  std::vector<Acc*> values_;
  std::vector<int64_t> width_;
};

// dst (+)= src, n elements.
template <typename Acc>
void AddTo(const Acc* src, int64_t n, bool accumulate, Acc* dst) {
  if (accumulate) {
    for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
  } else {
    std::copy_n(src, n, dst);
  }
}

// For the nodes of a level-k group (k >= 1) at slots [first, end), with their
// dP_k in d (slot order): adds P_{k-1}^T dP_k over the nodes to the core
// row's gradient `block` and writes each node's contribution dP_k G_k^T to its
// parent's dP_{k-1} into contrib (at its node number, so that a parent's
// children's contributions are one block). gt = G_k[row]^T.
template <typename T, typename Acc>
void GroupGradients(const Chunk<T, Acc>& c, int k, int64_t first, int64_t end, const Acc* d,
                    const Acc* gt, Acc* block, bool accumulate, Acc* contrib, Scratch<Acc>* sc) {
  const TTShape& s = c.s;
  const Level& level = c.tree().levels[k];
  const int64_t rows = s.cols[k - 1];
  const int64_t inner = s.r[k];
  const int64_t width = s.q[k] * s.r[k + 1];
  sc->a_rows.clear();
  sc->d_rows.clear();
  sc->c_rows.clear();
  for (int64_t i = first; i < end; ++i) {
    PushRows(c.Node(k - 1, level.parent[level.order[i]]), rows, inner, &sc->a_rows);
    PushRows(d + (i - first) * c.Size(k), rows, width, &sc->d_rows);
    PushRows(contrib + level.order[i] * rows * inner, rows, inner, &sc->c_rows);
  }
  const int64_t total = static_cast<int64_t>(sc->a_rows.size());
  if (accumulate) {
    tt_math::TransposedRowsTimesRows<true>(sc->a_rows.data(), inner, sc->d_rows.data(), width,
                                           total, block);
  } else {
    tt_math::TransposedRowsTimesRows<false>(sc->a_rows.data(), inner, sc->d_rows.data(), width,
                                            total, block);
  }
  tt_math::RowsTimes<false>(sc->d_rows.data(), total, width, gt, inner, sc->c_rows.data());
}

// G_k[row]^T, [q_k r_{k+1}, r_k], in the worker's scratch.
template <typename T, typename Acc>
const Acc* TransposedCoreRow(const Chunk<T, Acc>& c, int k, int64_t row, Scratch<Acc>* sc) {
  const int64_t width = c.s.width[k];
  Acc* out = sc->transposed.Resize(width);
  tt_math::Transpose(c.cores.Row(k, row), c.s.r[k], width / c.s.r[k], out);
  return out;
}

// Where the leaves' gradient rows come from: TTRowsGrad's grad [U, D], a row
// per id, or TTRowsBagsGrad's bags, whose entries PrepareParamsGrad sorted by
// slot: an id's row is then the sum over its entries of coef * the bag's
// output gradient row, in the order GatherReduceSumDenseGrad sums it, summed
// here where the leaf needs it instead of written to [U, D] and read back.
// Ids count from the chunk's first (From).
template <typename T, typename Acc>
class IdGrads {
 public:
  IdGrads(const T* rows, int64_t dim) : rows_(rows), dim_(dim) {}
  // starts [U + 1]: id j's sorted entries are [starts[j], starts[j + 1]).
  IdGrads(const T* bag_grad, const SortedEntries* sorted, const Acc* coef, const int64_t* starts,
          int64_t dim)
      : bag_grad_(bag_grad), bags_(sorted->bags.data()), coef_(coef), starts_(starts), dim_(dim) {}

  IdGrads From(int64_t begin) const {
    IdGrads chunk = *this;
    chunk.begin_ += begin;
    return chunk;
  }

  // Fetches id j's row, or its first entry's row of the bags' gradient (the
  // loads of starts and bags go round the memory system here for all of a
  // batch's leaves at once, not one leaf after another in Sum).
  void Prefetch(int64_t j) const {
    j += begin_;
    if (rows_ != nullptr) {
      PrefetchRow(rows_ + j * dim_, dim_);
      return;
    }
    const int64_t k = starts_[j];
    if (k < starts_[j + 1]) PrefetchRow(bag_grad_ + bags_[k] * dim_, dim_);
  }

  // The gradient row of ids [first, end) summed: in place where it is one
  // row of Acc, else in `sum_buffer`.
  const Acc* Sum(int64_t first, int64_t end, Buffer<Acc>* sum_buffer) const {
    first += begin_;
    end += begin_;
    if constexpr (std::is_same<T, Acc>::value) {
      if (rows_ != nullptr && end - first == 1) return rows_ + first * dim_;
    }
    Acc* sum = sum_buffer->Resize(dim_);
    std::fill_n(sum, dim_, Acc(0));
    for (int64_t j = first; j < end; ++j) {
      if (rows_ != nullptr) {
        for (int64_t e = 0; e < dim_; ++e) sum[e] += static_cast<Acc>(rows_[j * dim_ + e]);
        continue;
      }
      for (int64_t k = starts_[j]; k < starts_[j + 1]; ++k) {
        Axpy(sum, coef_[k], bag_grad_ + bags_[k] * dim_, dim_);
      }
    }
    return sum;
  }

 private:
  const T* rows_ = nullptr;
  const T* bag_grad_ = nullptr;
  const int64_t* bags_ = nullptr;  // [M] the bag of each sorted entry
  const Acc* coef_ = nullptr;      // [M] its coefficient
  const int64_t* starts_ = nullptr;
  int64_t dim_ = 0;
  int64_t begin_ = 0;
};

// Level m's pass (the file comment): dP_m per node from its leaves, the
// leaves' blocks of core T-1's gradient (into leaf_grads as [q_{T-1},
// r_{T-1}], each at its leaf's slot, so that the last pass reads each core
// row's blocks in one run), core m's gradient and the nodes' contributions
// to their parents (contrib, for m >= 1). The level's products are
// recomputed, a batch at a time.
template <typename T, typename Acc>
void FusedBackward(thread::ThreadPool* pool, const Chunk<T, Acc>& c, const IdGrads<T, Acc>& grad,
                   Acc* contrib, Acc* leaf_grads, CoreGrads<Acc>* grads) {
  const int m = c.fused();
  const Level& level = c.tree().levels[m];
  const Level& leaves = c.tree().levels[m + 1];
  const std::array<int64_t, 5> sizes = c.FusedSizes();
  const int64_t size = sizes[0], rows_m = sizes[1], rank = sizes[2], q = sizes[3], dim = sizes[4];
  const int64_t leaf_width = rank * q;
  const double node_cost = m > 0 ? 3 * c.NodeCost(m) : 0;
  const double leaf_cost = static_cast<double>(2 * dim * rank);
  const int64_t batch = BatchNodes(c.s, m);
  RunClaimed<Scratch<Acc>>(
      pool, level.num_groups(),
      [&](int64_t g) { return c.FusedGroupCost(g, node_cost, leaf_cost); },
      [&](Scratch<Acc>* sc, int64_t g) {
        const int64_t row = level.GroupRow(g);
        const Acc* gt = m > 0 ? TransposedCoreRow(c, m, row, sc) : nullptr;
        bool accumulate;
        Acc* block = grads->Block(m, row, &accumulate);
        const int64_t end = level.groups[g + 1];
        for (int64_t i = level.groups[g]; i < end; i += batch) {
          const int64_t stop = std::min(end, i + batch);
          c.PrefetchLeaves(i, stop, [&](int64_t j) { grad.Prefetch(j); }, leaf_grads);
          Acc* products = nullptr;
          if (m > 0) {
            products = sc->products.Resize(batch * size);
            c.Products(m, i, stop, products, sc);
          }
          Acc* d = sc->grads.Resize(batch * size);
          for (int64_t slot = i; slot < stop; ++slot) {
            const int64_t v = level.order[slot];
            const Acc* p = m > 0 ? products + (slot - i) * size : c.Node(0, v);
            Acc* dv = d + (slot - i) * size;
            for (int64_t leaf = level.children[v]; leaf < level.children[v + 1]; ++leaf) {
              // dP of the leaf: the gradient row of its id (of its ids,
              // where ids repeat).
              const Acc* dp =
                  grad.Sum(c.tree().leaf_ids[leaf], c.tree().leaf_ids[leaf + 1], &sc->leaf);
              tt_math::LeafGradients(dp, rows_m, q, c.LastTransposed(leaf), p, rank,
                                     leaf > level.children[v], dv,
                                     leaf_grads + leaves.slot[leaf] * leaf_width);
            }
          }
          if (m > 0) {
            GroupGradients(c, m, i, stop, d, gt, block, accumulate || i > level.groups[g], contrib,
                           sc);
          } else {
            for (int64_t slot = i; slot < stop; ++slot) {
              AddTo(d + (slot - i) * size, size, accumulate || slot > level.groups[g], block);
            }
          }
        }
      });
}

// Level k's pass, 1 <= k < m: dP_k per node from its children's
// contributions (next), then core k's gradient and the nodes' contributions.
template <typename T, typename Acc>
void LevelBackward(thread::ThreadPool* pool, const Chunk<T, Acc>& c, int k, const Acc* next,
                   Acc* contrib, CoreGrads<Acc>* grads) {
  const Level& level = c.tree().levels[k];
  const int64_t size = c.Size(k);
  const int64_t batch = BatchNodes(c.s, k);
  RunClaimed<Scratch<Acc>>(
      pool, level.num_groups(), [&](int64_t g) { return level.GroupSize(g) * 2 * c.NodeCost(k); },
      [&](Scratch<Acc>* sc, int64_t g) {
        const int64_t row = level.GroupRow(g);
        const Acc* gt = TransposedCoreRow(c, k, row, sc);
        bool accumulate;
        Acc* block = grads->Block(k, row, &accumulate);
        const int64_t end = level.groups[g + 1];
        for (int64_t i = level.groups[g]; i < end; i += batch) {
          const int64_t stop = std::min(end, i + batch);
          Acc* d = sc->grads.Resize(batch * size);
          for (int64_t slot = i; slot < stop; ++slot) {
            const int64_t v = level.order[slot];
            Acc* dv = d + (slot - i) * size;
            for (int64_t w = level.children[v]; w < level.children[v + 1]; ++w) {
              AddTo(next + w * size, size, w > level.children[v], dv);
            }
          }
          GroupGradients(c, k, i, stop, d, gt, block, accumulate || i > level.groups[g], contrib,
                         sc);
        }
      });
}

// The last pass: core 0's gradient from level 1's contributions (next; when
// m >= 1, else level m's pass made it) and core T-1's from the leaves' blocks
// (each core row's blocks are one run of leaf_grads).
template <typename T, typename Acc>
void LastBackward(thread::ThreadPool* pool, const Chunk<T, Acc>& c, const Acc* next,
                  const Acc* leaf_grads, CoreGrads<Acc>* grads) {
  const TTShape& s = c.s;
  const int last = s.num_cores - 1;
  const Level& roots = c.tree().levels[0];
  const Level& leaves = c.tree().levels[last];
  const int64_t num_roots = c.fused() > 0 ? roots.num_groups() : 0;
  const int64_t width0 = s.width[0];
  const int64_t rank = s.r[last];
  const int64_t q = s.q[last];
  const int64_t leaf_width = s.width[last];
  RunClaimed<Scratch<Acc>>(
      pool, num_roots + leaves.num_groups(),
      [&](int64_t item) {
        return item < num_roots ? roots.GroupSize(item) * width0
                                : leaves.GroupSize(item - num_roots) * leaf_width;
      },
      [&](Scratch<Acc>* sc, int64_t item) {
        bool accumulate;
        if (item < num_roots) {
          Acc* block = grads->Block(0, roots.GroupRow(item), &accumulate);
          for (int64_t i = roots.groups[item]; i < roots.groups[item + 1]; ++i) {
            const int64_t v = roots.order[i];
            for (int64_t w = roots.children[v]; w < roots.children[v + 1]; ++w) {
              AddTo(next + w * width0, width0, accumulate, block);
              accumulate = true;
            }
          }
          return;
        }
        const int64_t g = item - num_roots;
        Acc* sum = sc->leaf.Resize(leaf_width);
        const int64_t end = leaves.groups[g + 1];
        for (int64_t i = leaves.groups[g]; i < end; ++i) {
          AddTo(leaf_grads + i * leaf_width, leaf_width, i > leaves.groups[g], sum);
        }
        Acc* block = grads->Block(last, leaves.GroupRow(g), &accumulate);
        for (int64_t x = 0; x < rank; ++x) {
          for (int64_t j = 0; j < q; ++j) {
            const Acc value = sum[j * rank + x];
            block[x * q + j] = accumulate ? block[x * q + j] + value : value;
          }
        }
      });
}

// The cores' gradients of the rows of ids [num_ids] (checked) whose
// gradient `grad` gives: TTRowsGrad's and TTRowsBagsGrad's outputs.
template <typename T>
Status CoreGradients(OpKernelContext* ctx, const TTShape& s, const RowsArgs& a,
                     const IdGrads<T, AccT<T>>& grad, thread::ThreadPool* pool) {
  using Acc = AccT<T>;
  const int T_count = s.num_cores;
  const int m = T_count - 2;
  const int64_t num_ids = a.num_ids;
  const int64_t* ids = a.ids->flat<int64_t>().data();
  const int64_t chunk = ChunkSize(BytesPerId(s, sizeof(Acc)));
  // One chunk (the usual case): its tree first (TTRows' when it built it for
  // these ids), which lists the touched core rows.
  const Cores<T, Acc> cores(a.cores, s);
  Chunk<T, Acc> c(s, cores);
  const bool one_chunk = num_ids > 0 && num_ids <= chunk;
  if (one_chunk) c.Build(pool, ids, num_ids, Chunk<T, Acc>::Tree::kReuse);

  // The outputs: core k's touched rows and their gradients, accumulated in
  // place for float32/float64 and in float copies for the half types.
  CoreGrads<Acc> grads = one_chunk ? CoreGrads<Acc>(c.tree(), s) : CoreGrads<Acc>(ids, num_ids, s);
  OpOutputList indices_out, values_out;
  TF_RETURN_IF_ERROR(ctx->output_list("core_grad_indices", &indices_out));
  TF_RETURN_IF_ERROR(ctx->output_list("core_grad_values", &values_out));
  std::vector<T*> values(T_count);
  std::vector<std::unique_ptr<Acc[]>> copies(T_count);
  for (int k = 0; k < T_count; ++k) {
    const int64_t count = grads.count(k);
    Tensor* indices_t = nullptr;
    Tensor* values_t = nullptr;
    TF_RETURN_IF_ERROR(indices_out.allocate(k, TensorShape({count}), &indices_t));
    TF_RETURN_IF_ERROR(values_out.allocate(k, TensorShape({count, s.width[k]}), &values_t));
    std::copy(grads.rows(k).begin(), grads.rows(k).end(), indices_t->flat<int64_t>().data());
    values[k] = values_t->flat<T>().data();
    if constexpr (std::is_same<T, Acc>::value) {
      grads.set_values(k, values[k]);
    } else {
      copies[k].reset(new Acc[count * s.width[k]]);
      grads.set_values(k, copies[k].get());
    }
  }

  if (num_ids > 0) {
    // Contributions of each level k in 1..m to the level below, at the nodes'
    // numbers.
    std::vector<Buffer<Acc>> contrib(T_count);
    Buffer<Acc> leaf_grads;
    for (int64_t begin = 0; begin < num_ids; begin += chunk) {
      const int64_t n = std::min(chunk, num_ids - begin);
      if (!one_chunk) c.Build(pool, ids + begin, n, Chunk<T, Acc>::Tree::kBuild);
      c.ForwardLevels(pool, m - 1);
      for (int k = 1; k <= m; ++k) {
        contrib[k].Resize(c.tree().levels[k].count() * s.cols[k - 1] * s.r[k]);
      }
      leaf_grads.Resize(c.tree().levels[m + 1].count() * s.width[m + 1]);
      FusedBackward(pool, c, grad.From(begin), contrib[m].data(), leaf_grads.data(), &grads);
      for (int k = m - 1; k >= 1; --k) {
        LevelBackward(pool, c, k, contrib[k + 1].data(), contrib[k].data(), &grads);
      }
      LastBackward(pool, c, m > 0 ? contrib[1].data() : nullptr, leaf_grads.data(), &grads);
    }
  }

  if constexpr (!std::is_same<T, Acc>::value) {
    for (int k = 0; k < T_count; ++k) {
      StoreRow(values[k], copies[k].get(), grads.count(k) * s.width[k]);
    }
  }
  return OkStatus();
}

}  // namespace

template <typename T>
Status RowsGrad(OpKernelContext* ctx, const TTShape& s, const TTRowsGradArgs& a,
                thread::ThreadPool* pool) {
  TF_RETURN_IF_ERROR(ValidateRowsGradShape(*a.grad, a.num_ids, s));
  return CoreGradients<T>(ctx, s, a, IdGrads<T, AccT<T>>(a.grad->flat<T>().data(), s.dim), pool);
}

template <typename T, typename Tindex>
Status RowsBagsGrad(OpKernelContext* ctx, const TTShape& s, const BagAttrs& attrs,
                    const TTRowsBagsGradArgs& a, thread::ThreadPool* pool) {
  // The bags' entries sorted by slot, as GatherReduceSumDenseGrad sorts them
  // for a table of U rows, which checks the slots and row_splits.
  ParamsGradCall<T, Tindex> call;
  BackwardInputs in{BagShapes{a.num_bags, a.nnz}, a.num_ids, s.dim, a.row_splits, a.slots, a.grad};
  if (attrs.has_weights) in.weights = a.weights;
  const Status prepared = PrepareParamsGrad(attrs, in, pool, &call);
  if (!prepared.ok()) {
    return errors::InvalidArgument("TTRowsBagsGrad's slots (indices into ids, a table of ",
                                   a.num_ids, " rows) and row_splits: ", prepared.message());
  }
  // Each id's run of sorted entries (none for an id no entry uses).
  const SortedEntries& sorted = call.sorted;
  std::vector<int64_t> starts(a.num_ids + 1);
  const int64_t num_sorted = static_cast<int64_t>(sorted.keys.size());
  for (int64_t j = 0, k = 0; j <= a.num_ids; ++j) {
    while (k < num_sorted && static_cast<int64_t>(sorted.keys[k]) < j) ++k;
    starts[j] = k;
  }
  const IdGrads<T, AccT<T>> grad(call.grad, &sorted, call.coef.data(), starts.data(), s.dim);
  return CoreGradients<T>(ctx, s, a, grad, pool);
}

template Status RowsGrad<Eigen::half>(OpKernelContext*, const TTShape&, const TTRowsGradArgs&,
                                      thread::ThreadPool*);
template Status RowsGrad<Eigen::bfloat16>(OpKernelContext*, const TTShape&, const TTRowsGradArgs&,
                                          thread::ThreadPool*);
template Status RowsGrad<float>(OpKernelContext*, const TTShape&, const TTRowsGradArgs&,
                                thread::ThreadPool*);
template Status RowsGrad<double>(OpKernelContext*, const TTShape&, const TTRowsGradArgs&,
                                 thread::ThreadPool*);

#define TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD(T, Tindex)                                       \
  template Status RowsBagsGrad<T, Tindex>(OpKernelContext*, const TTShape&, const BagAttrs&, \
                                          const TTRowsBagsGradArgs&, thread::ThreadPool*);
#define TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD_OF(T) \
  TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD(T, int32_t) \
  TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD(T, int64_t)
TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD_OF(Eigen::half)
TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD_OF(Eigen::bfloat16)
TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD_OF(float)
TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD_OF(double)
#undef TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD_OF
#undef TF_TTEMB_INSTANTIATE_ROWS_BAGS_GRAD

}  // namespace tt_cpu
}  // namespace tf_ttemb
}  // namespace tensorflow
