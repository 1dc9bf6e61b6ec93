// First-fit extent allocation with coalescing.
#include "src/io/extent_allocator.h"

#include <iterator>

namespace strata::io {

ExtentAllocator::ExtentAllocator(std::uint64_t alignment) : alignment_(alignment) {
  STRATA_CHECK(alignment_ > 0, "alignment must be positive");
}

std::uint64_t ExtentAllocator::round_up(std::uint64_t size_bytes) const {
  return (size_bytes + alignment_ - 1) / alignment_ * alignment_;
}

std::optional<Extent> ExtentAllocator::allocate(std::uint64_t size_bytes) {
  const std::uint64_t size = round_up(size_bytes);
  if (size == 0) return std::nullopt;
  // First fit in address order keeps the low end dense, so a training loop that frees and
  // reallocates the same sizes lands in the same places instead of creeping upward.
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const Extent extent{it->first, size};
    const std::uint64_t rest = it->second - size;
    free_.erase(it);
    if (rest > 0) free_.emplace(extent.offset + size, rest);
    allocated_.emplace(extent.offset, size);
    used_ += size;
    return extent;
  }
  return std::nullopt;
}

std::uint64_t ExtentAllocator::growth_needed(std::uint64_t size_bytes) const {
  const std::uint64_t size = round_up(size_bytes);
  for (const auto& [offset, len] : free_) {
    if (len >= size) return 0;
  }
  std::uint64_t tail_free = 0;
  if (!free_.empty()) {
    const auto& [offset, len] = *free_.rbegin();
    if (offset + len == capacity_) tail_free = len;
  }
  return size - tail_free;
}

void ExtentAllocator::grow(std::uint64_t new_capacity) {
  STRATA_CHECK(new_capacity >= capacity_ && new_capacity % alignment_ == 0, "bad growth", capacity_,
               new_capacity);
  if (new_capacity == capacity_) return;
  const std::uint64_t added = new_capacity - capacity_;
  if (!free_.empty()) {
    auto last = std::prev(free_.end());
    if (last->first + last->second == capacity_) {
      last->second += added;
      capacity_ = new_capacity;
      return;
    }
  }
  free_.emplace(capacity_, added);
  capacity_ = new_capacity;
}

void ExtentAllocator::free(const Extent& extent) {
  auto a = allocated_.find(extent.offset);
  STRATA_CHECK(a != allocated_.end() && a->second == extent.size_bytes,
               "free of an extent that is not allocated (double free?): offset", extent.offset,
               "size", extent.size_bytes);
  allocated_.erase(a);
  used_ -= extent.size_bytes;

  std::uint64_t offset = extent.offset;
  std::uint64_t size = extent.size_bytes;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += size;
      return;
    }
  }
  free_.emplace(offset, size);
}

bool ExtentAllocator::is_allocated(std::uint64_t offset, std::uint64_t size_bytes) const {
  auto it = allocated_.upper_bound(offset);
  if (it == allocated_.begin()) return false;
  --it;
  return offset + size_bytes <= it->first + it->second;
}

std::uint64_t ExtentAllocator::largest_free() const {
  std::uint64_t best = 0;
  for (const auto& [offset, len] : free_) best = len > best ? len : best;
  return best;
}

}  // namespace strata::io
