// Host staging buffers for swap I/O: aligned, pre-faulted, and backed by transparent huge pages
// where the kernel offers them, which is what registered buffers want.
#pragma once

#include <cstddef>
#include <span>

namespace strata::io {

// Move-only owner of anonymous memory aligned to 2 MiB, advised MADV_HUGEPAGE before its pages
// are first touched (then touched, so no fault lands on the I/O path). Why huge pages: io_uring
// registers a huge-page-backed buffer as a few large segments, so a 1 MiB request is one DMA
// segment instead of 256 pages; block devices cap segments per request (virtio-blk: often 254),
// and a request over the cap is split in two. Without transparent huge pages (disabled, or no
// 2 MiB pages free) this is ordinary page-aligned memory and everything still works.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  // huge_pages = false leaves the memory in ordinary pages (to compare with tools that do).
  // Throws std::bad_alloc when mmap fails.
  explicit StagingBuffer(std::size_t size_bytes, bool huge_pages = true);
  ~StagingBuffer();
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<std::byte> bytes() { return {data_, size_}; }
  // Bytes of this buffer the kernel backs with huge pages now, from /proc/self/smaps (0 when
  // unknown; approximate when the kernel merged the mapping with a neighbour). Diagnostics.
  std::size_t huge_page_bytes() const;

 private:
  void release();
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;  // size_ rounded up to the huge page size
};

}  // namespace strata::io
