// First-fit extent allocator over a growable byte range, with coalescing of free neighbours.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

#include "strata/io/swap.h"

namespace strata::io {

// Not thread-safe: the swap space serializes calls. Sizes are rounded up to `alignment`.
class ExtentAllocator {
 public:
  explicit ExtentAllocator(std::uint64_t alignment = kIoAlignBytes);

  std::uint64_t round_up(std::uint64_t size_bytes) const;
  // First fit within the current capacity, or nothing if no free extent is large enough.
  std::optional<Extent> allocate(std::uint64_t size_bytes);
  // How far capacity must grow for allocate(size_bytes) to succeed: the request less the free
  // extent that already touches the end. 0 if it fits now.
  std::uint64_t growth_needed(std::uint64_t size_bytes) const;
  // Adds [capacity, new_capacity) as free space (merged with a free extent at the end).
  void grow(std::uint64_t new_capacity);
  // The extent must be exactly one returned by allocate() and not yet freed (checked).
  void free(const Extent& extent);
  // Whether [offset, offset + size_bytes) lies inside one allocated extent.
  bool is_allocated(std::uint64_t offset, std::uint64_t size_bytes) const;

  std::uint64_t capacity() const { return capacity_; }
  std::uint64_t used_bytes() const { return used_; }
  std::uint64_t largest_free() const;
  std::size_t num_free_extents() const { return free_.size(); }

 private:
  const std::uint64_t alignment_;
  std::uint64_t capacity_ = 0;
  std::uint64_t used_ = 0;
  std::map<std::uint64_t, std::uint64_t> free_;       // offset -> size, never adjacent
  std::map<std::uint64_t, std::uint64_t> allocated_;  // offset -> size
};

}  // namespace strata::io
