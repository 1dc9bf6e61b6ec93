// sys::HostMapping: alignment, zero fill, moves, and registered-buffer I/O through it.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>

#include "strata/sys/host_mapping.h"
#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::first_mismatch;
using testing::make_options;
using testing::TempDirs;

TEST(HostMappingTest, AlignedZeroedAndMovable) {
  sys::HostMapping empty;
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.huge_page_bytes(), 0u);

  sys::HostMapping b(3 * 1024 * 1024 + 4096);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(b.size(), 3u * 1024 * 1024 + 4096);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % (2u << 20), 0u);
  for (std::size_t i = 0; i < b.size(); i += 4096) ASSERT_EQ(b.data()[i], std::byte{0}) << i;
  b.data()[b.size() - 1] = std::byte{7};

  // Locked where RLIMIT_MEMLOCK allows; the lock moves with the mapping.
  EXPECT_FALSE(b.locked());
  const bool locked = b.lock();
  EXPECT_EQ(b.locked(), locked);
  std::byte* const p = b.data();
  sys::HostMapping moved(std::move(b));
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(moved.locked(), locked);
  EXPECT_FALSE(b.locked());      // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  sys::HostMapping other(4096);
  other = std::move(moved);
  EXPECT_EQ(other.data(), p);
  EXPECT_EQ(other.data()[other.size() - 1], std::byte{7});

  // Where the kernel offers transparent huge pages on request, say whether it gave us some.
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(thp, mode);
  std::printf("THP mode '%s': %zu of %zu bytes in huge pages\n", mode.c_str(),
              other.huge_page_bytes(), other.size());
}

TEST(HostMappingTest, RegisteredStagingRoundTrip) {
  for (const std::string engine : {"uring", "uring_caller", "posix"}) {
    SCOPED_TRACE(engine);
    TempDirs dirs(2);
    SwapOptions o = make_options(engine, dirs.paths());
    o.block_size_bytes = 1 << 20;
    auto created = SwapSpace::create(o);
    if (!created.is_ok() && o.engine == SwapEngine::kUring) continue;  // covered by skips elsewhere
    ASSERT_TRUE(created.is_ok()) << created.status().to_string();
    auto swap = std::move(created).value();
    sys::HostMapping staging(8 << 20);
    const std::span<std::byte> whole = staging.bytes();
    auto registration = swap->register_buffers({&whole, 1});
    ASSERT_TRUE(registration.is_ok()) << registration.status().to_string();
    Rng rng(31);
    testing::fill_random(staging.data(), 4 << 20, rng);
    auto e = swap->allocate(4 << 20, "staged");
    ASSERT_TRUE(e.is_ok());
    ASSERT_TRUE(swap->write(*e, 0, staging.data(), 4 << 20).wait().is_ok());
    ASSERT_TRUE(swap->read(*e, 0, staging.data() + (4 << 20), 4 << 20).wait().is_ok());
    EXPECT_EQ(first_mismatch(staging.data(), staging.data() + (4 << 20), 4 << 20), -1);
    EXPECT_EQ(swap->stats().fixed_chunks, o.engine == SwapEngine::kUring ? 8u : 0u);
  }
}

}  // namespace
}  // namespace strata::io
