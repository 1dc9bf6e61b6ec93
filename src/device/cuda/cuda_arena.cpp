// First-fit arena allocator with coalescing of neighbouring free blocks.
#include "src/device/cuda/cuda_arena.h"

#include <algorithm>
#include <iterator>

#include "strata/core/check.h"

namespace strata::device::cuda {

ArenaAllocator::ArenaAllocator(std::size_t capacity_bytes)
    : capacity_(capacity_bytes / kAlignBytes * kAlignBytes), free_bytes_(capacity_) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<std::size_t> ArenaAllocator::allocate(std::size_t size_bytes) {
  STRATA_CHECK(size_bytes > 0, "arena allocation of zero bytes");
  const std::size_t size = round(size_bytes);
  // First fit in address order keeps long-lived blocks (weights, optimizer state) packed at
  // the bottom and the churn of per-layer buffers above them.
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const std::size_t offset = it->first, remaining = it->second - size;
    free_.erase(it);
    if (remaining > 0) free_.emplace(offset + size, remaining);
    used_.emplace(offset, size);
    free_bytes_ -= size;
    return offset;
  }
  return std::nullopt;
}

void ArenaAllocator::free(std::size_t offset) {
  const auto used = used_.find(offset);
  STRATA_CHECK(used != used_.end(), "freeing an arena offset that is not allocated", offset);
  std::size_t start = offset, size = used->second;
  used_.erase(used);
  free_bytes_ += size;
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + size) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, size);
}

std::size_t ArenaAllocator::largest_free_block() const {
  std::size_t best = 0;
  for (const auto& [offset, size] : free_) best = std::max(best, size);
  return best;
}

}  // namespace strata::device::cuda
