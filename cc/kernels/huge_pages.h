// Transparent huge pages (2 MiB) for the large tables and gradients the CPU
// kernels touch at random rows.
//
// A lookup reads rows of a table at random. With 4 KiB pages a table of more
// than a few MiB misses the TLB on almost every row, and the page walk costs
// about as much as the row's own cache misses. TensorFlow's CPU allocator
// never asks Linux for 2 MiB pages (numpy does, and so does a torch table
// made from a numpy array). Two calls, both no-ops off Linux, where THP is
// "never", or with TF_TTEMB_HUGE_PAGES=0 in the environment; neither ever
// changes memory contents or fails:
// - CollapseToHugePages(table), for a table the kernel reads or updates: the
//   second time a table of at least kHugePageMinTableBytes is seen at the same
//   address (a variable, not a one-off tensor) its 2 MiB-aligned interior is
//   marked MADV_HUGEPAGE and collapsed into huge pages with MADV_COLLAPSE
//   (Linux 6.1 and newer), once per table.
// - AdviseHugePages(p, bytes), for fresh memory before its first touch (a
//   dense [N, D] gradient): MADV_HUGEPAGE only, so its faults take 2 MiB
//   pages, 512 times fewer than of 4 KiB.

#ifndef TF_TTEMB_CC_KERNELS_HUGE_PAGES_H_
#define TF_TTEMB_CC_KERNELS_HUGE_PAGES_H_

#include <cstdint>

#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace tf_ttemb {

// Tables smaller than this keep their pages: 16 MiB is twice what the
// second-level TLB of current x86 cores (2,048 entries of 4 KiB) covers.
constexpr int64_t kHugePageMinTableBytes = int64_t{16} << 20;
// Fresh ranges smaller than this are not advised (four huge pages).
constexpr int64_t kHugePageMinFreshBytes = int64_t{8} << 20;

// Moves a stable large table onto huge pages (see above). Cheap once the
// table was seen before: one lock and one hash lookup.
void CollapseToHugePages(const Tensor& table);

// Advises huge pages for the whole 2 MiB pages inside [p, p + bytes), memory
// not touched yet.
void AdviseHugePages(void* p, int64_t bytes);

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_HUGE_PAGES_H_
