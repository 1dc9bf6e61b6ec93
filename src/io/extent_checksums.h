// Checksums for verify_swap: each extent's tensor name and one xxh3 per kVerifyPieceBytes piece.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/io/swap.h"

namespace strata::io {

// Thread-safe. Pieces are counted from the extent's start; the last one may be shorter. A piece
// is known once a write covered all of it and unknown before that (or after a failed write), so
// only bytes that were written whole are ever checked.
class ExtentChecksums {
 public:
  struct Piece {
    std::uint64_t offset_in_extent = 0;
    std::uint64_t size_bytes = 0;
    std::uint64_t offset_in_buf = 0;  // where the piece starts in the request's buffer
    std::uint64_t sum = 0;            // xxh3 of the bytes written
  };
  // What a read must find: its tensor and the known pieces it covers entirely.
  struct ReadCheck {
    std::string what;
    Extent extent;
    std::vector<Piece> pieces;
  };
  struct Mismatch {
    Piece piece;
    std::uint64_t actual = 0;
  };

  void add(const Extent& extent, std::string_view what);
  void remove(const Extent& extent);
  // Computes the checksums of the pieces [offset, offset + size_bytes) covers entirely, from the
  // bytes about to be written, and marks pieces it covers in part unknown.
  void record_write(const Extent& extent, std::uint64_t offset, const std::byte* buf,
                    std::size_t size_bytes);
  // A write that failed: its pieces hold unknown bytes now.
  void forget(const Extent& extent, std::uint64_t offset, std::size_t size_bytes);
  ReadCheck expect_read(const Extent& extent, std::uint64_t offset, std::size_t size_bytes) const;
  // The first piece whose bytes in `buf` differ from what was written, if any.
  static std::optional<Mismatch> check(const ReadCheck& check, const std::byte* buf);
  static std::uint64_t bytes_checked(const ReadCheck& check);

 private:
  struct Entry {
    std::string what;
    std::uint64_t size_bytes = 0;
    std::vector<std::uint64_t> sums;
    std::vector<std::uint8_t> known;
  };
  // The first and one-past-last pieces that [offset, offset + size_bytes) covers entirely, and the
  // first and one-past-last it touches at all.
  struct Cover {
    std::uint64_t full_begin, full_end, touched_begin, touched_end;
  };
  static Cover cover(std::uint64_t extent_bytes, std::uint64_t offset, std::uint64_t size_bytes);

  mutable std::mutex mu_;
  std::map<std::uint64_t, Entry> entries_;  // by extent offset
};

}  // namespace strata::io
