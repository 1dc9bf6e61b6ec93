// Swap directories: locking against a second user, reclaiming a dead process's files, and the
// errors for missing, unwritable or wrong paths and bad options.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::make_options;
using testing::TempDir;
using testing::TempDirs;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A pid that certainly belongs to no running process: a child we started and reaped.
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

class SwapDirTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SwapDirTest, SecondSwapSpaceOnTheSameDirectoryIsRefused) {
  TempDirs dirs(2);
  SwapOptions o = make_options(GetParam(), {dirs[0].path()});
  STRATA_CREATE_SWAP_OR_SKIP(first, o);

  // The second one shares only its second directory: refused, naming it and our pid.
  SwapOptions o2 = make_options(GetParam(), {dirs[1].path(), dirs[0].path()});
  auto second = SwapSpace::create(o2);
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(second.status().message(),
            "swap directory " + dirs[0].path() + " is already in use by process " +
                std::to_string(::getpid()) + " (it holds " + dirs[0].path() +
                "/strata.lock); give each run its own directory in swap_paths, or stop process " +
                std::to_string(::getpid()));
  // The directory it did take was released again.
  EXPECT_TRUE(std::filesystem::is_empty(dirs[1].path()));

  // Once the first is gone the directory is free again.
  first.reset();
  EXPECT_TRUE(std::filesystem::is_empty(dirs[0].path()));
  auto third = SwapSpace::create(o);
  EXPECT_TRUE(third.is_ok()) << third.status().to_string();
}

TEST_P(SwapDirTest, StaleLockAndSwapFileOfADeadProcessAreReclaimed) {
  TempDir dir;
  const pid_t dead = dead_pid();
  const std::string lock = dir.path() + "/strata.lock";
  const std::string stale = dir.path() + "/strata-" + std::to_string(dead) + ".swap";
  {
    std::ofstream(lock) << dead << "\n";
    std::ofstream(stale) << "old swap contents";
  }
  const std::string unrelated = dir.path() + "/notes.txt";
  std::ofstream(unrelated) << "keep me";

  SwapOptions o = make_options(GetParam(), {dir.path()});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  EXPECT_FALSE(std::filesystem::exists(stale)) << "stale swap file was not reclaimed";
  EXPECT_TRUE(std::filesystem::exists(unrelated));
  EXPECT_EQ(slurp(lock), std::to_string(::getpid()) + "\n");
  EXPECT_TRUE(
      std::filesystem::exists(dir.path() + "/strata-" + std::to_string(::getpid()) + ".swap"));
  swap.reset();
  EXPECT_FALSE(std::filesystem::exists(lock));
  EXPECT_TRUE(std::filesystem::exists(unrelated));
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapDirTest, ::testing::Values("uring", "posix"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

TEST(SwapDirErrorsTest, MissingDirectory) {
  TempDir dir;
  const std::string missing = dir.path() + "/nope";
  auto r = SwapSpace::create(make_options("posix", {missing}));
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(),
            "swap directory " + missing + " does not exist; create it or change swap_paths");
}

TEST(SwapDirErrorsTest, PathIsAFile) {
  TempDir dir;
  const std::string file = dir.path() + "/file";
  std::ofstream(file) << "x";
  auto r = SwapSpace::create(make_options("posix", {file}));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(file + " is not a directory"), std::string::npos)
      << r.status().message();
}

TEST(SwapDirErrorsTest, DirectoryNotWritable) {
  TempDir dir;
  std::string target = dir.path() + "/readonly";
  ASSERT_EQ(::mkdir(target.c_str(), 0555), 0);
  if (::geteuid() == 0) {
    // Root ignores permission bits. sysfs refuses new files even to root, where it is mounted.
    struct stat st {};
    if (::stat("/sys", &st) != 0 || !S_ISDIR(st.st_mode)) {
      GTEST_SKIP() << "running as root and no /sys to stand in for an unwritable directory";
    }
    target = "/sys";
  }
  auto r = SwapSpace::create(make_options("posix", {target}));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().to_string();
  EXPECT_NE(r.status().message().find("swap directory " + target + " is not writable"),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("change swap_paths"), std::string::npos);
}

TEST(SwapDirErrorsTest, BadOptionsAreAllReportedAtOnce) {
  SwapOptions o;
  o.block_size_bytes = 1000;
  o.queue_depth = 0;
  o.posix_threads = 0;
  auto r = SwapSpace::create(o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  const std::string& msg = r.status().message();
  EXPECT_FALSE(parse_swap_engine("spdk").has_value());  // command lines say so themselves
  for (const char* part :
       {"swap_paths is empty", "block_size_bytes 1000", "queue_depth 0", "posix_threads 0"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
  }
}

TEST(SwapDirErrorsTest, DuplicatePathsAreRejected) {
  TempDir dir;
  auto r = SwapSpace::create(make_options("posix", {dir.path(), dir.path() + "/"}));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("twice"), std::string::npos) << r.status().message();
}

TEST(SwapDirErrorsTest, MemoryEngineNeedsNoDirectories) {
  auto r = SwapSpace::create(make_options("memory", {}));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)->engine_name(), "memory");
}

TEST(SwapEngineChoiceTest, AutoPicksIoUringWhenItWorks) {
  TempDirs dirs(2);
  auto automatic = SwapSpace::create(make_options("auto", {dirs[0].path()}));
  ASSERT_TRUE(automatic.is_ok()) << automatic.status().to_string();
  auto uring = SwapSpace::create(make_options("uring", {dirs[1].path()}));
  // Where io_uring cannot run, asking for it is an error and auto falls back to posix.
  EXPECT_EQ((*automatic)->engine_name(), uring.is_ok() ? "io_uring" : "posix");
  if (!uring.is_ok()) {
    EXPECT_EQ(uring.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(uring.status().message().find("use engine \"auto\" or \"posix\""), std::string::npos);
  }
  if (testing::uring_compiled()) {
    std::printf("io_uring is %s here\n", uring.is_ok() ? "available" : "unavailable");
  }
}

}  // namespace
}  // namespace strata::io
