// tools/gpu-check.sh where there is no GPU and nothing is built: its argument errors stop it
// before it touches anything; without nvcc, or with a stand-in nvcc on a machine that lacks a
// library and has no .debs/ to unpack it from, it stops naming what is missing, and the preflight,
// the table and the tarball that carries every log still come back; --scale-cases picks cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testing/cli.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string script() { return (fs::path(STRATA_SOURCE_DIR) / "tools/gpu-check.sh").string(); }

// Runs the check with `env` (VAR=value ...) and `args`, its build directory in `dir`.
testing::RunResult run_check(const testing::TempDir& dir, const std::string& env,
                             const std::string& args) {
  return testing::run_command(
      dir, "env GPU_CHECK_OUT= OUT= GPU_CHECK_BUILD_DIR=" + dir.file("build") + " " + env +
               " bash " + script() + " " + args);
}

bool has_nvcc() {
  return testing::run_command(testing::TempDir(),
                              "command -v nvcc || test -x /usr/local/cuda/bin/nvcc")
             .exit_code == 0;
}

// Unpacks the tarball the check left (or exported) into `into`; "" or what went wrong.
std::string unpack(const std::string& tarball, const std::string& into) {
  if (!fs::exists(tarball)) return "no " + tarball;
  fs::create_directories(into);
  const testing::TempDir scratch;
  const testing::RunResult r = testing::run_command(scratch, "tar -xzf " + tarball + " -C " + into);
  return r.exit_code == 0 ? "" : "tar failed: " + r.err;
}

TEST(GpuCheckScriptTest, ArgumentErrorsStopItBeforeItTouchesAnything) {
  const struct {
    const char* env;
    const char* args;
    const char* message;
  } cases[] = {
      {"", "--phase nightly",
       "--phase takes all or a comma list of tests, bench and scale, not 'nightly'"},
      {"", "--phase tests,nightly", "not 'tests,nightly'"},
      {"", "--rehearse", "--rehearse goes with --phase scale alone"},
      {"", "--phase tests,scale --rehearse", "--rehearse goes with --phase scale alone"},
      {"", "--scale-cases 8b-lora", "--scale-cases goes with a --phase that has scale"},
      {"", "--phase bench --no-bench", "nothing to run"},
      {"", "--phase scale --scale-cases ,", "--scale-cases ',' names no case"},
      {"", "--phase scale --scale-cases 8b-lora,70b",
       "--scale-cases takes a comma list of 1.1b-host-accum1-auto 1.1b-host-accum1 8b-lora"},
      {"", "--fast", "unknown argument '--fast'"},
      {"GPU_CHECK_BUDGET_S=soon", "", "GPU_CHECK_BUDGET_S must be a whole number of seconds"},
      {"GPU_CHECK_ARCH=sm_90", "--build-only", "GPU_CHECK_ARCH must be an architecture such as 90"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.env) + " " + c.args);
    const testing::TempDir dir;
    const testing::RunResult r = run_check(dir, c.env, c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir.file("build"))) << "it went on after the error";
  }
}

// --scale-cases runs the cases it names and no others, in the script's order (most wanted first),
// whatever order it names them in: rehearsed on the CPU backend with this build's bench_scale.
TEST(GpuCheckScriptTest, ScaleCasesRunOnlyThoseNamedInTheScriptsOrder) {
  const fs::path bench = fs::path(STRATA_BINARY_DIR) / "bench";
  if (!fs::exists(bench / "bench_scale")) GTEST_SKIP() << "no bench_scale in " << bench;
  const testing::TempDir dir;
  fs::create_directories(dir.file("build"));
  fs::create_directory_symlink(bench, dir.file("build/bench"));
  const testing::RunResult r =
      run_check(dir, "", "--phase scale --rehearse --scale-cases 8b-qlora,1.1b-host-accum1");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::vector<std::string> ran;
  std::istringstream summary(testing::slurp(dir.file("build/gpu-check/summary.txt")));
  for (std::string line; std::getline(summary, line);)
    if (line.starts_with("run:")) ran.push_back(line.substr(4, line.find('|') - 4));
  EXPECT_EQ(ran, (std::vector<std::string>{"scale_1.1b-host-accum1", "scale_8b-qlora"}));
  const std::string results = testing::slurp(dir.file("build/gpu-check/scale.jsonl"));
  EXPECT_LT(results.find(R"("case":"1.1b-host-accum1")"), results.find(R"("case":"8b-qlora")"))
      << results;
  EXPECT_EQ(std::count(results.begin(), results.end(), '\n'), 2) << results;
}

TEST(GpuCheckScriptTest, WithoutNvccThePreflightTableAndTarballStillComeBack) {
  const testing::TempDir dir;
  const std::string exported = dir.file("out");
  const testing::RunResult r = run_check(
      dir, "GPU_CHECK_OUT=" + exported + " GPU_CHECK_NVCC=" + dir.file("no-toolkit/bin/nvcc"), "");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("nvcc not found (GPU_CHECK_NVCC=" + dir.file("no-toolkit/bin/nvcc")),
            std::string::npos)
      << r.err;
  // The table names what stopped it, both printed and exported beside the tarball.
  const std::string table = testing::slurp(exported + "/table.txt");
  EXPECT_NE(table.find("NOT FOUND"), std::string::npos) << table;
  EXPECT_NE(r.out.find("NOT FOUND"), std::string::npos) << r.out;
  ASSERT_EQ(unpack(exported + "/gpu-check.tar.gz", dir.file("unpacked")), "");
  const std::string preflight = testing::slurp(dir.file("unpacked/gpu-check/preflight.txt"));
  for (const char* section :
       {"== nvcc on the PATH: which -a nvcc", "== CUDA libraries ldconfig",
        "== nvidia-smi: nvidia-smi", "== clocks: nvidia-smi -q -d CLOCK", "== disk: df -h",
        "== memory: free -m", "== cmake: cmake --version"}) {
    EXPECT_NE(preflight.find(section), std::string::npos) << section << "\n" << preflight;
  }
  EXPECT_TRUE(fs::exists(dir.file("unpacked/gpu-check/table.txt")));
  EXPECT_FALSE(fs::exists(dir.file("build/CMakeCache.txt"))) << "it went on to configure";
}

TEST(GpuCheckScriptTest, AMissingDebStopsTheCheckNamingThePackageAndTheFix) {
  const fs::path root = STRATA_SOURCE_DIR;
  if (fs::exists(root / ".debs"))
    GTEST_SKIP() << "this checkout has .debs/: the check would use it";
  // A stand-in nvcc: the check gets past the toolchain to the libraries without a CUDA toolkit.
  const testing::TempDir dir;
  const std::string nvcc = dir.write(
      "bin/nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.0 (stand-in)'\n");
  ASSERT_EQ(testing::run_command(dir, "chmod +x " + nvcc).exit_code, 0);
  // GPU_CHECK_FORCE_DEBS=1 ignores the system's libraries, as on a bare GPU machine.
  const testing::RunResult r =
      run_check(dir, "GPU_CHECK_FORCE_DEBS=1 GPU_CHECK_NVCC=" + nvcc, "--configure-only");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("lacks pkgconf-bin and .debs/ has no pkgconf-bin_*.deb"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("run tools/fetch-gpu-debs.sh"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir.file("build/CMakeCache.txt"))) << "it went on to configure";
  // Nothing exported (GPU_CHECK_OUT and OUT empty): the tarball stays in the build directory,
  // with the stand-in's version in the preflight and the failed step in the table.
  ASSERT_EQ(unpack(dir.file("build/gpu-check.tar.gz"), dir.file("unpacked")), "");
  const std::string preflight = testing::slurp(dir.file("unpacked/gpu-check/preflight.txt"));
  EXPECT_NE(preflight.find("V13.0.0 (stand-in)"), std::string::npos) << preflight;
  const std::string table = testing::slurp(dir.file("unpacked/gpu-check/table.txt"));
  EXPECT_NE(table.find("no .deb for pkgconf-bin"), std::string::npos) << table;
}

// Where there is a real nvcc, it is what the check picks without GPU_CHECK_NVCC.
TEST(GpuCheckScriptTest, ThePreflightRecordsTheNvccItChose) {
  if (!has_nvcc()) GTEST_SKIP() << "no nvcc on this machine";
  const fs::path root = STRATA_SOURCE_DIR;
  if (fs::exists(root / ".debs"))
    GTEST_SKIP() << "this checkout has .debs/: the check would use it";
  const testing::TempDir dir;
  const testing::RunResult r = run_check(dir, "GPU_CHECK_FORCE_DEBS=1", "--configure-only");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const std::string preflight = testing::slurp(dir.file("build/gpu-check/preflight.txt"));
  EXPECT_NE(preflight.find("== nvcc chosen ("), std::string::npos) << preflight;
  EXPECT_NE(preflight.find("Cuda compilation tools"), std::string::npos) << preflight;
}

}  // namespace
}  // namespace strata
