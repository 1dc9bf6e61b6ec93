// Host memory for every buffer that a DMA touches (device copies, O_DIRECT and io_uring I/O):
// the one kind each pinned buffer is made of. Page-aligned, pre-faulted, starting on a 2 MiB
// boundary and advised MADV_HUGEPAGE, so the kernel can back its whole 2 MiB pieces with
// transparent huge pages; locked in RAM on request. The layers above register it: the device
// (Device::allocate_pinned: cudaHostRegister on CUDA), and the tiered store its one staging pool
// with io_uring (SwapSpace::register_buffers).
#pragma once

#include <cstddef>
#include <span>

namespace strata::sys {

// Move-only owner of an anonymous mapping of round_up(size, 4096) bytes aligned to 2 MiB,
// advised MADV_HUGEPAGE before its pages are first touched (then touched, so no fault lands on
// the I/O path). Why huge pages: io_uring registers a huge-page-backed buffer as a few large
// segments, so a 1 MiB request is one DMA segment instead of 256 pages; block devices cap
// segments per request (virtio-blk: often 254), and a request over the cap is split in two; a
// GPU's DMA engine likewise walks fewer page-table entries. Without transparent huge pages
// (disabled, or no 2 MiB pages free) this is ordinary page-aligned memory and everything still
// works. Only whole 2 MiB pieces can be huge: the tail of a size that is not a multiple of
// 2 MiB stays in small pages, so resident memory is the size rounded to a page, not more.
class HostMapping {
 public:
  static constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

  HostMapping() = default;
  // huge_pages = false advises MADV_NOHUGEPAGE (to compare with tools that do not ask).
  // Throws std::bad_alloc when mmap fails.
  explicit HostMapping(std::size_t size_bytes, bool huge_pages = true);
  ~HostMapping();
  HostMapping(HostMapping&& other) noexcept;
  HostMapping& operator=(HostMapping&& other) noexcept;
  HostMapping(const HostMapping&) = delete;
  HostMapping& operator=(const HostMapping&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<std::byte> bytes() { return {data_, size_}; }
  // Locks the pages in RAM (mlock); false when the OS refuses (RLIMIT_MEMLOCK), and the memory
  // stays pageable. Unlocked when the mapping goes.
  bool lock();
  bool locked() const { return locked_; }
  // Bytes of this buffer the kernel backs with huge pages now, from /proc/self/smaps (0 when
  // unknown; approximate when the kernel merged the mapping with a neighbour). Diagnostics.
  std::size_t huge_page_bytes() const;

  // Gives up ownership; the caller later calls unmap(data, size, locked()) with the same size.
  std::byte* release();
  static void unmap(void* data, std::size_t size_bytes, bool locked);

 private:
  void reset();
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  bool locked_ = false;
};

}  // namespace strata::sys
