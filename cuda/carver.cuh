// Scratch layout for the CUDA launchers: the caller passes one device buffer, sized by the
// launcher's *ScratchBytes query, and the launcher carves its temporaries out of it. Shared
// by every kernel family; host code only, no TensorFlow headers.

#ifndef TF_TTEMB_CUDA_CARVER_CUH_
#define TF_TTEMB_CUDA_CARVER_CUH_

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace tf_ttemb {
namespace gpu {

// Carves 256-byte aligned sub-buffers out of the caller's scratch; with a null base it only
// counts the bytes, so the size query and the launch share one layout.
class Carver {
 public:
  explicit Carver(void* base)
      : base_(base == nullptr ? nullptr
                              : reinterpret_cast<char*>(
                                    (reinterpret_cast<uintptr_t>(base) + 255) & ~uintptr_t{255})) {}
  template <typename U>
  U* Take(int64_t count) {
    offset_ = (offset_ + 255) & ~size_t{255};
    U* p = base_ == nullptr ? nullptr : reinterpret_cast<U*>(base_ + offset_);
    offset_ += sizeof(U) * static_cast<size_t>(std::max<int64_t>(count, 0));
    return p;
  }
  void* TakeBytes(size_t bytes) { return Take<char>(static_cast<int64_t>(bytes)); }
  // Bytes used, plus room to align an unaligned base.
  size_t bytes() const { return offset_ + 256; }

 private:
  char* base_;
  size_t offset_ = 0;
};

}  // namespace gpu
}  // namespace tf_ttemb

#endif  // TF_TTEMB_CUDA_CARVER_CUH_
