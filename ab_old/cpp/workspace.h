// Carves typed arrays out of the caller's workspace (or, with a null base, only counts the bytes).
#pragma once

#include <cstddef>
#include <cstdint>

namespace cutlass_moe {

constexpr size_t kWorkspaceAlignment = 256;

inline size_t align_up(size_t bytes, size_t alignment = kWorkspaceAlignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}

  // `count` elements of T, kWorkspaceAlignment-aligned; nullptr when only counting.
  template <class T>
  T* take(size_t count) {
    T* ptr = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += align_up(sizeof(T) * count);
    return ptr;
  }

  void* rest() const { return base_ ? base_ + offset_ : nullptr; }
  size_t bytes() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

}  // namespace cutlass_moe
