// Piece checksums of swap extents (xxh3 from libxxhash).
#include "src/io/extent_checksums.h"

#include <algorithm>

#include "strata/build_config.h"
#include "strata/core/check.h"

#if STRATA_HAVE_XXHASH
#include <xxhash.h>
#endif

namespace strata::io {
namespace {

constexpr std::uint64_t kPiece = kVerifyPieceBytes;

std::uint64_t piece_hash(const std::byte* data, std::size_t size_bytes) {
#if STRATA_HAVE_XXHASH
  return XXH3_64bits(data, size_bytes);
#else
  // SwapSpace::create refuses verify_swap in a build without libxxhash.
  STRATA_CHECK(false, "checksums need libxxhash, which this build lacks", size_bytes);
  (void)data;
  return 0;
#endif
}

std::uint64_t piece_bytes(std::uint64_t extent_bytes, std::uint64_t p) {
  return std::min(kPiece, extent_bytes - p * kPiece);
}

}  // namespace

ExtentChecksums::Cover ExtentChecksums::cover(std::uint64_t extent_bytes, std::uint64_t offset,
                                              std::uint64_t size_bytes) {
  const std::uint64_t end = offset + size_bytes;
  Cover c{};
  c.touched_begin = offset / kPiece;
  c.touched_end = size_bytes == 0 ? c.touched_begin : (end + kPiece - 1) / kPiece;
  c.full_begin = (offset + kPiece - 1) / kPiece;
  // The extent's last piece may be short: reaching the extent's end covers it.
  c.full_end = end == extent_bytes ? c.touched_end : end / kPiece;
  if (c.full_end < c.full_begin) c.full_end = c.full_begin;
  return c;
}

void ExtentChecksums::add(const Extent& extent, std::string_view what) {
  const std::uint64_t pieces = (extent.size_bytes + kPiece - 1) / kPiece;
  std::lock_guard lock(mu_);
  Entry& e = entries_[extent.offset];
  e.what = std::string(what);
  e.size_bytes = extent.size_bytes;
  e.sums.assign(pieces, 0);
  e.known.assign(pieces, 0);
}

void ExtentChecksums::remove(const Extent& extent) {
  std::lock_guard lock(mu_);
  entries_.erase(extent.offset);
}

void ExtentChecksums::record_write(const Extent& extent, std::uint64_t offset, const std::byte* buf,
                                   std::size_t size_bytes) {
  const Cover c = cover(extent.size_bytes, offset, size_bytes);
  // Hash outside the lock: it is the expensive part and touches only the caller's buffer.
  std::vector<std::uint64_t> sums;
  sums.reserve(c.full_end - c.full_begin);
  for (std::uint64_t p = c.full_begin; p < c.full_end; ++p) {
    sums.push_back(piece_hash(buf + (p * kPiece - offset), piece_bytes(extent.size_bytes, p)));
  }
  std::lock_guard lock(mu_);
  auto it = entries_.find(extent.offset);
  if (it == entries_.end()) return;  // freed by another thread meanwhile: nothing to keep
  Entry& e = it->second;
  for (std::uint64_t p = c.touched_begin; p < c.touched_end; ++p) {
    if (p >= c.full_begin && p < c.full_end) {
      e.sums[p] = sums[p - c.full_begin];
      e.known[p] = 1;
    } else {
      e.known[p] = 0;  // partly overwritten: its other bytes are unknown here
    }
  }
}

void ExtentChecksums::forget(const Extent& extent, std::uint64_t offset, std::size_t size_bytes) {
  const Cover c = cover(extent.size_bytes, offset, size_bytes);
  std::lock_guard lock(mu_);
  auto it = entries_.find(extent.offset);
  if (it == entries_.end() || it->second.size_bytes != extent.size_bytes) return;  // freed since
  for (std::uint64_t p = c.touched_begin; p < c.touched_end; ++p) it->second.known[p] = 0;
}

ExtentChecksums::ReadCheck ExtentChecksums::expect_read(const Extent& extent, std::uint64_t offset,
                                                        std::size_t size_bytes) const {
  const Cover c = cover(extent.size_bytes, offset, size_bytes);
  ReadCheck check;
  check.extent = extent;
  std::lock_guard lock(mu_);
  auto it = entries_.find(extent.offset);
  if (it == entries_.end()) return check;  // freed by another thread meanwhile
  const Entry& e = it->second;
  check.what = e.what;
  for (std::uint64_t p = c.full_begin; p < c.full_end; ++p) {
    if (e.known[p] == 0) continue;
    check.pieces.push_back(
        {p * kPiece, piece_bytes(extent.size_bytes, p), p * kPiece - offset, e.sums[p]});
  }
  return check;
}

std::optional<ExtentChecksums::Mismatch> ExtentChecksums::check(const ReadCheck& check,
                                                                const std::byte* buf) {
  for (const Piece& p : check.pieces) {
    const std::uint64_t actual = piece_hash(buf + p.offset_in_buf, p.size_bytes);
    if (actual != p.sum) return Mismatch{p, actual};
  }
  return std::nullopt;
}

std::uint64_t ExtentChecksums::bytes_checked(const ReadCheck& check) {
  std::uint64_t n = 0;
  for (const Piece& p : check.pieces) n += p.size_bytes;
  return n;
}

}  // namespace strata::io
