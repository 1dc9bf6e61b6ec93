// bench/swap_vs_fio.sh's pieces that run without fio or root: the interval it prints beside each
// median ratio (bench/median_interval.py) and its refusal of a bad FIO_HISTORY.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/testing/cli.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

testing::RunResult run(const std::string& command) {
  const testing::TempDir dir;
  return testing::run_command(dir, command);
}

std::string median_interval_script() {
  return (fs::path(STRATA_SOURCE_DIR) / "bench/median_interval.py").string();
}

std::string interval(const std::string& values) {
  const testing::RunResult o = run("python3 " + median_interval_script() + " " + values);
  EXPECT_EQ(o.exit_code, 0) << o.err;
  return o.out;
}

// The k-th smallest and largest of n, k the largest with P(Binomial(n, 1/2) < k) <= 5%; the
// coverage is 1 - 2 P(Binomial(n, 1/2) < k), computed here by hand for each n.
TEST(SwapVsFioScriptTest, MedianIntervalTakesTheOrderStatisticsTheBinomialAllows) {
  // n = 5: P(B < 1) = 1/32, P(B < 2) = 6/32 > 5%: k = 1, the whole range, 1 - 2/32 = 93.75%.
  EXPECT_EQ(interval("0.97 1.1 0.9 1.0 0.95"), "0.900 1.100 93.8\n");
  // n = 9: P(B < 2) = 10/512, P(B < 3) = 46/512 > 5%: k = 2, 1 - 20/512 = 96.09%.
  EXPECT_EQ(interval("9 1 8 2 7 3 6 4 5"), "2.000 8.000 96.1\n");
  // n = 15: P(B < 4) = 576/32768, P(B < 5) = 1941/32768 > 5%: k = 4, 1 - 1152/32768 = 96.48%.
  EXPECT_EQ(interval("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"), "4.000 12.000 96.5\n");
  // n = 3: no k qualifies (P(B < 1) = 1/8): the whole range, covering only 75%.
  EXPECT_EQ(interval("3 1 2"), "1.000 3.000 75.0\n");
}

TEST(SwapVsFioScriptTest, MedianIntervalRefusesWhatIsNotANumber) {
  const testing::RunResult o = run("python3 " + median_interval_script() + " 1.0 fast");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.err.find("expected one or more numbers"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("fast"), std::string::npos) << o.err;
}

TEST(SwapVsFioScriptTest, ABadFioHistoryStopsTheRunNamingTheValue) {
  const fs::path script = fs::path(STRATA_SOURCE_DIR) / "bench/swap_vs_fio.sh";
  const testing::RunResult o =
      run("FIO_HISTORY=older bash " + script.string() + " /nonexistent/strata");
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.err.find("FIO_HISTORY must be new or aged, got 'older'"), std::string::npos) << o.err;
  EXPECT_EQ(o.out, "") << "it went on to measure";
}

}  // namespace
}  // namespace strata
