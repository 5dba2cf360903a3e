// The CPU kernels of the TT embedding family, the part that TTRows
// (tt_embedding_forward_cpu.cc) and TTRowsGrad (tt_embedding_backward_cpu.cc)
// share: the chunks of ids, their prefix trees, the workers' scratch and the
// claimed-run thread pool. Validation is tt_embedding_kernels.cc.
//
// TTRows / TTRowsGrad work on chunks of ids (sized so the temporaries stay
// under kChunkBytes) and, per chunk, on a prefix tree: level k has one node
// per run of consecutive ids with the same leading digits i_0..i_k (for sorted
// ids: one node per distinct prefix), so each partial product
//   P_k = G_0[i_0] G_1[i_1] ... G_k[i_k]       ((q_0..q_k) x r_{k+1})
// is computed once per node from its parent's. Level 0's products are rows of
// core 0, read where they lie. The nodes of a level are grouped by the core
// row they multiply with; a group's products are one product of its parents'
// P_{k-1}, stacked as row pointers (never copied), with the core row
// (tt_embedding_cpu_math.h).
//
// The last level is fused into level m = T-2: a worker that has a node's P_m
// computes the node's leaves (its rows, P_m G_{T-1}[i_{T-1}]) at once, so the
// products are used while they are in cache. TTRowsGrad computes them again:
// writing them to memory and reading them back cost more than the products.
//
// The backward walks the same groups. Level m's pass computes per node dP_m,
// the sum over its leaves of dP_leaf G_{T-1}^T (a leaf's gradient row read in
// place), and each leaf's block of core T-1's gradient (P_m^T dP_leaf); then
// per group the core row's gradient (P_{m-1}^T dP_m, summed over the group in
// node order) and each node's contribution to its parent's dP_{m-1}
// (dP_m G_m^T). Levels m-1..1 do the same with dP_k summed from the children's
// contributions; a last pass sums core 0's gradient (level 1's contributions)
// and core T-1's (the leaves' blocks) per core row.
//
// Threads: a pass is a list of groups cut into runs of about equal cost, and
// each worker of TF's CPU pool claims the next unclaimed run from a shared
// counter until none is left (RunClaimed): no thread is handed a fixed share,
// so one that starts late or is descheduled holds a pass up by at most one
// run. Every sum has a fixed order that depends on the ids only (never on the
// thread count or on which worker ran what), and each core row's gradient is
// written by one group at a time: the result is bitwise reproducible without
// atomics.

#ifndef TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_H_
#define TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "cc/kernels/cpu_parallel.h"
#include "cc/kernels/device_op_kernel.h"
#include "cc/kernels/gather_reduce_sum_cpu.h"
#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/huge_pages.h"
#include "cc/kernels/tt_embedding_cpu_math.h"
#include "cc/kernels/tt_embedding_kernels.h"
#include "cc/kernels/tt_embedding_op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mem.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {
namespace tt_cpu {

// Temporaries of one chunk of ids (products of the levels below m, their
// gradients' contributions and the leaves' core-gradient blocks) stay under
// this many bytes.
inline constexpr int64_t kChunkBytes = int64_t{32} << 20;

// A worker takes a group's nodes this many elements of products at a time, so
// that its temporaries (their products and gradients) stay in the L2 cache.
inline constexpr int64_t kBatchElements = int64_t{16} << 10;

// A pass is cut into at most this many runs per thread (RunClaimed)...
inline constexpr int64_t kRunsPerThread = 16;
// ... and runs on one thread when its estimated cost (multiply-adds) is below
// this: handing work to another thread costs microseconds.
inline constexpr double kMinParallelCost = 1 << 17;

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
// their products are stored at their position in `order` (their slot), so
// that a group's products are one contiguous block.
struct Level {
  std::vector<int64_t> parent;    // [count] node at the previous level
  std::vector<int64_t> core_row;  // [count] row of core k it multiplies with
  std::vector<int64_t> order;     // [count] nodes sorted by (core_row, node)
  std::vector<int64_t> slot;      // [count] position of each node in order
  std::vector<int64_t> group;     // [count] group of each node
  std::vector<int64_t> groups;    // offsets into order of each core row's run
  std::vector<int64_t> children;  // [count + 1] offsets of each node's children
                                  // among the next level's nodes
  int64_t count() const { return static_cast<int64_t>(parent.size()); }
  int64_t num_groups() const { return static_cast<int64_t>(groups.size()) - 1; }
  int64_t GroupRow(int64_t g) const { return core_row[order[groups[g]]]; }
  int64_t GroupSize(int64_t g) const { return groups[g + 1] - groups[g]; }

  // Sorts the nodes by core row, ties in node order: a counting sort when the
  // core (num_rows rows) is small next to the level, else a merge sort.
  void Sort(int64_t num_rows, std::vector<int64_t>* start) {
    const int64_t n = count();
    order.resize(n);
    if (num_rows <= 4 * n + 4096) {
      start->assign(num_rows + 1, 0);
      for (int64_t v = 0; v < n; ++v) ++(*start)[core_row[v] + 1];
      for (int64_t row = 0; row < num_rows; ++row) (*start)[row + 1] += (*start)[row];
      for (int64_t v = 0; v < n; ++v) order[(*start)[core_row[v]]++] = v;
    } else {
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return core_row[a] < core_row[b]; });
    }
    slot.resize(n);
    group.resize(n);
    groups.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (i == 0 || core_row[order[i]] != core_row[order[i - 1]]) groups.push_back(i);
      slot[order[i]] = i;
      group[order[i]] = static_cast<int64_t>(groups.size()) - 1;
    }
    groups.push_back(n);
  }
};

// Division by a fixed positive divisor with a double reciprocal, for
// dividends below 2^50 (else the integer division): the estimate is within one
// of the quotient and corrected, several times faster than a 64-bit division.
// A divisor of 1 (the last level's stride) returns the dividend.
class Divider {
 public:
  Divider() = default;
  Divider(int64_t divisor, bool fast)
      : divisor_(divisor), inverse_(1.0 / static_cast<double>(divisor)), fast_(fast) {}
  int64_t operator()(int64_t a) const {
    if (divisor_ == 1) return a;
    if (!fast_) return a / divisor_;
    int64_t q = static_cast<int64_t>(static_cast<double>(a) * inverse_);
    if (q * divisor_ > a) --q;
    if ((q + 1) * divisor_ <= a) ++q;
    return q;
  }

 private:
  int64_t divisor_ = 1;
  double inverse_ = 1.0;
  bool fast_ = false;
};

// The prefix tree of ids[0, n): nodes are runs of consecutive ids with equal
// leading digits; leaf[j] is id j's node at the last level.
struct PrefixTree {
  // Below this many ids a tree is built on one thread.
  static constexpr int64_t kMinParallelIds = 4096;

  std::vector<Level> levels;
  std::vector<int64_t> leaf;
  std::vector<int64_t> leaf_ids;  // [num_leaves + 1] offsets of each leaf's ids

  // The levels are independent (each finds its own nodes and its nodes'
  // parents from the ids), so they are built side by side on the pool.
  void Build(thread::ThreadPool* pool, const int64_t* ids, int64_t n, const TTShape& s) {
    const int T = s.num_cores;
    levels.resize(T);
    leaf.resize(n);
    const int64_t workers = n >= kMinParallelIds ? pool->NumThreads() : 1;
    // The largest levels (the deepest) first.
    RunClaimedBlocks(pool, T, workers, [&](int64_t b) { BuildLevel(T - 1 - b, ids, n, s); });
  }

  // Level k's nodes (a node starts at each id whose level-k prefix key,
  // TTShape::PrefixKey, differs from the previous id's), their parents (the
  // level-(k-1) node of their first id) and core rows, sorted; level k-1's
  // children offsets; for the last level, leaf and leaf_ids.
  void BuildLevel(int k, const int64_t* ids, int64_t n, const TTShape& s) {
    const int T = s.num_cores;
    Level& level = levels[k];
    // At most one node per id; trimmed to the count below. Not cleared first:
    // a reused tree's arrays keep their size, and growing zero-fills.
    level.parent.resize(n);
    level.core_row.resize(n);
    int64_t* parent = level.parent.data();
    int64_t* core_row = level.core_row.data();
    // Divisions by a double reciprocal where the ids allow it (Divider), and
    // only where a run of equal keys ends: the ids of level k's key `key` are
    // [lo, hi), those of the parent level's `parent_key` [parent_lo, parent_hi).
    const bool fast = s.num_ids() < (int64_t{1} << 50);
    const Divider key_of(s.stride[k], fast);
    const Divider parent_key_of(k > 0 ? s.stride[k - 1] : 1, fast);
    const Divider table_of(s.rows_per_table, fast);
    int64_t count = 0, lo = 1, hi = 0;
    int64_t parent_key = -1, parent_lo = 1, parent_hi = 0, parents = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t id = ids[j];
      if (k > 0 && (id < parent_lo || id >= parent_hi)) {
        parent_key = parent_key_of(id);
        parent_lo = parent_key * s.stride[k - 1];
        parent_hi = parent_lo + s.stride[k - 1];
        ++parents;
      }
      if (id < lo || id >= hi) {
        const int64_t key = key_of(id);
        lo = key * s.stride[k];
        hi = lo + s.stride[k];
        parent[count] = k == 0 ? -1 : parents - 1;
        // table * p_k + i_k; level 0's key is table * p_0 + i_0 itself.
        const int64_t table = s.num_tables == 1 ? 0 : table_of(id);
        core_row[count] = k == 0 ? key : table * s.p[k] + key - parent_key * s.p[k];
        ++count;
      }
      if (k == T - 1) leaf[j] = count - 1;
    }
    level.parent.resize(count);
    level.core_row.resize(count);
    std::vector<int64_t> sort_scratch;
    level.Sort(s.num_tables * s.p[k], &sort_scratch);
    // Parents are non-decreasing along a level's nodes: children are runs.
    if (k > 0) Offsets(level.parent, parents, &levels[k - 1].children);
    if (k == T - 1) Offsets(leaf, level.count(), &leaf_ids);
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

// Large temporaries come from a process-wide cache of blocks and go back to
// it, so that a training step writes into the pages of the step before.
// Fresh pages cost more than the products written into them: Linux faults
// each 4 KiB page in and zeroes it, about 0.7 ms of CPU per MiB, and with
// several threads the allocator hands freed blocks back to the system. At most
// kMaxCachedBytes stay cached (the oldest blocks are freed first); blocks of
// at least kHugePageMinFreshBytes are advised huge pages (huge_pages.h).
class BlockCache {
 public:
  static constexpr size_t kMaxCachedBytes = size_t{256} << 20;

  static BlockCache& Get() {
    static BlockCache* cache = new BlockCache();
    return *cache;
  }

  // A block of at least `bytes`; *capacity is set to its size.
  void* Take(size_t bytes, size_t* capacity) {
    {
      mutex_lock lock(mu_);
      size_t best = blocks_.size();
      for (size_t i = 0; i < blocks_.size(); ++i) {
        if (blocks_[i].bytes >= bytes &&
            (best == blocks_.size() || blocks_[i].bytes < blocks_[best].bytes)) {
          best = i;
        }
      }
      if (best < blocks_.size()) {
        const Block block = blocks_[best];
        blocks_.erase(blocks_.begin() + best);
        cached_ -= block.bytes;
        *capacity = block.bytes;
        return block.data;
      }
    }
    const bool huge = static_cast<int64_t>(bytes) >= kHugePageMinFreshBytes;
    void* data = port::AlignedMalloc(bytes, huge ? size_t{2} << 20 : 64);
    if (huge) AdviseHugePages(data, static_cast<int64_t>(bytes));
    *capacity = bytes;
    return data;
  }

  void Give(void* data, size_t bytes) {
    std::vector<Block> freed;
    {
      mutex_lock lock(mu_);
      blocks_.push_back(Block{data, bytes});
      cached_ += bytes;
      while (cached_ > kMaxCachedBytes) {
        freed.push_back(blocks_.front());
        cached_ -= blocks_.front().bytes;
        blocks_.erase(blocks_.begin());
      }
    }
    for (const Block& block : freed) port::AlignedFree(block.data);
  }

 private:
  struct Block {
    void* data;
    size_t bytes;
  };
  mutex mu_;
  std::vector<Block> blocks_ TF_GUARDED_BY(mu_);
  size_t cached_ TF_GUARDED_BY(mu_) = 0;
};

// A growable array that is written before it is read: resizing keeps no
// contents and never zero-fills (a std::vector would memset every chunk).
// Arrays of at least kCachedBytes live in BlockCache's blocks.
template <typename Acc>
class Buffer {
 public:
  static constexpr size_t kCachedBytes = size_t{256} << 10;

  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~Buffer() { Release(); }

  Acc* Resize(int64_t size) {
    const size_t bytes = static_cast<size_t>(size) * sizeof(Acc);
    if (bytes > bytes_) {
      Release();
      if (bytes >= kCachedBytes) {
        data_ = BlockCache::Get().Take(bytes, &bytes_);
      } else {
        data_ = port::AlignedMalloc(bytes, 64);
        bytes_ = bytes;
      }
    }
    return data();
  }
  Acc* data() { return static_cast<Acc*>(data_); }
  const Acc* data() const { return static_cast<const Acc*>(data_); }

 private:
  void Release() {
    if (data_ == nullptr) return;
    if (bytes_ >= kCachedBytes) {
      BlockCache::Get().Give(data_, bytes_);
    } else {
      port::AlignedFree(data_);
    }
    data_ = nullptr;
    bytes_ = 0;
  }

  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Ids per chunk so that `bytes_per_id` of temporaries per id fit kChunkBytes.
inline int64_t ChunkSize(int64_t bytes_per_id) {
  return std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes_per_id));
}

// Runs fn(&scratch, i) for every i in [0, n) on the pool. The items are cut
// into runs of consecutive items of about equal cost(i), which the calling
// thread and the pool's threads claim one at a time (RunClaimedBlocks); each
// thread has one Scratch. What fn computes for an item must not depend on the
// thread that runs it.
template <typename Scratch, typename Cost, typename Fn>
void RunClaimed(thread::ThreadPool* pool, int64_t n, Cost cost, Fn fn) {
  if (n <= 0) return;
  const int64_t threads = std::max(1, pool->NumThreads());
  std::vector<int64_t> runs = {0};
  if (threads > 1 && n > 1) {
    std::vector<double> costs(n);
    double total = 0;
    for (int64_t i = 0; i < n; ++i) total += (costs[i] = cost(i));
    if (total >= kMinParallelCost) {
      const double target = total / static_cast<double>(kRunsPerThread * threads);
      double sum = 0;
      for (int64_t i = 0; i + 1 < n; ++i) {
        sum += costs[i];
        if (sum >= target) {
          runs.push_back(i + 1);
          sum = 0;
        }
      }
    }
  }
  runs.push_back(n);
  // One Scratch per thread, kept from pass to pass: a thread runs one run at
  // a time, and a pass returns only once the runs it handed out are done.
  RunClaimedBlocks(pool, static_cast<int64_t>(runs.size()) - 1, threads, [&](int64_t r) {
    static thread_local Scratch scratch;
    for (int64_t i = runs[r]; i < runs[r + 1]; ++i) fn(&scratch, i);
  });
}

// A worker's temporaries.
template <typename Acc>
struct Scratch {
  Buffer<Acc> products;    // a batch's recomputed products
  Buffer<Acc> grads;       // a batch's dP
  Buffer<Acc> transposed;  // G_k[row]^T
  Buffer<Acc> leaf;        // a leaf's summed gradient row, or a row before conversion
  std::vector<const Acc*> a_rows, d_rows;
  std::vector<Acc*> c_rows;
};

// Appends the pointers to the `rows` rows of `width` elements of block p.
template <typename P>
void PushRows(P* p, int64_t rows, int64_t width, std::vector<P*>* out) {
  for (int64_t i = 0; i < rows; ++i) out->push_back(p + i * width);
}

// Nodes of a level-k group a worker takes at a time (kBatchElements).
inline int64_t BatchNodes(const TTShape& s, int k) {
  return std::max<int64_t>(1, kBatchElements / (s.cols[k] * s.r[k + 1]));
}

// The trees of recent calls' ids (all of a call's ids in one chunk), so
// that TTRowsGrad takes the tree that TTRows built for the same ids instead
// of building it again on one thread. An entry matches on the factorisation
// and on the ids themselves, compared in full.
class TreeCache {
 public:
  static constexpr size_t kEntries = 4;

  static TreeCache& Get() {
    static TreeCache* cache = new TreeCache();
    return *cache;
  }

  std::shared_ptr<const PrefixTree> Find(const TTShape& s, const int64_t* ids, int64_t n) {
    mutex_lock lock(mu_);
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      if (e.num_tables == s.num_tables && e.p == s.p && static_cast<int64_t>(e.ids.size()) == n &&
          std::equal(e.ids.begin(), e.ids.end(), ids)) {
        std::rotate(entries_.begin(), entries_.begin() + i, entries_.begin() + i + 1);
        return entries_.front().tree;
      }
    }
    return nullptr;
  }

  void Put(const TTShape& s, const int64_t* ids, int64_t n, std::shared_ptr<PrefixTree> tree) {
    mutex_lock lock(mu_);
    Entry e;
    if (entries_.size() >= kEntries) {  // the oldest entry's arrays are reused
      e = std::move(entries_.back());
      entries_.pop_back();
      if (e.tree.use_count() == 1 && spare_.size() < kEntries) spare_.push_back(std::move(e.tree));
    }
    e.num_tables = s.num_tables;
    e.p = s.p;
    e.ids.assign(ids, ids + n);
    e.tree = std::move(tree);
    entries_.insert(entries_.begin(), std::move(e));
  }

  // A tree to build into: one that an entry no longer needs (its arrays keep
  // their capacity, so that building does not allocate), else a new one.
  std::shared_ptr<PrefixTree> Spare() {
    mutex_lock lock(mu_);
    if (spare_.empty()) return std::make_shared<PrefixTree>();
    std::shared_ptr<PrefixTree> tree = std::move(spare_.back());
    spare_.pop_back();
    return tree;
  }

 private:
  struct Entry {
    int64_t num_tables = 0;
    std::vector<int64_t> p;
    std::vector<int64_t> ids;
    std::shared_ptr<PrefixTree> tree;
  };
  mutex mu_;
  std::vector<Entry> entries_ TF_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<PrefixTree>> spare_ TF_GUARDED_BY(mu_);
};

// One chunk: its prefix tree, where its partial products are, and the last
// core's blocks that its leaves use, transposed.
template <typename T, typename Acc>
struct Chunk {
  const TTShape& s;
  const Cores<T, Acc>& cores;
  std::shared_ptr<const PrefixTree> tree_;
  std::vector<Buffer<Acc>> buffers;  // products of levels 1..m-1
  std::vector<const Acc*> data;      // per level: products at the nodes' slots
  Buffer<Acc> last_t;                // [last level's groups, q_{T-1} r_{T-1}]

  Chunk(const TTShape& shape, const Cores<T, Acc>& c) : s(shape), cores(c) {}

  const PrefixTree& tree() const { return *tree_; }
  int fused() const { return s.num_cores - 2; }  // level m
  // Elements of one node's P_k.
  int64_t Size(int k) const { return s.cols[k] * s.r[k + 1]; }
  // Multiply-adds of one node's P_k from its parent's (k >= 1).
  double NodeCost(int k) const { return static_cast<double>(s.r[k] * Size(k)); }
  // P_k of node v of level k: a row of core 0 for level 0.
  const Acc* Node(int k, int64_t v) const {
    const Level& level = tree().levels[k];
    if (k == 0) return cores.Row(0, level.core_row[v]);
    return data[k] + level.slot[v] * Size(k);
  }
  // Fetches into L2 what the leaves of level m's nodes at slots [first, end)
  // read or write at random: what prefetch_id(j) fetches for the first id j
  // of each (the row of the forward's output, the backward's gradient row),
  // their blocks of the last core and, where `leaf_blocks` is given (the
  // backward's, [leaves, width_{T-1}] at the leaves' slots), the blocks they
  // write there. Called before the nodes' products, whose arithmetic covers
  // the wait (5 % of TTRows' and TTRowsGrad's time at FBTT's shape).
  template <typename PrefetchId>
  void PrefetchLeaves(int64_t first, int64_t end, PrefetchId prefetch_id,
                      Acc* leaf_blocks = nullptr) const {
    const Level& level = tree().levels[fused()];
    const Level& leaves = tree().levels[s.num_cores - 1];
    const int64_t width = s.width[s.num_cores - 1];
    const int64_t block_bytes = width * static_cast<int64_t>(sizeof(Acc));
    // The next batch's nodes' children offsets, which the call for that batch
    // reads first.
    const int64_t next_end = std::min(level.count(), end + (end - first));
    for (int64_t slot = end; slot < next_end; ++slot) {
      PrefetchLine(level.children.data() + level.order[slot], PrefetchLevel::kL2);
    }
    for (int64_t slot = first; slot < end; ++slot) {
      const int64_t v = level.order[slot];
      for (int64_t leaf = level.children[v]; leaf < level.children[v + 1]; ++leaf) {
        prefetch_id(tree().leaf_ids[leaf]);
        PrefetchBytes(LastTransposed(leaf), block_bytes);
        if (leaf_blocks != nullptr) {
          PrefetchBytesForWrite(leaf_blocks + leaves.slot[leaf] * width, block_bytes);
        }
      }
    }
  }
  // The fused level's sizes: elements of a node's product (cols_m r_{T-1}),
  // its rows (cols_m), r_{T-1}, q_{T-1} and D.
  std::array<int64_t, 5> FusedSizes() const {
    const int m = fused();
    return {Size(m), s.cols[m], s.r[m + 1], s.q[m + 1], s.dim};
  }
  // The cost of level m's group g: node_cost per node and leaf_cost per leaf.
  double FusedGroupCost(int64_t g, double node_cost, double leaf_cost) const {
    const Level& level = tree().levels[fused()];
    double cost = 0;
    for (int64_t i = level.groups[g]; i < level.groups[g + 1]; ++i) {
      const int64_t v = level.order[i];
      cost +=
          node_cost + leaf_cost * static_cast<double>(level.children[v + 1] - level.children[v]);
    }
    return cost;
  }
  // G_{T-1} of leaf l's group, transposed: [q_{T-1}, r_{T-1}].
  const Acc* LastTransposed(int64_t leaf) const {
    return last_t.data() + tree().levels[s.num_cores - 1].group[leaf] * s.width[s.num_cores - 1];
  }

  // How Build finds a tree: TTRows builds it and, for all of a call's ids in
  // one chunk, shares it in TreeCache; TTRowsGrad takes it from there when it
  // is the same ids' (else builds it); a chunk of several builds it.
  enum class Tree { kShare, kReuse, kBuild };

  // The tree of ids[0, n) and the last core's rows it uses, transposed.
  void Build(thread::ThreadPool* pool, const int64_t* ids, int64_t n, Tree how) {
    tree_ = how == Tree::kReuse ? TreeCache::Get().Find(s, ids, n) : nullptr;
    if (tree_ == nullptr) {
      std::shared_ptr<PrefixTree> tree =
          how == Tree::kShare ? TreeCache::Get().Spare() : std::make_shared<PrefixTree>();
      tree->Build(pool, ids, n, s);
      if (how == Tree::kShare) TreeCache::Get().Put(s, ids, n, tree);
      tree_ = std::move(tree);
    }
    const int last = s.num_cores - 1;
    const Level& leaves = tree().levels[last];
    const int64_t width = s.width[last];
    Acc* out = last_t.Resize(leaves.num_groups() * width);
    RunClaimed<char>(
        pool, leaves.num_groups(), [&](int64_t) { return width; },
        [&](char*, int64_t g) {
          tt_math::Transpose(cores.Row(last, leaves.GroupRow(g)), s.r[last], s.q[last],
                             out + g * width);
        });
    data.assign(s.num_cores, nullptr);
    buffers.resize(s.num_cores);
  }

  // P_k of level k's nodes at slots [first, end), into out + (slot - first) * Size(k).
  void Products(int k, int64_t first, int64_t end, Acc* out, Scratch<Acc>* sc) const {
    const Level& level = tree().levels[k];
    const int64_t rows = s.cols[k - 1];
    const int64_t inner = s.r[k];
    const int64_t out_cols = s.q[k] * s.r[k + 1];
    sc->a_rows.clear();
    sc->c_rows.clear();
    for (int64_t i = first; i < end; ++i) {
      PushRows(Node(k - 1, level.parent[level.order[i]]), rows, inner, &sc->a_rows);
      PushRows(out + (i - first) * Size(k), rows, out_cols, &sc->c_rows);
    }
    tt_math::RowsTimes<false>(sc->a_rows.data(), static_cast<int64_t>(sc->a_rows.size()), inner,
                              cores.Row(k, level.core_row[level.order[first]]), out_cols,
                              sc->c_rows.data());
  }

  // The products of levels 1..last (below m), into `buffers`.
  void ForwardLevels(thread::ThreadPool* pool, int last) {
    for (int k = 1; k <= last; ++k) {
      const Level& level = tree().levels[k];
      Acc* out = buffers[k].Resize(level.count() * Size(k));
      data[k] = out;
      RunClaimed<Scratch<Acc>>(
          pool, level.num_groups(), [&](int64_t g) { return level.GroupSize(g) * NodeCost(k); },
          [&](Scratch<Acc>* sc, int64_t g) {
            const int64_t end = level.groups[g + 1];
            for (int64_t i = level.groups[g]; i < end; i += BatchNodes(s, k)) {
              const int64_t stop = std::min(end, i + BatchNodes(s, k));
              Products(k, i, stop, out + i * Size(k), sc);
            }
          });
    }
  }
};

// Bytes of temporaries per id of a chunk, the same for both ops (they must cut
// the ids into the same chunks): the products of levels 1..m-1, the
// contributions of levels 1..m, the leaves' core-gradient blocks and the
// tree's bookkeeping.
inline int64_t BytesPerId(const TTShape& s, int64_t acc_size) {
  const int m = s.num_cores - 2;
  int64_t per_id = s.width[s.num_cores - 1];
  for (int k = 1; k < m; ++k) per_id += s.cols[k] * s.r[k + 1];
  for (int k = 1; k <= m; ++k) per_id += s.cols[k - 1] * s.r[k];
  return per_id * acc_size + 64 * s.num_cores;
}

// TTRowsGrad's CPU kernel (tt_embedding_backward_cpu.cc), for T in half,
// bfloat16, float and double.
template <typename T>
Status RowsGrad(OpKernelContext* ctx, const TTShape& s, const TTRowsGradArgs& a,
                thread::ThreadPool* pool);

// TTRowsBagsGrad's CPU kernel (tt_embedding_backward_cpu.cc), for the same T
// and Tindex in int32, int64.
template <typename T, typename Tindex>
Status RowsBagsGrad(OpKernelContext* ctx, const TTShape& s, const BagAttrs& attrs,
                    const TTRowsBagsGradArgs& a, thread::ThreadPool* pool);

}  // namespace tt_cpu
}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_TT_EMBEDDING_CPU_H_
