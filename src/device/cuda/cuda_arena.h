// First-fit allocator of byte ranges inside one fixed arena (the CUDA device's single
// cudaMalloc of device_memory_limit bytes). Pure bookkeeping on offsets, so it is tested
// without a GPU.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <unordered_map>

namespace strata::device::cuda {

class ArenaAllocator {
 public:
  // Every block starts and ends on this boundary: enough for any vector load and for cuBLAS.
  static constexpr std::size_t kAlignBytes = 256;
  static constexpr std::size_t round(std::size_t bytes) {
    return (bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
  }

  // capacity_bytes is rounded down to kAlignBytes.
  explicit ArenaAllocator(std::size_t capacity_bytes);

  // Offset of the lowest free range of round(size_bytes) bytes, or nullopt if none is large
  // enough. size_bytes must be positive.
  std::optional<std::size_t> allocate(std::size_t size_bytes);
  // Returns the block at `offset` (from allocate) and merges it with free neighbours.
  void free(std::size_t offset);

  std::size_t capacity() const { return capacity_; }
  std::size_t free_bytes() const { return free_bytes_; }
  std::size_t largest_free_block() const;
  std::size_t num_free_blocks() const { return free_.size(); }
  std::size_t num_used_blocks() const { return used_.size(); }

 private:
  std::size_t capacity_;
  std::size_t free_bytes_;
  std::map<std::size_t, std::size_t> free_;            // offset -> size, address order
  std::unordered_map<std::size_t, std::size_t> used_;  // offset -> size
};

}  // namespace strata::device::cuda
