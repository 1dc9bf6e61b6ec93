// bench/swap_vs_fio.sh without fio or root: the interval it prints beside each median ratio
// (bench/median_interval.py), its refusal of a bad FIO_HISTORY, and a whole run against stand-ins
// for fio and strata that report fixed rates, which checks the order it runs them in, the files
// it gives fio and the history it judges against.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testing/cli.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

testing::RunResult run_shell(const std::string& command) {
  const testing::TempDir dir;
  return testing::run_command(dir, command);
}

std::string median_interval_script() {
  return (fs::path(STRATA_SOURCE_DIR) / "bench/median_interval.py").string();
}

std::string interval(const std::string& values) {
  const testing::RunResult o = run_shell("python3 " + median_interval_script() + " " + values);
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
  const testing::RunResult o = run_shell("python3 " + median_interval_script() + " 1.0 fast");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.err.find("expected one or more numbers"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("fast"), std::string::npos) << o.err;
}

TEST(SwapVsFioScriptTest, ABadFioHistoryStopsTheRunNamingTheValue) {
  const fs::path script = fs::path(STRATA_SOURCE_DIR) / "bench/swap_vs_fio.sh";
  const testing::RunResult o =
      run_shell("FIO_HISTORY=older bash " + script.string() + " /nonexistent/strata");
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.err.find("FIO_HISTORY must be new, aged or both, got 'older'"), std::string::npos)
      << o.err;
  EXPECT_EQ(o.out, "") << "it went on to measure";
}

// Stand-ins for fio and strata io-bench, configured by the environment of the run: "fio" reports
// FAKE_FIO_NEW or FAKE_FIO_AGED MB/s by its file's history and logs each call (the history, the
// op, whether it refilled buffers, whether its file was new); "strata" reports FAKE_STRATA MB/s
// and logs its runs to the same FAKE_LOG.
constexpr const char* kFakeFio = R"sh(#!/bin/bash
[[ $1 == --version ]] && { echo fio-3.33; exit 0; }
for a in "$@"; do
  case $a in --filename=*) file=${a#*=} ;; --rw=*) rw=${a#*=} ;; --refill_buffers) refill=1 ;; esac
done
history=${file##*fio-bench-}; history=${history%.dat}
fresh=$([[ -e $file ]] && echo old || echo fresh)
touch "$file"
echo "fio $history $rw${refill:+ refill} $fresh" >>"$FAKE_LOG"
mbps=$([[ $history == new ]] && echo "$FAKE_FIO_NEW" || echo "$FAKE_FIO_AGED")
echo "{\"jobs\": [{\"$rw\": {\"bw_bytes\": $((mbps * 1000000)), \"io_bytes\": 1000000000},
  \"usr_cpu\": 1.0, \"sys_cpu\": 1.0, \"job_runtime\": 1000}]}"
)sh";
constexpr const char* kFakeStrata = R"sh(#!/bin/bash
echo strata >>"$FAKE_LOG"
echo "{\"MBps\": $FAKE_STRATA, \"cpu_s_per_GB\": 0.01}"
)sh";

// A run of the script, 1 MiB writes at depth 8 with three pairs, against the stand-ins.
class SwapVsFioRun {
 public:
  SwapVsFioRun(int strata_mbps, int fio_new_mbps, int fio_aged_mbps)
      : env_("FAKE_STRATA=" + std::to_string(strata_mbps) +
             " FAKE_FIO_NEW=" + std::to_string(fio_new_mbps) +
             " FAKE_FIO_AGED=" + std::to_string(fio_aged_mbps) + " FAKE_LOG=" + log()) {
    ::chmod(dir_.write("bin/fio", kFakeFio).c_str(), 0755);
    strata_ = dir_.write("bin/strata", kFakeStrata);
    ::chmod(strata_.c_str(), 0755);
  }

  testing::RunResult run(const std::string& env) const {
    const fs::path script = fs::path(STRATA_SOURCE_DIR) / "bench/swap_vs_fio.sh";
    return testing::run_command(
        dir_, env_ + " PATH=" + dir_.file("bin") + ":$PATH DIR=" + dir_.file("swap") +
                  " FIO_IOMEM=malloc BLOCKS=1m DEPTHS=8 OPS=write PAIRS=3 SIZE_MIB=4 " + env +
                  " bash " + script.string() + " " + strata_);
  }

  // The log's lines, without the untimed passes (fio's reads and refilled writes of a write case).
  std::vector<std::string> timed_runs() const {
    std::vector<std::string> runs;
    std::istringstream in(testing::slurp(log()));
    for (std::string line; std::getline(in, line);) {
      if (line == "strata" ||
          (line.find(" write ") != std::string::npos && line.find("refill") == std::string::npos)) {
        runs.push_back(line.substr(0, line.rfind(' ')));  // without fresh/old
      }
    }
    return runs;
  }
  std::vector<std::string> log_lines() const {
    std::vector<std::string> lines;
    std::istringstream in(testing::slurp(log()));
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }
  bool on_tmpfs() const {
    struct statfs s {};
    return ::statfs(dir_.path().c_str(), &s) == 0 && s.f_type == 0x01021994;  // TMPFS_MAGIC
  }

 private:
  std::string log() const { return dir_.file("calls.log"); }
  testing::TempDir dir_;
  std::string env_;
  std::string strata_;
};

std::vector<std::string> summary_lines(const std::string& out) {
  std::vector<std::string> lines;
  std::istringstream in(out.substr(out.find("median strata/fio per case")));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(SwapVsFioScriptTest, BothHistoriesRotateAndTheFasterFioFileIsTheTarget) {
  const SwapVsFioRun r(/*strata*/ 1500, /*fio new*/ 1000, /*fio aged*/ 2000);
  if (r.on_tmpfs()) GTEST_SKIP() << "the script refuses tmpfs, where the temp directory is";
  const testing::RunResult o = r.run("");  // FIO_HISTORY=both by default
  ASSERT_EQ(o.exit_code, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("fio's file: new aged (FIO_HISTORY=both)"), std::string::npos) << o.out;

  // Each pair times all three, the first of each pair moving one place along.
  const std::vector<std::string> expected = {
      "strata",         "fio new write",  "fio aged write",  // pair 1
      "fio new write",  "fio aged write", "strata",          // pair 2
      "fio aged write", "strata",         "fio new write"};  // pair 3
  EXPECT_EQ(r.timed_runs(), expected);
  // fio's "new" file is made anew for every pair; its "aged" file once for the run.
  int fresh_new = 0, fresh_aged = 0;
  for (const std::string& line : r.log_lines()) {
    if (line.ends_with(" fresh")) (line.starts_with("fio new") ? fresh_new : fresh_aged)++;
  }
  EXPECT_EQ(fresh_new, 3);
  EXPECT_EQ(fresh_aged, 1);

  // Judged against the aged file, fio's faster one here: 1500 / 2000 is below the 1 MiB target.
  const std::vector<std::string> s = summary_lines(o.out);
  ASSERT_EQ(s.size(), 4u) << o.out;
  EXPECT_NE(s[1].find("fio file aged (fio's best, fio  2000.0 MB/s)  median ratio 0.750"),
            std::string::npos)
      << s[1];
  EXPECT_NE(s[1].find("BELOW TARGET (the whole interval is below)"), std::string::npos) << s[1];
  EXPECT_NE(s[2].find("fio file new  (other,     fio  1000.0 MB/s)  median ratio 1.500"),
            std::string::npos)
      << s[2];
  EXPECT_NE(s[2].find("(ok against this file)"), std::string::npos) << s[2];
  EXPECT_EQ(s[3].find("total"), 0u) << s[3];
  EXPECT_NE(s[3].find("1 case(s) below target"), std::string::npos) << s[3];
}

TEST(SwapVsFioScriptTest, WhenTheNewFileIsFasterItIsTheTarget) {
  const SwapVsFioRun r(/*strata*/ 1500, /*fio new*/ 1400, /*fio aged*/ 900);
  if (r.on_tmpfs()) GTEST_SKIP() << "the script refuses tmpfs, where the temp directory is";
  const testing::RunResult o = r.run("FIO_HISTORY=both");
  ASSERT_EQ(o.exit_code, 0) << o.out << o.err;
  const std::vector<std::string> s = summary_lines(o.out);
  ASSERT_EQ(s.size(), 4u) << o.out;
  EXPECT_NE(s[1].find("fio file new  (fio's best, fio  1400.0 MB/s)  median ratio 1.071"),
            std::string::npos)
      << s[1];
  EXPECT_NE(s[1].find("  ok"), std::string::npos) << s[1];
  EXPECT_NE(s[3].find("0 case(s) below target"), std::string::npos) << s[3];
}

TEST(SwapVsFioScriptTest, OneHistoryTimesFioOncePerPair) {
  const SwapVsFioRun r(/*strata*/ 1500, /*fio new*/ 1000, /*fio aged*/ 2000);
  if (r.on_tmpfs()) GTEST_SKIP() << "the script refuses tmpfs, where the temp directory is";
  const testing::RunResult o = r.run("FIO_HISTORY=new");
  ASSERT_EQ(o.exit_code, 0) << o.out << o.err;
  const std::vector<std::string> expected = {"strata", "fio new write", "fio new write",
                                             "strata", "strata",        "fio new write"};
  EXPECT_EQ(r.timed_runs(), expected);
  const std::vector<std::string> s = summary_lines(o.out);
  ASSERT_EQ(s.size(), 3u) << o.out;  // no line for the aged file
  EXPECT_NE(s[1].find("fio file new  (fio's best, fio  1000.0 MB/s)  median ratio 1.500"),
            std::string::npos)
      << s[1];
  EXPECT_NE(s[2].find("0 case(s) below target"), std::string::npos) << s[2];
}

}  // namespace
}  // namespace strata
