// The CPU kernels of the TT embedding family's TTUniqueIds, TTRows and
// TTCacheCount, and the family's CPU registrations (TTRowsGrad's and
// TTRowsBagsGrad's kernels are in tt_embedding_backward_cpu.cc; the shared plan
// in tt_embedding_cpu.h).

#include "cc/kernels/check_report_op.h"
#include "cc/kernels/tt_embedding_cpu.h"
#include "tensorflow/core/framework/register_types.h"

namespace tensorflow {
namespace tf_ttemb {
namespace tt_cpu {
namespace {

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
  Tindex* slots = a.slots->flat<Tindex>().data();
  // The entries sorted by global id (stable radix sort of global id << b |
  // position, b the positions' bits), then one pass: the distinct ids, and
  // each entry's slot.
  const int position_bits = BitsFor(std::max<int64_t>(nnz, 2));
  const int id_bits = BitsFor(std::max<int64_t>(a.num_tables * attrs.stride, 2));
  std::vector<int64_t> sorted;
  if (position_bits + id_bits <= 64) {
    std::vector<uint64_t> words, scratch;
    words.reserve(nnz);
    for (int64_t j = 0; j < nnz; ++j) {
      if (global[j] < 0) {
        slots[j] = Tindex(-1);
      } else {
        words.push_back(static_cast<uint64_t>(global[j]) << position_bits |
                        static_cast<uint64_t>(j));
      }
    }
    RadixSortPacked(pool, &words, &scratch, position_bits, id_bits);
    const uint64_t position_mask = (uint64_t{1} << position_bits) - 1;
    for (size_t i = 0; i < words.size(); ++i) {
      const int64_t id = static_cast<int64_t>(words[i] >> position_bits);
      if (sorted.empty() || sorted.back() != id) sorted.push_back(id);
      slots[words[i] & position_mask] = static_cast<Tindex>(sorted.size() - 1);
    }
  } else {
    sorted.reserve(nnz);
    for (int64_t g : global) {
      if (g >= 0) sorted.push_back(g);
    }
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    pool->ParallelFor(
        nnz, thread::ThreadPool::SchedulingParams::Adaptive(40), [&](int64_t begin, int64_t end) {
          for (int64_t j = begin; j < end; ++j) {
            slots[j] = global[j] < 0
                           ? Tindex(-1)
                           : static_cast<Tindex>(
                                 std::lower_bound(sorted.begin(), sorted.end(), global[j]) -
                                 sorted.begin());
          }
        });
  }
  Tensor* unique_t = nullptr;
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(0, TensorShape({static_cast<int64_t>(sorted.size())}), &unique_t));
  std::copy(sorted.begin(), sorted.end(), unique_t->flat<int64_t>().data());
  return OkStatus();
}

// ---------------------------------------------------------------------------
// TTRows

// Level m's products and, from each node's, the rows of its leaves: rows[j]
// for the chunk's ids j.
template <typename T, typename Acc>
void FusedForward(thread::ThreadPool* pool, const Chunk<T, Acc>& c, T* rows) {
  const int m = c.fused();
  const Level& level = c.tree().levels[m];
  const std::array<int64_t, 5> sizes = c.FusedSizes();
  const int64_t size = sizes[0], rows_m = sizes[1], rank = sizes[2], q = sizes[3], dim = sizes[4];
  const double node_cost = m > 0 ? c.NodeCost(m) : 0;
  const double leaf_cost = static_cast<double>(dim * rank);
  const int64_t batch = BatchNodes(c.s, m);
  RunClaimed<Scratch<Acc>>(
      pool, level.num_groups(),
      [&](int64_t g) { return c.FusedGroupCost(g, node_cost, leaf_cost); },
      [&](Scratch<Acc>* sc, int64_t g) {
        const int64_t end = level.groups[g + 1];
        for (int64_t i = level.groups[g]; i < end; i += batch) {
          const int64_t stop = std::min(end, i + batch);
          c.PrefetchLeaves(i, stop, [&](int64_t j) { PrefetchRow(rows + j * dim, dim); });
          Acc* products = nullptr;
          if (m > 0) {
            products = sc->products.Resize(batch * size);
            c.Products(m, i, stop, products, sc);
          }
          for (int64_t slot = i; slot < stop; ++slot) {
            const int64_t v = level.order[slot];
            const Acc* p = m > 0 ? products + (slot - i) * size : c.Node(0, v);
            for (int64_t leaf = level.children[v]; leaf < level.children[v + 1]; ++leaf) {
              const int64_t first_id = c.tree().leaf_ids[leaf];
              const int64_t end_id = c.tree().leaf_ids[leaf + 1];
              Acc* out;
              int64_t j = first_id;
              if constexpr (std::is_same<T, Acc>::value) {
                out = rows + first_id * dim;  // computed in place
                ++j;
              } else {
                out = sc->leaf.Resize(dim);
              }
              tt_math::RowDots(p, rows_m, rank, c.LastTransposed(leaf), q, out);
              for (; j < end_id; ++j) {
                StoreRow(rows + j * dim, out, dim);
              }
            }
          }
        }
      });
}

template <typename T>
Status Rows(OpKernelContext* ctx, const TTShape& s, const TTRowsArgs& a, thread::ThreadPool* pool) {
  using Acc = AccT<T>;
  const int64_t num_ids = a.num_ids;
  if (num_ids == 0) return OkStatus();
  const int64_t* ids = a.ids->flat<int64_t>().data();
  T* rows = a.rows->flat<T>().data();
  const Cores<T, Acc> cores(a.cores, s);
  const int m = s.num_cores - 2;
  // The same chunks as TTRowsGrad, so that it can take over the tree.
  const int64_t chunk = ChunkSize(BytesPerId(s, sizeof(Acc)));
  Chunk<T, Acc> c(s, cores);
  const bool one_chunk = num_ids <= chunk;
  for (int64_t begin = 0; begin < num_ids; begin += chunk) {
    const int64_t n = std::min(chunk, num_ids - begin);
    c.Build(pool, ids + begin, n,
            one_chunk ? Chunk<T, Acc>::Tree::kShare : Chunk<T, Acc>::Tree::kBuild);
    c.ForwardLevels(pool, m - 1);
    FusedForward(pool, c, rows + begin * s.dim);
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
}  // namespace tt_cpu

template <typename Tindex>
struct UniqueIdsLaunch<CpuDevice, Tindex> {
  static Status Run(OpKernelContext* ctx, const UniqueIdsAttrs& attrs, const UniqueIdsArgs& a,
                    const CpuStep& step) {
    return tt_cpu::UniqueIds<Tindex>(ctx, attrs, a, step.pool);
  }
};

template <typename T>
struct TTRowsLaunch<CpuDevice, T> {
  static constexpr int64_t kReportWords = 0;  // the ids are checked here

  static Status Run(OpKernelContext* ctx, const TTShape& shape, const TTRowsArgs& a) {
    return tt_cpu::Rows<T>(ctx, shape, a, ctx->device()->tensorflow_cpu_worker_threads()->workers);
  }
};

template <typename T>
struct TTRowsGradLaunch<CpuDevice, T> {
  static Status Run(OpKernelContext* ctx, const TTShape& shape, const TTRowsGradArgs& a,
                    const CpuStep& step) {
    return tt_cpu::RowsGrad<T>(ctx, shape, a, step.pool);
  }
};

template <typename T, typename Tindex>
struct TTRowsBagsGradLaunch<CpuDevice, T, Tindex> {
  static Status Run(OpKernelContext* ctx, const TTShape& shape, const BagAttrs& attrs,
                    const TTRowsBagsGradArgs& a, const CpuStep& step) {
    return tt_cpu::RowsBagsGrad<T, Tindex>(ctx, shape, attrs, a, step.pool);
  }
};

template <>
struct CacheCountLaunch<CpuDevice> {
  static Status Run(OpKernelContext* ctx, const CacheCountArgs& a, const CpuStep&) {
    return tt_cpu::CacheCount(ctx, a);
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

#define REGISTER_TT_ROWS_BAGS_GRAD(T, Tindex)                      \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTRowsBagsGrad")           \
                              .Device(DEVICE_CPU)                  \
                              .TypeConstraint<T>("T")              \
                              .TypeConstraint<Tindex>("Tindices"), \
                          TTRowsBagsGradOp<CpuDevice, T, Tindex>);
#define REGISTER_TT_ROWS_BAGS_GRAD_OF(T) \
  REGISTER_TT_ROWS_BAGS_GRAD(T, int32_t) \
  REGISTER_TT_ROWS_BAGS_GRAD(T, int64_t)
REGISTER_TT_ROWS_BAGS_GRAD_OF(Eigen::half)
REGISTER_TT_ROWS_BAGS_GRAD_OF(Eigen::bfloat16)
REGISTER_TT_ROWS_BAGS_GRAD_OF(float)
REGISTER_TT_ROWS_BAGS_GRAD_OF(double)
#undef REGISTER_TT_ROWS_BAGS_GRAD_OF
#undef REGISTER_TT_ROWS_BAGS_GRAD

REGISTER_KERNEL_BUILDER(Name("TfTtemb>TTCacheCount").Device(DEVICE_CPU), TTCacheCountOp<CpuDevice>);

// An empty report (a CPU TTRows') is OK; a GPU one, copied here, raises what it holds.
REGISTER_KERNEL_BUILDER(Name("TfTtemb>CheckTTRowsReport").Device(DEVICE_CPU),
                        CheckReportCpuOp<TTRowsReportTraits>);

}  // namespace tf_ttemb
}  // namespace tensorflow
