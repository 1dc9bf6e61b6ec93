// FileIo: named files round trip at any size, offset and buffer alignment on io_uring and the
// posix engine; its errors name the file and the operation; a write never truncates.
#include "strata/io/file_io.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::first_mismatch;
using testing::random_buffer;
using testing::TempDir;

class FileIoTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<FileIo> make(std::size_t block = 64 * 1024) {
    FileIoOptions o;
    o.engine = parse_swap_engine(GetParam()).value();
    o.block_size_bytes = block;
    o.queue_depth = 8;
    o.max_open_files = 2;  // small: the table fills and is emptied in these tests
    auto io = FileIo::create(o);
    if (!io.is_ok() && io.status().code() == StatusCode::kUnavailable) return nullptr;
    EXPECT_TRUE(io.is_ok()) << io.status().to_string();
    return io.is_ok() ? std::move(*io) : nullptr;
  }
};

// Aligned and unaligned buffers, offsets and lengths (the body by O_DIRECT, the rest through the
// page cache), several files at once past the table's size, and a block size smaller than a
// request.
TEST_P(FileIoTest, RoundTripsAtAnySizeOffsetAndAlignment) {
  auto io = make();
  if (io == nullptr) GTEST_SKIP() << "io_uring unavailable";
  TempDir dir;
  Rng rng(7);
  struct Case {
    std::size_t size;
    std::uint64_t offset;
    std::size_t buffer_shift;  // bytes past an aligned start
  };
  const Case cases[] = {{1, 0, 0},         {4095, 0, 0},    {4096, 4096, 0},
                        {4097, 0, 0},      {200000, 13, 0}, {3 * 65536 + 17, 8192, 0},
                        {65536 * 5, 0, 8}, {12288, 4096, 1}};
  std::vector<AlignedBuffer> written, back;
  std::vector<std::string> paths;
  for (std::size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    written.push_back(random_buffer(c.size + c.buffer_shift, rng));
    back.emplace_back(c.size + c.buffer_shift);
    paths.push_back(dir.path() + "/tensor-" + std::to_string(i));
    ASSERT_TRUE(io->write(paths[i], c.offset, written[i].data() + c.buffer_shift, c.size).is_ok());
  }
  auto done = io->wait();
  ASSERT_TRUE(done.is_ok()) << done.status().to_string();
  EXPECT_EQ(*done, static_cast<std::int64_t>(std::size(cases)));
  for (std::size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    EXPECT_EQ(std::filesystem::file_size(paths[i]), c.offset + c.size) << paths[i];
    ASSERT_TRUE(io->read(paths[i], c.offset, back[i].data() + c.buffer_shift, c.size).is_ok());
  }
  done = io->wait();
  ASSERT_TRUE(done.is_ok()) << done.status().to_string();
  for (std::size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    EXPECT_EQ(
        first_mismatch(written[i].data() + c.buffer_shift, back[i].data() + c.buffer_shift, c.size),
        -1)
        << "case " << i << ": size " << c.size << " offset " << c.offset;
  }
}

TEST_P(FileIoTest, ErrorsNameTheFileAndTheOperation) {
  auto io = make();
  if (io == nullptr) GTEST_SKIP() << "io_uring unavailable";
  TempDir dir;
  AlignedBuffer buf(8192);
  const std::string missing = dir.path() + "/missing";
  const Status open = io->read(missing, 0, buf.data(), 4096);
  EXPECT_EQ(open.code(), StatusCode::kNotFound);
  EXPECT_NE(open.message().find("cannot open " + missing + " for reading"), std::string::npos)
      << open.message();
  const std::string small = dir.path() + "/small";
  ASSERT_TRUE(io->write(small, 0, buf.data(), 100).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  ASSERT_TRUE(io->read(small, 0, buf.data(), 8192).is_ok());
  const auto short_read = io->wait();
  ASSERT_FALSE(short_read.is_ok());
  EXPECT_NE(short_read.status().message().find(small), std::string::npos)
      << short_read.status().message();
  EXPECT_NE(short_read.status().message().find("unexpected end of file"), std::string::npos)
      << short_read.status().message();
  EXPECT_NE(short_read.status().message().find("read of"), std::string::npos);
  // The next wait starts afresh.
  auto none = io->wait();
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(*none, 0);
}

TEST_P(FileIoTest, AWriteNeverTruncatesAndZeroBytesCount) {
  auto io = make();
  if (io == nullptr) GTEST_SKIP() << "io_uring unavailable";
  TempDir dir;
  Rng rng(3);
  AlignedBuffer first = random_buffer(8192, rng), patch = random_buffer(10, rng), back(8192);
  const std::string path = dir.path() + "/f";
  ASSERT_TRUE(io->write(path, 0, first.data(), 8192).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  ASSERT_TRUE(io->write(path, 0, patch.data(), 10).is_ok());
  ASSERT_TRUE(io->write(path, 0, patch.data(), 0).is_ok());
  auto n = io->wait();
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(*n, 2);
  EXPECT_EQ(std::filesystem::file_size(path), 8192u);
  ASSERT_TRUE(io->read(path, 0, back.data(), 8192).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  EXPECT_EQ(first_mismatch(back.data(), patch.data(), 10), -1);
  EXPECT_EQ(first_mismatch(back.data() + 10, first.data() + 10, 8182), -1);
}

// A file removed and made again between waits is the new file, not the old one's descriptor.
TEST_P(FileIoTest, AFileReplacedAfterAWaitIsOpenedAfresh) {
  auto io = make();
  if (io == nullptr) GTEST_SKIP() << "io_uring unavailable";
  TempDir dir;
  Rng rng(5);
  AlignedBuffer a = random_buffer(4096, rng), back(4096);
  const std::string path = dir.path() + "/f";
  ASSERT_TRUE(io->write(path, 0, a.data(), 4096).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  std::filesystem::remove(path);
  ASSERT_TRUE(io->write(path, 0, a.data(), 4096).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  ASSERT_TRUE(std::filesystem::exists(path));
  ASSERT_TRUE(io->read(path, 0, back.data(), 4096).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  EXPECT_EQ(first_mismatch(a.data(), back.data(), 4096), -1);
}

TEST_P(FileIoTest, PinnedBuffersAreAlignedAndRoundTrip) {
  auto io = make();
  if (io == nullptr) GTEST_SKIP() << "io_uring unavailable";
  TempDir dir;
  auto pinned = io->new_pinned(3 << 20);
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  std::byte* p = (*pinned)->data();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % kIoAlignBytes, 0u);
  Rng rng(11);
  testing::fill_random(p, 3 << 20, rng);
  const std::vector<std::byte> want(p, p + (3 << 20));
  const std::string path = dir.path() + "/pinned";
  ASSERT_TRUE(io->write(path, 0, p, 3 << 20).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  std::fill(p, p + (3 << 20), std::byte{0});
  ASSERT_TRUE(io->read(path, 0, p, 3 << 20).is_ok());
  ASSERT_TRUE(io->wait().is_ok());
  EXPECT_EQ(first_mismatch(p, want.data(), want.size()), -1);
  EXPECT_TRUE(io->free_pinned(p).is_ok());
  EXPECT_EQ(io->free_pinned(p).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Engines, FileIoTest, ::testing::Values("uring", "posix"),
                         [](const auto& info) { return info.param; });

TEST(FileIoOptionsTest, BadOptionsAreRefusedByName) {
  FileIoOptions o;
  o.engine = SwapEngine::kMemory;
  EXPECT_NE(FileIo::create(o).status().message().find("memory"), std::string::npos);
  o = FileIoOptions{};
  o.block_size_bytes = 1000;
  EXPECT_NE(FileIo::create(o).status().message().find("block_size 1000"), std::string::npos);
  o = FileIoOptions{};
  o.queue_depth = 0;
  EXPECT_NE(FileIo::create(o).status().message().find("queue_depth 0"), std::string::npos);
}

}  // namespace
}  // namespace strata::io
