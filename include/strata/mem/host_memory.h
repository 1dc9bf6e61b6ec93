// Pinned host memory for the tiered store: an allocator interface (mlock'd pages on the CPU
// backend; a device's pinned allocator can stand behind it), the fixed staging pool, and the
// size-class cache that holds host-tier copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"

namespace strata::mem {

// Page-granular host memory. Blocks are 4096-aligned (O_DIRECT-ready) and pre-faulted, so the
// first transfer into them does not pay for page faults.
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  virtual Result<void*> allocate(std::size_t size_bytes) = 0;
  virtual void deallocate(void* data, std::size_t size_bytes) = 0;
  // True when blocks are locked in RAM (a device can DMA from them without a bounce).
  virtual bool pinned() const = 0;
};

// Device::allocate_pinned: a huge-page mapping registered with cudaHostRegister on CUDA (what
// its copy streams need to overlap), locked aligned pages on the CPU backend. The tiered store's
// default.
std::unique_ptr<HostAllocator> make_device_host_allocator(device::Device& device);

// The store's staging: one allocation made once (so one registration with io_uring), holding
// first a region for ranged NVMe I/O that one caller uses as it likes (the optimizer's sub-group
// slots; may be empty), then a fixed set of equal buffers for the store's own NVMe<->device
// moves. Not thread-safe; the owner serializes take and give.
class StagingPool {
 public:
  static Result<std::unique_ptr<StagingPool>> create(HostAllocator& allocator,
                                                     std::size_t buffer_bytes, int num_buffers,
                                                     std::size_t range_io_bytes = 0);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Index of a free buffer, or -1 when all are in use.
  int take();
  void give(int index);
  std::byte* data(int index) const {
    return base_ + range_io_bytes_ + static_cast<std::size_t>(index) * bytes_;
  }
  std::size_t buffer_bytes() const { return bytes_; }
  int num_buffers() const { return count_; }
  int num_free() const { return static_cast<int>(free_.size()); }
  std::span<std::byte> range_io() const { return {base_, range_io_bytes_}; }
  // The whole allocation: the range region and every buffer.
  std::span<std::byte> all() const { return {base_, total_bytes()}; }
  std::uint64_t total_bytes() const {
    return range_io_bytes_ + static_cast<std::uint64_t>(bytes_) * count_;
  }

 private:
  StagingPool(HostAllocator& allocator, std::byte* base, std::size_t bytes, int count,
              std::size_t range_io_bytes);
  HostAllocator& allocator_;
  std::byte* base_;
  std::size_t range_io_bytes_;
  std::size_t bytes_;
  int count_;
  std::vector<int> free_;
};

// Host-tier blocks by size class. A class is one page-rounded size; the training loop uses a
// handful (one per parameter-group shape), so a freed block goes back to its class and the next
// request of that shape reuses it exactly: nothing is ever split or merged, so the pattern of one
// step can repeat forever without fragmenting. Blocks of a class no longer wanted are returned
// to the allocator only when the budget needs the room (trim). Not thread-safe.
class HostBlockCache {
 public:
  explicit HostBlockCache(HostAllocator& allocator) : allocator_(allocator) {}
  ~HostBlockCache();
  HostBlockCache(const HostBlockCache&) = delete;
  HostBlockCache& operator=(const HostBlockCache&) = delete;

  static std::size_t class_bytes(std::size_t size_bytes);  // page-rounded
  // A block of class_bytes(size_bytes): a cached one if any, else a new allocation.
  Result<void*> take(std::size_t size_bytes);
  void give(void* data, std::size_t size_bytes);
  // Bytes a take(size_bytes) would add to held_bytes() (0 when a cached block is free).
  std::uint64_t growth_for(std::size_t size_bytes) const;
  // Returns cached free blocks (never of `keep_class`) to the allocator until `bytes` were
  // released or none are left; returns the bytes released.
  std::uint64_t trim(std::uint64_t bytes, std::size_t keep_class = 0);
  std::uint64_t held_bytes() const { return held_; }  // in use + cached
  std::uint64_t cached_bytes() const { return cached_; }

 private:
  HostAllocator& allocator_;
  std::map<std::size_t, std::vector<void*>> free_;  // class bytes -> free blocks
  std::uint64_t held_ = 0;
  std::uint64_t cached_ = 0;
};

}  // namespace strata::mem
