// AlignedBuffer: aligned_alloc plus an up-front touch of every page.
#include "strata/core/aligned.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "strata/core/check.h"

namespace strata {

AlignedBuffer::AlignedBuffer(std::size_t size_bytes, std::size_t alignment) {
  STRATA_CHECK((alignment & (alignment - 1)) == 0, "alignment must be a power of two", alignment);
  if (size_bytes == 0) return;
  const std::size_t rounded = align_up(size_bytes, alignment);
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  data_ = static_cast<std::byte*>(p);
  size_ = size_bytes;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace strata
