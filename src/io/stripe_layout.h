// RAID-0 mapping from swap-space offsets to (file, file offset) over equally sized files.
#pragma once

#include <cstdint>
#include <vector>

#include "strata/core/check.h"

namespace strata::io {

// Swap space is cut into units of unit_bytes dealt round-robin to the files: unit u lives in
// file u % num_files at file offset (u / num_files) * unit_bytes. Capacity grows by whole rows
// (one unit per file), so every file has the same size. With one file the mapping is identity.
class StripeLayout {
 public:
  struct Piece {
    int file = 0;
    std::uint64_t file_offset = 0;
    std::uint64_t swap_offset = 0;
    std::uint64_t size_bytes = 0;
  };

  StripeLayout(int num_files, std::uint64_t unit_bytes)
      : num_files_(num_files), unit_bytes_(unit_bytes) {
    STRATA_CHECK(num_files_ > 0 && unit_bytes_ > 0, "bad stripe layout", num_files_, unit_bytes_);
  }

  int num_files() const { return num_files_; }
  std::uint64_t unit_bytes() const { return unit_bytes_; }
  std::uint64_t row_bytes() const { return unit_bytes_ * static_cast<std::uint64_t>(num_files_); }
  std::uint64_t round_up_to_rows(std::uint64_t bytes) const {
    return (bytes + row_bytes() - 1) / row_bytes() * row_bytes();
  }
  // Size of each file when the swap space holds `capacity` bytes (a multiple of row_bytes()).
  std::uint64_t file_bytes(std::uint64_t capacity) const { return capacity / num_files_; }

  Piece locate(std::uint64_t swap_offset) const {
    const std::uint64_t unit = swap_offset / unit_bytes_;
    const std::uint64_t within = swap_offset % unit_bytes_;
    return {static_cast<int>(unit % static_cast<std::uint64_t>(num_files_)),
            (unit / static_cast<std::uint64_t>(num_files_)) * unit_bytes_ + within, swap_offset,
            unit_bytes_ - within};
  }

  // Splits [swap_offset, swap_offset + size_bytes) at unit boundaries, so no piece is larger than
  // a unit and each lies in one file.
  void split(std::uint64_t swap_offset, std::uint64_t size_bytes, std::vector<Piece>& out) const {
    out.clear();
    while (size_bytes > 0) {
      Piece p = locate(swap_offset);
      if (p.size_bytes > size_bytes) p.size_bytes = size_bytes;
      out.push_back(p);
      swap_offset += p.size_bytes;
      size_bytes -= p.size_bytes;
    }
  }

 private:
  int num_files_;
  std::uint64_t unit_bytes_;
};

}  // namespace strata::io
