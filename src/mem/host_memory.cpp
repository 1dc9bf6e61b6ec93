// Pinned host pages from the device, the staging pool and the host-tier size-class cache.
#include "strata/mem/host_memory.h"

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "strata/core/aligned.h"
#include "strata/core/json.h"
#include "strata/core/logging.h"

namespace strata::mem {
namespace {

class DeviceHostAllocator final : public HostAllocator {
 public:
  explicit DeviceHostAllocator(device::Device& device) : device_(device) {}
  ~DeviceHostAllocator() override {
    STRATA_CHECK(blocks_.empty(), "host allocator destroyed with blocks in use", blocks_.size());
  }

  Result<void*> allocate(std::size_t size_bytes) override {
    STRATA_ASSIGN_OR_RETURN(device::PinnedBuffer b,
                            device_.allocate_pinned(align_up(size_bytes, kPageBytes),
                                                    "the tiered store's host memory"));
    void* p = b.data();
    std::lock_guard lock(mu_);
    if (!b.page_locked()) all_locked_ = false;
    blocks_.emplace(p, std::move(b));
    return p;
  }

  void deallocate(void* data, std::size_t /*size_bytes*/) override {
    if (data == nullptr) return;
    device::PinnedBuffer b;
    {
      std::lock_guard lock(mu_);
      auto it = blocks_.find(data);
      STRATA_CHECK(it != blocks_.end(), "deallocating a block this allocator did not make");
      b = std::move(it->second);
      blocks_.erase(it);
    }
  }

  bool pinned() const override {
    std::lock_guard lock(mu_);
    return all_locked_;
  }

 private:
  device::Device& device_;
  mutable std::mutex mu_;
  std::unordered_map<void*, device::PinnedBuffer> blocks_;
  bool all_locked_ = true;
};

}  // namespace

std::unique_ptr<HostAllocator> make_device_host_allocator(device::Device& device) {
  return std::make_unique<DeviceHostAllocator>(device);
}

// ---- StagingPool ----

Result<std::unique_ptr<StagingPool>> StagingPool::create(HostAllocator& allocator,
                                                         std::size_t buffer_bytes, int num_buffers,
                                                         std::size_t range_io_bytes) {
  if (buffer_bytes == 0 || buffer_bytes % kPageBytes != 0 || num_buffers < 1 ||
      range_io_bytes % kPageBytes != 0) {
    return invalid_argument(
        "staging pool of " + std::to_string(num_buffers) + " buffers of " +
        std::to_string(buffer_bytes) + " bytes and " + std::to_string(range_io_bytes) +
        " for ranged I/O: need at least one buffer, every size a multiple of 4096 bytes");
  }
  const std::size_t total = range_io_bytes + buffer_bytes * static_cast<std::size_t>(num_buffers);
  STRATA_ASSIGN_OR_RETURN(void* base, allocator.allocate(total));
  return std::unique_ptr<StagingPool>(new StagingPool(allocator, static_cast<std::byte*>(base),
                                                      buffer_bytes, num_buffers, range_io_bytes));
}

StagingPool::StagingPool(HostAllocator& allocator, std::byte* base, std::size_t bytes, int count,
                         std::size_t range_io_bytes)
    : allocator_(allocator),
      base_(base),
      range_io_bytes_(range_io_bytes),
      bytes_(bytes),
      count_(count) {
  for (int i = count - 1; i >= 0; --i) free_.push_back(i);
}

StagingPool::~StagingPool() {
  STRATA_CHECK(static_cast<int>(free_.size()) == count_,
               "staging pool destroyed with buffers in use", count_ - free_.size());
  allocator_.deallocate(base_, static_cast<std::size_t>(total_bytes()));
}

int StagingPool::take() {
  if (free_.empty()) return -1;
  const int i = free_.back();
  free_.pop_back();
  return i;
}

void StagingPool::give(int index) {
  STRATA_CHECK(index >= 0 && index < count_, "staging buffer index out of range", index);
  free_.push_back(index);
}

// ---- HostBlockCache ----

std::size_t HostBlockCache::class_bytes(std::size_t size_bytes) {
  return align_up(size_bytes == 0 ? 1 : size_bytes, kPageBytes);
}

HostBlockCache::~HostBlockCache() {
  for (auto& [bytes, blocks] : free_) {
    for (void* b : blocks) allocator_.deallocate(b, bytes);
  }
}

Result<void*> HostBlockCache::take(std::size_t size_bytes) {
  const std::size_t c = class_bytes(size_bytes);
  auto it = free_.find(c);
  if (it != free_.end() && !it->second.empty()) {
    void* b = it->second.back();
    it->second.pop_back();
    cached_ -= c;
    return b;
  }
  STRATA_ASSIGN_OR_RETURN(void* b, allocator_.allocate(c));
  held_ += c;
  return b;
}

void HostBlockCache::give(void* data, std::size_t size_bytes) {
  const std::size_t c = class_bytes(size_bytes);
  free_[c].push_back(data);
  cached_ += c;
}

std::uint64_t HostBlockCache::growth_for(std::size_t size_bytes) const {
  const std::size_t c = class_bytes(size_bytes);
  auto it = free_.find(c);
  return it != free_.end() && !it->second.empty() ? 0 : c;
}

std::uint64_t HostBlockCache::trim(std::uint64_t bytes, std::size_t keep_class) {
  std::uint64_t released = 0;
  for (auto& [c, blocks] : free_) {
    if (c == keep_class) continue;
    while (!blocks.empty() && released < bytes) {
      allocator_.deallocate(blocks.back(), c);
      blocks.pop_back();
      held_ -= c;
      cached_ -= c;
      released += c;
    }
    if (released >= bytes) break;
  }
  return released;
}

}  // namespace strata::mem
