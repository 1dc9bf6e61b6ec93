// HostMapping: 2 MiB-aligned anonymous mappings advised for transparent huge pages.
#include "strata/sys/host_mapping.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <utility>

#include "strata/core/aligned.h"

namespace strata::sys {

HostMapping::HostMapping(std::size_t size_bytes, bool huge_pages) {
  if (size_bytes == 0) return;
  const std::size_t mapped = align_up(size_bytes, kPageBytes);
  // Over-map by one huge page and trim, so the start is 2 MiB aligned.
  const std::size_t span = mapped + kHugePageBytes;
  void* p = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  const auto base = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t start = (base + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  if (start > base) ::munmap(p, start - base);
  const std::uintptr_t end = start + mapped;
  if (base + span > end) ::munmap(reinterpret_cast<void*>(end), base + span - end);
  // Advice only: kernels without THP (or with it disabled) refuse it, and small pages are fine.
  ::madvise(reinterpret_cast<void*>(start), mapped, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  data_ = reinterpret_cast<std::byte*>(start);
  size_ = size_bytes;
  std::memset(data_, 0, mapped);  // fault every page in now, not on the I/O path
}

HostMapping::~HostMapping() { reset(); }

HostMapping::HostMapping(HostMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      locked_(std::exchange(other.locked_, false)) {}

HostMapping& HostMapping::operator=(HostMapping&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    locked_ = std::exchange(other.locked_, false);
  }
  return *this;
}

bool HostMapping::lock() {
  if (data_ != nullptr && !locked_) locked_ = ::mlock(data_, align_up(size_, kPageBytes)) == 0;
  return locked_;
}

std::byte* HostMapping::release() {
  size_ = 0;
  locked_ = false;
  return std::exchange(data_, nullptr);
}

void HostMapping::unmap(void* data, std::size_t size_bytes, bool locked) {
  if (data == nullptr) return;
  if (locked) ::munlock(data, align_up(size_bytes, kPageBytes));
  ::munmap(data, align_up(size_bytes, kPageBytes));
}

void HostMapping::reset() {
  unmap(data_, size_, locked_);
  data_ = nullptr;
  size_ = 0;
  locked_ = false;
}

std::size_t HostMapping::huge_page_bytes() const {
  if (data_ == nullptr) return 0;
  // smaps lists each mapping as "start-end perms ..." followed by its fields; our buffer is one
  // mapping, or part of one the kernel merged with a neighbour.
  std::ifstream smaps("/proc/self/smaps");
  const auto begin = reinterpret_cast<std::uintptr_t>(data_);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    const auto dash = line.find('-');
    const auto space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space &&
        line.find_first_not_of("0123456789abcdef") == dash) {
      const std::uintptr_t lo = std::stoull(line.substr(0, dash), nullptr, 16);
      const std::uintptr_t hi = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
      inside = lo <= begin && begin < hi;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      // "AnonHugePages:   2048 kB"; a mapping merged with a neighbour may count more than ours.
      return std::min<std::size_t>(std::stoull(line.substr(14)) * 1024, size_);
    }
  }
  return 0;
}

}  // namespace strata::sys
