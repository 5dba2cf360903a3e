// CollapseToHugePages and AdviseHugePages (huge_pages.h): the registry of the
// large tables seen so far and the madvise calls.

#include "cc/kernels/huge_pages.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tensorflow {
namespace tf_ttemb {
namespace {

#if defined(__linux__)

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older headers lack the name
#endif

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
// Tables remembered at once; past this the registry starts afresh (a table
// then waits for one more sighting).
constexpr size_t kMaxTracked = 1024;

bool Enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("TF_TTEMB_HUGE_PAGES");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

// The whole huge pages inside [p, p + bytes): [*start, *end), maybe empty.
void Interior(const void* p, int64_t bytes, uintptr_t* start, uintptr_t* end) {
  const uintptr_t data = reinterpret_cast<uintptr_t>(p);
  *start = (data + kHugePage - 1) & ~(kHugePage - 1);
  *end = (data + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
}

// A table's interior seen before: its end, and whether it was collapsed.
struct Seen {
  uintptr_t end;
  bool collapsed;
};

std::mutex registry_mu;
std::unordered_map<uintptr_t, Seen>* registry = new std::unordered_map<uintptr_t, Seen>();

#endif  // __linux__

}  // namespace

void CollapseToHugePages(const Tensor& table) {
#if defined(__linux__)
  const int64_t bytes = static_cast<int64_t>(table.TotalBytes());
  if (bytes < kHugePageMinTableBytes || !Enabled()) return;
  uintptr_t start, end;
  Interior(table.tensor_data().data(), bytes, &start, &end);
  if (end <= start) return;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry->find(start);
    if (it == registry->end() || it->second.end != end) {  // first sighting
      if (registry->size() >= kMaxTracked) registry->clear();
      (*registry)[start] = Seen{end, false};
      return;
    }
    if (it->second.collapsed) return;
    it->second.collapsed = true;
  }
  // Outside the lock: a collapse copies the range (about 0.1 s for 256 MiB),
  // once per table; a refusal leaves the pages as they were.
  void* range = reinterpret_cast<void*>(start);
  if (madvise(range, end - start, MADV_HUGEPAGE) == 0) {
    madvise(range, end - start, MADV_COLLAPSE);
  }
#else
  (void)table;
#endif
}

void AdviseHugePages(void* p, int64_t bytes) {
#if defined(__linux__)
  if (bytes < kHugePageMinFreshBytes || !Enabled()) return;
  uintptr_t start, end;
  Interior(p, bytes, &start, &end);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace tf_ttemb
}  // namespace tensorflow
