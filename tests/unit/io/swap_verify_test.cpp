// verify_swap: bytes changed behind the engine's back are caught on read, with the tensor and
// extent named; partial and failed writes never cause false alarms.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "src/io/extent_checksums.h"
#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::first_mismatch;
using testing::make_options;
using testing::random_buffer;
using testing::TempDirs;

constexpr std::size_t kPiece = kVerifyPieceBytes;

TEST(ExtentChecksumsTest, OnlyWholePiecesWrittenAreChecked) {
  ExtentChecksums sums;
  const Extent e{0, 5 * kPiece - 8192};  // the last piece is short
  sums.add(e, "t");
  Rng rng(1);
  AlignedBuffer data = random_buffer(e.size_bytes, rng);
  EXPECT_TRUE(sums.expect_read(e, 0, e.size_bytes).pieces.empty()) << "nothing written yet";

  sums.record_write(e, 0, data.data(), e.size_bytes);
  ExtentChecksums::ReadCheck all = sums.expect_read(e, 0, e.size_bytes);
  EXPECT_EQ(all.what, "t");
  ASSERT_EQ(all.pieces.size(), 5u);
  EXPECT_EQ(all.pieces[4].size_bytes, kPiece - 8192);
  EXPECT_FALSE(ExtentChecksums::check(all, data.data()).has_value());
  EXPECT_EQ(ExtentChecksums::bytes_checked(all), e.size_bytes);

  // A read from inside piece 1 to the end covers pieces 2..4 entirely.
  ExtentChecksums::ReadCheck tail =
      sums.expect_read(e, kPiece + 4096, e.size_bytes - kPiece - 4096);
  ASSERT_EQ(tail.pieces.size(), 3u);
  EXPECT_EQ(tail.pieces[0].offset_in_extent, 2 * kPiece);
  EXPECT_EQ(tail.pieces[0].offset_in_buf, kPiece - 4096);
  EXPECT_FALSE(ExtentChecksums::check(tail, data.data() + kPiece + 4096).has_value());

  // Part of piece 2 rewritten: piece 2 is unknown now, the others still checked.
  sums.record_write(e, 2 * kPiece + 4096, data.data(), 4096);
  all = sums.expect_read(e, 0, e.size_bytes);
  ASSERT_EQ(all.pieces.size(), 4u);
  for (const auto& p : all.pieces) EXPECT_NE(p.offset_in_extent, 2 * kPiece);

  // A flipped byte in piece 3 is found, with both checksums.
  AlignedBuffer bad(e.size_bytes);
  std::memcpy(bad.data(), data.data(), e.size_bytes);
  bad.data()[3 * kPiece + 17] ^= std::byte{1};
  const auto m = ExtentChecksums::check(all, bad.data());
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->piece.offset_in_extent, 3 * kPiece);
  EXPECT_NE(m->actual, m->piece.sum);

  sums.forget(e, 0, kPiece);
  EXPECT_EQ(sums.expect_read(e, 0, e.size_bytes).pieces.size(), 3u);
  sums.remove(e);
  EXPECT_TRUE(sums.expect_read(e, 0, e.size_bytes).pieces.empty());
}

class SwapVerifyTest : public ::testing::TestWithParam<std::string> {
 protected:
  SwapOptions options(int num_paths) {
    dirs_ = std::make_unique<TempDirs>(num_paths);
    SwapOptions o = make_options(GetParam(), dirs_->paths());
    o.block_size_bytes = kPiece;  // stripe unit = piece: piece p lives in file p % num_paths
    o.verify_swap = true;
    return o;
  }
  std::string file(int i) const {
    return dirs_->paths()[i] + "/strata-" + std::to_string(::getpid()) + ".swap";
  }
  // Flips one byte of the swap file behind the engine's back, through the page cache.
  void corrupt(int file_index, std::uint64_t offset) const {
    const int fd = ::open(file(file_index).c_str(), O_RDWR);
    ASSERT_GE(fd, 0) << file(file_index);
    unsigned char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(offset)), 1);
    byte ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(offset)), 1);
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }
  std::unique_ptr<TempDirs> dirs_;
};

TEST_P(SwapVerifyTest, CorruptedBytesAreReportedWithTensorAndExtent) {
  for (int num_paths : {1, 3}) {
    SCOPED_TRACE(num_paths);
    const SwapOptions o = options(num_paths);
    STRATA_CREATE_SWAP_OR_SKIP(swap, o);
    Rng rng(2);
    auto first = swap->allocate(2 * kPiece, "layer0.exp_avg");
    auto e = swap->allocate(5 * kPiece - 4096, "layer3.exp_avg_sq");
    ASSERT_TRUE(first.is_ok() && e.is_ok());
    ASSERT_EQ(e->offset, 2 * kPiece);
    AlignedBuffer data = random_buffer(e->size_bytes, rng);
    AlignedBuffer other = random_buffer(first->size_bytes, rng);
    ASSERT_TRUE(swap->write(*first, 0, other.data(), other.size()).wait().is_ok());
    ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());

    // The extent's piece 2 is swap unit 4: file 4 % n at offset (4 / n) * kPiece.
    const std::uint64_t unit = 4;
    corrupt(static_cast<int>(unit % num_paths), (unit / num_paths) * kPiece + 1000);

    AlignedBuffer back(e->size_bytes);
    const Status s = swap->read(*e, 0, back.data(), back.size()).wait();
    ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
    const std::string& msg = s.message();
    EXPECT_NE(msg.find("checksum mismatch reading 'layer3.exp_avg_sq'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bytes " + std::to_string(2 * kPiece) + ".." + std::to_string(3 * kPiece) +
                       " of its extent (swap offset " + std::to_string(2 * kPiece) + ", " +
                       std::to_string(e->size_bytes) + " bytes)"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(file(static_cast<int>(unit % num_paths)) + " at offset " +
                       std::to_string((unit / num_paths) * kPiece)),
              std::string::npos)
        << msg;
    EXPECT_EQ(swap->stats().checksum_errors, 1u);

    // The pieces around it are fine, and so is the other tensor.
    ASSERT_TRUE(swap->read(*e, 0, back.data(), 2 * kPiece).wait().is_ok());
    EXPECT_EQ(first_mismatch(back.data(), data.data(), 2 * kPiece), -1);
    ASSERT_TRUE(swap->read(*e, 3 * kPiece, back.data(), e->size_bytes - 3 * kPiece).wait().is_ok());
    ASSERT_TRUE(swap->read(*first, 0, back.data(), first->size_bytes).wait().is_ok());
    EXPECT_EQ(first_mismatch(back.data(), other.data(), first->size_bytes), -1);

    // Rewriting the tensor heals it.
    ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());
    ASSERT_TRUE(swap->read(*e, 0, back.data(), back.size()).wait().is_ok());
    EXPECT_EQ(first_mismatch(back.data(), data.data(), back.size()), -1);
    EXPECT_GT(swap->stats().verified_bytes, 0u);
  }
}

// A piece last written only in part is not checked (its checksum is unknown), while the whole
// pieces around it still are.
TEST_P(SwapVerifyTest, PartlyRewrittenPieceIsNotChecked) {
  const SwapOptions o = options(1);
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(3);
  auto e = swap->allocate(3 * kPiece, "w");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());
  AlignedBuffer patch = random_buffer(4096, rng);
  ASSERT_TRUE(swap->write(*e, kPiece + 8192, patch.data(), 4096).wait().is_ok());
  corrupt(0, kPiece + 100);  // inside the unknown piece: cannot be caught
  AlignedBuffer back(e->size_bytes);
  EXPECT_TRUE(swap->read(*e, 0, back.data(), back.size()).wait().is_ok());
  corrupt(0, 2 * kPiece + 100);  // inside a known piece: caught
  const Status s = swap->read(*e, 0, back.data(), back.size()).wait();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
  EXPECT_NE(s.message().find("bytes " + std::to_string(2 * kPiece)), std::string::npos);
}

// A write that failed leaves its pieces unknown, so reading them back is not a false alarm.
TEST_P(SwapVerifyTest, FailedWriteForgetsItsChecksums) {
  SwapOptions o = options(1);
  FaultRule r;
  r.op = FaultOp::kWrite;
  r.kind = FaultKind::kError;
  r.error = EIO;
  r.skip = 3 + 1;  // the first write's three chunks pass; the second write's second chunk fails
  o.fault_injection.rules = {r};
  o.queue_depth = 1;
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(4);
  auto e = swap->allocate(3 * kPiece, "half");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer old_data = random_buffer(e->size_bytes, rng);
  AlignedBuffer new_data = random_buffer(e->size_bytes, rng);
  ASSERT_TRUE(swap->write(*e, 0, old_data.data(), old_data.size()).wait().is_ok());
  EXPECT_EQ(swap->write(*e, 0, new_data.data(), new_data.size()).wait().code(),
            StatusCode::kIoError);
  AlignedBuffer back(e->size_bytes);
  EXPECT_TRUE(swap->read(*e, 0, back.data(), back.size()).wait().is_ok());
  EXPECT_EQ(swap->stats().checksum_errors, 0u);
}

// Random overwrites and reads of random ranges against a mirror: never a false alarm.
TEST_P(SwapVerifyTest, RandomTrafficHasNoFalseAlarms) {
  const SwapOptions o = options(3);
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(5);
  struct Item {
    Extent extent;
    AlignedBuffer mirror;
  };
  std::vector<Item> items;
  for (int i = 0; i < 6; ++i) {
    auto e = swap->allocate(1 + rng.uniform_int(6 * kPiece), "t" + std::to_string(i));
    ASSERT_TRUE(e.is_ok());
    items.push_back({*e, random_buffer(e->size_bytes, rng)});
    ASSERT_TRUE(swap->write(*e, 0, items.back().mirror.data(), e->size_bytes).wait().is_ok());
  }
  for (int i = 0; i < 80; ++i) {
    Item& it = items[rng.uniform_int(items.size())];
    const std::uint64_t blocks = it.extent.size_bytes / kIoAlignBytes;
    const std::uint64_t first = rng.uniform_int(blocks);
    const std::uint64_t count = 1 + rng.uniform_int(blocks - first);
    const std::uint64_t off = first * kIoAlignBytes;
    const std::size_t n = count * kIoAlignBytes;
    if (rng.uniform_int(2) == 0) {
      AlignedBuffer d = random_buffer(n, rng);
      ASSERT_TRUE(swap->write(it.extent, off, d.data(), n).wait().is_ok());
      std::memcpy(it.mirror.data() + off, d.data(), n);
    } else {
      AlignedBuffer b(n);
      const Status s = swap->read(it.extent, off, b.data(), n).wait();
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      ASSERT_EQ(first_mismatch(b.data(), it.mirror.data() + off, n), -1);
    }
  }
  EXPECT_EQ(swap->stats().checksum_errors, 0u);
  EXPECT_GT(swap->stats().verified_bytes, 0u);
}

// Reallocating freed space starts with no checksums and the new tensor's name.
TEST_P(SwapVerifyTest, FreedExtentsForgetTheirChecksums) {
  const SwapOptions o = options(1);
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(6);
  auto e = swap->allocate(2 * kPiece, "old");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());
  swap->free(*e);
  corrupt(0, 10);
  auto again = swap->allocate(2 * kPiece, "new");
  ASSERT_TRUE(again.is_ok());
  ASSERT_EQ(again->offset, e->offset);
  AlignedBuffer back(e->size_bytes);
  EXPECT_TRUE(swap->read(*again, 0, back.data(), back.size()).wait().is_ok());
  ASSERT_TRUE(swap->write(*again, 0, data.data(), data.size()).wait().is_ok());
  corrupt(0, 10);
  const Status s = swap->read(*again, 0, back.data(), back.size()).wait();
  EXPECT_NE(s.message().find("reading 'new'"), std::string::npos) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapVerifyTest,
                         ::testing::Values("uring", "uring_caller", "uring_4rings", "posix"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// Without verify_swap the same corruption goes unnoticed: the check is what catches it.
TEST(SwapVerifyOffTest, CorruptionIsNotDetectedWithoutVerify) {
  TempDirs dirs(1);
  SwapOptions o = make_options("posix", dirs.paths());
  auto created = SwapSpace::create(o);
  ASSERT_TRUE(created.is_ok());
  auto swap = std::move(created).value();
  Rng rng(7);
  auto e = swap->allocate(kPiece, "x");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(kPiece, rng);
  ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());
  const std::string f = dirs.paths()[0] + "/strata-" + std::to_string(::getpid()) + ".swap";
  const int fd = ::open(f.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const char junk = 'x';
  ASSERT_EQ(::pwrite(fd, &junk, 1, 5), 1);
  ::close(fd);
  AlignedBuffer back(kPiece);
  EXPECT_TRUE(swap->read(*e, 0, back.data(), back.size()).wait().is_ok());
  EXPECT_NE(first_mismatch(back.data(), data.data(), kPiece), -1);
  EXPECT_EQ(swap->stats().verified_bytes, 0u);
}

TEST(SwapVerifyMemoryTest, MemoryEngineVerifiesToo) {
  SwapOptions o = make_options("memory", {});
  o.verify_swap = true;
  auto created = SwapSpace::create(o);
  ASSERT_TRUE(created.is_ok());
  auto swap = std::move(created).value();
  Rng rng(8);
  auto e = swap->allocate(3 * kPiece, "m");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());
  AlignedBuffer back(e->size_bytes);
  ASSERT_TRUE(swap->read(*e, 0, back.data(), back.size()).wait().is_ok());
  EXPECT_EQ(swap->stats().verified_bytes, e->size_bytes);
}

}  // namespace
}  // namespace strata::io
