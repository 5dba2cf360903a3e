// How the CPU kernels of every op family split work over TensorFlow's CPU
// pool: contiguous blocks that the calling thread and the pool's threads
// claim from a shared counter. Plain fork and join; no op logic.

#ifndef TF_TTEMB_CC_KERNELS_CPU_PARALLEL_H_
#define TF_TTEMB_CC_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tf_ttemb {

inline thread::ThreadPool* CpuPool(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->workers;
}

// Runs fn(k) for every block k in [0, num_blocks), on the calling thread and
// up to max_workers - 1 of the pool's threads. The caller starts on the
// blocks at once and the pool's threads join it as they wake, each claiming
// the next unclaimed block, so a thread that wakes late costs no more than
// the blocks it would have taken. The call returns once every block is done:
// it waits only for blocks being run, never for a helper still queued behind
// other work (ParallelFor waits for every task it scheduled). Which thread
// runs a block must not change what the block computes.
template <typename Fn>
void RunClaimedBlocks(thread::ThreadPool* pool, int64_t num_blocks, int64_t max_workers, Fn fn) {
  if (num_blocks <= 0) return;
  const int64_t workers = std::min<int64_t>({max_workers, pool->NumThreads(), num_blocks});
  if (workers <= 1) {
    for (int64_t k = 0; k < num_blocks; ++k) fn(k);
    return;
  }
  // Shared with the helpers: one may start after the last block is done (and
  // this call has returned); it then finds no block to claim and only drops
  // its reference. fn is called only for claimed blocks, all done before the
  // return.
  struct Claims {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> left{0};
    mutex mu;
    condition_variable all_done;
  };
  auto claims = std::make_shared<Claims>();
  claims->left = num_blocks;
  auto drain = [claims, num_blocks, &fn]() {
    for (int64_t k = claims->next.fetch_add(1); k < num_blocks; k = claims->next.fetch_add(1)) {
      fn(k);
      if (claims->left.fetch_sub(1) == 1) {
        mutex_lock lock(claims->mu);
        claims->all_done.notify_all();
      }
    }
  };
  for (int64_t h = 1; h < workers; ++h) pool->Schedule(drain);
  drain();
  mutex_lock lock(claims->mu);
  while (claims->left.load() > 0) claims->all_done.wait(lock);
}

// Splits [0, n) into at most `max_blocks` contiguous blocks of about equal
// work, where prefix[i] is the cumulative work before item i (prefix has
// n + 1 entries, prefix[n] the total). Returns the n_blocks + 1 boundaries.
inline std::vector<int64_t> BalancedBlocks(const int64_t* prefix, int64_t n, int64_t max_blocks) {
  std::vector<int64_t> bounds{0};
  if (n == 0) return bounds;
  const int64_t total = prefix[n] - prefix[0];
  const int64_t blocks = std::max<int64_t>(1, std::min(max_blocks, n));
  for (int64_t k = 1; k < blocks; ++k) {
    const int64_t target = prefix[0] + total * k / blocks;
    int64_t pos = std::lower_bound(prefix, prefix + n + 1, target) - prefix;
    pos = std::min(std::max(pos, bounds.back()), n);
    if (pos > bounds.back()) bounds.push_back(pos);
  }
  if (bounds.back() != n) bounds.push_back(n);
  return bounds;
}

// Runs fn(begin, end) over about 4 balanced blocks of [0, n) per thread
// (BalancedBlocks of prefix), claimed as RunClaimedBlocks claims them.
template <typename Fn>
void ForBalancedBlocks(thread::ThreadPool* pool, const int64_t* prefix, int64_t n,
                       int64_t cost_per_item, Fn fn) {
  const int64_t threads = pool->NumThreads();
  const int64_t total_cost = (prefix[n] - prefix[0] + n) * std::max<int64_t>(1, cost_per_item);
  // Small problems run inline: the pool's overhead would dominate.
  if (threads <= 1 || total_cost < 100000) {
    fn(0, n);
    return;
  }
  const std::vector<int64_t> bounds = BalancedBlocks(prefix, n, 4 * threads);
  RunClaimedBlocks(pool, static_cast<int64_t>(bounds.size()) - 1, threads,
                   [&](int64_t k) { fn(bounds[k], bounds[k + 1]); });
}

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_CPU_PARALLEL_H_
