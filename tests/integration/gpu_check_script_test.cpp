// tools/gpu-check.sh on a machine that lacks a library and has no .debs/ to unpack it from: the
// check stops at once, naming the package and the fix, instead of failing later in CMake.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "tests/testing/cli.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

TEST(GpuCheckScriptTest, AMissingDebStopsTheCheckNamingThePackageAndTheFix) {
  const fs::path root = STRATA_SOURCE_DIR;
  if (fs::exists(root / ".debs"))
    GTEST_SKIP() << "this checkout has .debs/: the check would use it";
  if (std::system("command -v nvcc >/dev/null 2>&1 || test -x /usr/local/cuda/bin/nvcc") != 0) {
    GTEST_SKIP() << "no nvcc: gpu-check.sh stops before looking at libraries";
  }
  testing::TempDir dir;
  const std::string err = dir.file("stderr.txt");
  // GPU_CHECK_FORCE_DEBS=1 ignores the system's libraries, as on a bare GPU machine.
  const std::string cmd =
      "GPU_CHECK_FORCE_DEBS=1 GPU_CHECK_OUT= OUT= GPU_CHECK_BUILD_DIR=" + dir.file("build") +
      " bash " + (root / "tools/gpu-check.sh").string() + " --configure-only >" +
      dir.file("stdout.txt") + " 2>" + err;
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  const std::string text = testing::slurp(err);
  EXPECT_NE(text.find("lacks pkgconf-bin and .debs/ has no pkgconf-bin_*.deb"), std::string::npos)
      << text;
  EXPECT_NE(text.find("run tools/fetch-gpu-debs.sh"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(dir.file("build") + "/CMakeCache.txt")) << "it went on to configure";
}

}  // namespace
}  // namespace strata
