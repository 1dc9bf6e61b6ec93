// Fallbacks: io_uring unavailable (simulated setup failure) and O_DIRECT refused, each said once,
// clearly, with I/O still correct; and forcing an engine never falls back silently.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::first_mismatch;
using testing::make_options;
using testing::random_buffer;
using testing::TempDirs;

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

void round_trip(SwapSpace& swap, int requests) {
  Rng rng(21);
  for (int i = 0; i < requests; ++i) {
    auto e = swap.allocate((1 + rng.uniform_int(32)) * kIoAlignBytes, "fallback");
    ASSERT_TRUE(e.is_ok());
    AlignedBuffer data = random_buffer(e->size_bytes, rng);
    ASSERT_TRUE(swap.write(*e, 0, data.data(), data.size()).wait().is_ok());
    AlignedBuffer back(e->size_bytes);
    ASSERT_TRUE(swap.read(*e, 0, back.data(), back.size()).wait().is_ok());
    ASSERT_EQ(first_mismatch(back.data(), data.data(), back.size()), -1);
  }
}

TEST(SwapFallbackTest, AutoFallsBackToPosixAndSaysSoOnce) {
  TempDirs dirs(2);
  SwapOptions o = make_options("auto", dirs.paths());
  o.fault_injection.fail_uring_setup = true;
  ::testing::internal::CaptureStderr();
  auto created = SwapSpace::create(o);
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  auto swap = std::move(created).value();
  round_trip(*swap, 20);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(swap->engine_name(), "posix");
  EXPECT_EQ(count(err, "io_uring is not available"), 1u) << err;
  EXPECT_NE(err.find("strata warning: io_uring is not available (io_uring_queue_init failed: "
                     "Operation not permitted (simulated by FaultInjection::fail_uring_setup)); "
                     "swap uses the posix engine (pread/pwrite on 4 threads)"),
            std::string::npos)
      << err;
  ASSERT_EQ(swap->warnings().size(), 1u);
  EXPECT_NE(swap->warnings()[0].find("swap uses the posix engine"), std::string::npos);
}

TEST(SwapFallbackTest, WarningsCanBeKeptQuiet) {
  TempDirs dirs(1);
  SwapOptions o = make_options("auto", dirs.paths());
  o.fault_injection.fail_uring_setup = true;
  o.log_warnings = false;
  ::testing::internal::CaptureStderr();
  auto created = SwapSpace::create(o);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(created.is_ok());
  EXPECT_EQ(err, "");
  EXPECT_EQ((*created)->warnings().size(), 1u);
}

TEST(SwapFallbackTest, ForcedUringRefusesInsteadOfFallingBack) {
  TempDirs dirs(1);
  SwapOptions o = make_options("uring", dirs.paths());
  o.fault_injection.fail_uring_setup = true;
  auto created = SwapSpace::create(o);
  ASSERT_FALSE(created.is_ok());
  EXPECT_EQ(created.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(created.status().message(),
            "engine \"uring\" is not available (use engine \"auto\" or \"posix\"): "
            "io_uring_queue_init failed: Operation not permitted (simulated by "
            "FaultInjection::fail_uring_setup)");
  // Nothing is left behind in the directory.
  EXPECT_TRUE(std::filesystem::is_empty(dirs.paths()[0]));
}

TEST(SwapFallbackTest, ForcedPosixNeverTriesIoUring) {
  TempDirs dirs(1);
  SwapOptions o = make_options("posix", dirs.paths());
  o.fault_injection.fail_uring_setup = true;
  auto created = SwapSpace::create(o);
  ASSERT_TRUE(created.is_ok());
  EXPECT_EQ((*created)->engine_name(), "posix");
  EXPECT_TRUE((*created)->warnings().empty());
}

class SwapDirectRefusedTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SwapDirectRefusedTest, BufferedIoWithOneWarning) {
  TempDirs dirs(2);
  SwapOptions o = make_options(GetParam(), dirs.paths());
  o.fault_injection.refuse_direct = true;
  ::testing::internal::CaptureStderr();
  auto created = SwapSpace::create(o);
  const bool ok = created.is_ok();
  std::unique_ptr<SwapSpace> swap;
  if (ok) {
    swap = std::move(created).value();
    round_trip(*swap, 10);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  if (!ok && GetParam() == "uring" && created.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << created.status().message();
  }
  ASSERT_TRUE(ok) << created.status().to_string();
  const std::string expected = "the file system of " + dirs.paths()[0] + ", " + dirs.paths()[1] +
                               " refuses O_DIRECT; swap there uses buffered I/O";
  EXPECT_EQ(count(err, "refuses O_DIRECT"), 1u) << err;
  EXPECT_NE(err.find(expected), std::string::npos) << err;
  ASSERT_EQ(swap->warnings().size(), 1u);
  EXPECT_NE(swap->warnings()[0].find(expected), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapDirectRefusedTest, ::testing::Values("uring", "posix"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace strata::io
