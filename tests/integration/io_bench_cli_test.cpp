// `strata io-bench` as a user runs it: JSON lines, the table, --write-config as a config's swap
// section (parsed and trained with), flag errors, and no files left behind, even after Ctrl-C.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "strata/core/json.h"
#include "strata/train/config.h"
#include "strata/train/step_time.h"
#include "tests/testing/cli.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

using testing::TempDir;

using testing::run_cli;
using testing::RunResult;
using testing::slurp;

std::vector<Json> json_lines(const std::string& text) {
  std::vector<Json> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(Json::parse(line));
  }
  return out;
}

TEST(IoBenchCliTest, JsonLinesHaveEveryKeyAndFilesAreRemoved) {
  TempDir out, swap_dir;
  RunResult r = run_cli(out, "io-bench --path " + swap_dir.path() +
                                 " --size 8MiB --block-size 256KiB,1MiB --queue-depth 2,4 "
                                 "--op both --repeat 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<Json> lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 8u) << r.out;  // 2 block sizes x 2 depths x read and write
  std::set<std::string> points;
  for (const Json& j : lines) {
    for (const char* k : {"op", "block_size", "queue_depth", "threads", "paths", "bytes", "seconds",
                          "MBps", "cpu_s_per_GB"}) {
      ASSERT_TRUE(j.contains(k)) << k << " missing in " << j.dump();
    }
    EXPECT_TRUE(j["op"] == "read" || j["op"] == "write") << j.dump();
    EXPECT_EQ(j["bytes"].get<std::uint64_t>(), 8u << 20);
    EXPECT_EQ(j["threads"].get<int>(), 1);
    EXPECT_EQ(j["paths"].get<int>(), 1);
    const double seconds = j["seconds"].get<double>();
    const double mbps = j["MBps"].get<double>();
    EXPECT_GT(seconds, 0.0);
    EXPECT_NEAR(mbps, (8 << 20) / seconds / 1e6, mbps * 1e-6);
    EXPECT_EQ(j["runs_MBps"].size(), 2u);
    // CPU time of the whole process (every thread) per 10^9 bytes: at least 0, and at most what
    // every core running the whole time would use, plus a few scheduler ticks (4 ms at HZ=250)
    // per thread, since the kernel may count CPU time in ticks.
    const double gb = static_cast<double>(8u << 20) / 1e9;
    const double cpu_s = j["cpu_s_per_GB"].get<double>() * gb;
    EXPECT_GE(cpu_s, 0.0);
    const double cores = static_cast<double>(std::thread::hardware_concurrency());
    EXPECT_LE(cpu_s, cores * seconds + 0.05) << j.dump();
    points.insert(j["op"].get<std::string>() + "/" + j["block_size"].dump() + "/" +
                  j["queue_depth"].dump());
  }
  EXPECT_EQ(points.size(), 8u);
  EXPECT_TRUE(std::filesystem::is_empty(swap_dir.path()));
}

TEST(IoBenchCliTest, TableNamesTheBestSettings) {
  TempDir out, a, b;
  RunResult r = run_cli(out, "io-bench --path " + a.path() + " --path " + b.path() +
                                 " --size 4MiB --block-size 512KiB --queue-depth 4 --threads 1,2 "
                                 "--num-paths 1,2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* s : {"op", "block", "MB/s", "best read: block 512.00 KiB, queue depth 4",
                        "best write: block", "best read+write (harmonic mean)", "engine: "}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << "'" << s << "' missing in:\n" << r.out;
  }
  EXPECT_TRUE(std::filesystem::is_empty(a.path()));
  EXPECT_TRUE(std::filesystem::is_empty(b.path()));
}

Json tiny_config(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "strata moves tensors between tiers. ";
  Json j = Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64},
    "seq_len": 16, "batch_size": 2, "max_steps": 2, "threads": 1, "log_every": 1,
    "offload_param": "nvme", "offload_optimizer": "nvme", "verify_swap": true
  })");
  j["data"] = {{"path", dir.write("data.txt", text)}, {"format", "text"}};
  j["save_dir"] = dir.file("ckpt");
  return j;
}

// The written file is the swap section of a config: merged into one, it parses, keeps the
// measured values, and trains.
TEST(IoBenchCliTest, WriteConfigIsAValidSwapSection) {
  TempDir out, a, b;
  const std::string file = out.file("swap.json");
  RunResult r = run_cli(out, "io-bench --path " + a.path() + " --path " + b.path() +
                                 " --size 4MiB --block-size 256KiB,512KiB --queue-depth 2 "
                                 "--num-paths 1,2 --json --write-config " +
                                 file);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(json_lines(r.out).size(), 8u);
  auto fragment = read_json_file(file);
  ASSERT_TRUE(fragment.is_ok()) << fragment.status().to_string();
  std::set<std::string> keys;
  for (auto it = fragment->begin(); it != fragment->end(); ++it) keys.insert(it.key());
  EXPECT_EQ(keys, (std::set<std::string>{"swap_paths", "swap_engine", "swap_block_size",
                                         "swap_queue_depth", "swap_threads",
                                         "swap_read_bytes_per_s", "swap_write_bytes_per_s"}));
  const auto paths = (*fragment)["swap_paths"].get<std::vector<std::string>>();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths[0], a.path());
  EXPECT_EQ((*fragment)["swap_engine"], "auto");
  EXPECT_EQ((*fragment)["swap_queue_depth"], 2);

  Json config = tiny_config(out);
  config.update(*fragment);
  auto parsed = train::parse_train_config(config, "merged");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->swap_paths, paths);
  EXPECT_EQ(parsed->swap_block_size, (*fragment)["swap_block_size"].get<std::uint64_t>());
  EXPECT_EQ(parsed->swap_queue_depth, 2);
  EXPECT_EQ(parsed->swap_threads, 1);
  EXPECT_TRUE(parsed->verify_swap);
  // The bandwidth measured at the chosen point, which strata estimate takes instead of its probe.
  EXPECT_GT(parsed->swap_read_bytes_per_s, 0);
  EXPECT_GT(parsed->swap_write_bytes_per_s, 0);
  EXPECT_DOUBLE_EQ(parsed->swap_read_bytes_per_s,
                   (*fragment)["swap_read_bytes_per_s"].get<double>());
  parsed->offload_optimizer = Tier::kNvme;
  parsed->offload_param = Tier::kHost;
  const train::MachineRates rates = train::calibrate(*parsed);
  EXPECT_EQ(rates.nvme_read_bytes.per_s, parsed->swap_read_bytes_per_s);
  EXPECT_EQ(rates.nvme_write_bytes.per_s, parsed->swap_write_bytes_per_s);
  EXPECT_NE(rates.nvme_read_bytes.how.find("recorded by strata io-bench"), std::string::npos);

  out.write("train.json", config.dump());
  RunResult t = run_cli(out, "train " + out.file("train.json"));
  EXPECT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("step 2/2"), std::string::npos) << t.out;
  EXPECT_TRUE(std::filesystem::is_empty(a.path()));
  EXPECT_TRUE(std::filesystem::is_empty(b.path()));
}

// --op all adds a pass of reads and writes at once (the NVMe-streamed optimizer's pattern):
// each direction's rate goes to the config as swap_mixed_bytes_per_s, and strata estimate then
// streams the optimizer's reads and writes together at that rate.
TEST(IoBenchCliTest, MixedPassIsRecordedAndReachesTheEstimate) {
  TempDir out, a;
  const std::string file = out.file("swap.json");
  RunResult r = run_cli(out, "io-bench --path " + a.path() +
                                 " --size 4MiB --block-size 256KiB --queue-depth 4 --op all "
                                 "--json --write-config " +
                                 file);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> ops;
  for (const Json& j : json_lines(r.out)) ops.insert(j["op"].get<std::string>());
  EXPECT_EQ(ops, (std::set<std::string>{"read", "write", "mixed"}));
  auto fragment = read_json_file(file);
  ASSERT_TRUE(fragment.is_ok()) << fragment.status().to_string();
  ASSERT_TRUE(fragment->contains("swap_mixed_bytes_per_s")) << fragment->dump();
  EXPECT_GT((*fragment)["swap_mixed_bytes_per_s"].get<double>(), 0);

  Json config = tiny_config(out);
  config.update(*fragment);
  config["offload_optimizer"] = "nvme";
  config["offload_param"] = "cpu";
  auto parsed = train::parse_train_config(config, "merged");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  const train::MachineRates rates = train::calibrate(*parsed);
  EXPECT_TRUE(rates.nvme_mixed_bytes.measured);
  EXPECT_EQ(rates.nvme_mixed_bytes.per_s, parsed->swap_mixed_bytes_per_s);
  EXPECT_TRUE(std::filesystem::is_empty(a.path()));

  // Only the mixed pass: it alone is written.
  RunResult m = run_cli(out, "io-bench --path " + a.path() +
                                 " --size 4MiB --block-size 256KiB --queue-depth 4 --op mixed "
                                 "--write-config " +
                                 out.file("mixed.json"));
  ASSERT_EQ(m.exit_code, 0) << m.err;
  EXPECT_NE(m.out.find("mixed "), std::string::npos) << m.out;
  auto only = read_json_file(out.file("mixed.json"));
  ASSERT_TRUE(only.is_ok());
  EXPECT_TRUE(only->contains("swap_mixed_bytes_per_s"));
  EXPECT_FALSE(only->contains("swap_read_bytes_per_s"));
}

TEST(IoBenchCliTest, SwapKeysAreValidated) {
  TempDir dir;
  Json config = tiny_config(dir);
  config["swap_paths"] = {dir.path()};
  config["swap_block_size"] = "1000";
  config["swap_queue_depth"] = 0;
  config["swap_threads"] = 65;
  config["verify_swap"] = "yes";
  auto parsed = train::parse_train_config(config, "c.json");
  ASSERT_FALSE(parsed.is_ok());
  const std::string& msg = parsed.status().message();
  for (const char* s : {"'swap_block_size': 1000 must be a positive multiple of 4096",
                        "'swap_queue_depth'", "'swap_threads'", "'verify_swap'"}) {
    EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' missing in: " << msg;
  }
  config["swap_block_size"] = "8MiB";
  config["swap_queue_depth"] = 8;
  config["swap_threads"] = 2;
  config["verify_swap"] = false;
  parsed = train::parse_train_config(config, "c.json");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->swap_block_size, 8u << 20);
  const Json round = parsed->to_json();
  EXPECT_EQ(round["swap_block_size"], 8u << 20);
  EXPECT_EQ(round["swap_threads"], 2);
}

TEST(IoBenchCliTest, BadFlagsAreReportedTogether) {
  TempDir out, swap_dir;
  RunResult r = run_cli(out, "io-bench --path " + swap_dir.path() +
                                 " --size 1x --block-size 1000,1MiB --queue-depth 0 --op sideways");
  EXPECT_EQ(r.exit_code, 2);
  for (const char* s : {"--size '1x'", "--block-size '1000' must be a positive multiple of 4096",
                        "--queue-depth '0' must be an integer in [1, 4096]",
                        "--op 'sideways' must be read, write, both, mixed or all"}) {
    EXPECT_NE(r.err.find(s), std::string::npos) << "'" << s << "' missing in: " << r.err;
  }
  // A missing or wrong --path is a usage error named in the flag's words, before any output.
  const std::string missing = swap_dir.path() + "/missing";
  r = run_cli(out, "io-bench --path " + missing + " --size 1MiB");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--path '" + missing + "' does not exist; create it (mkdir -p " + missing),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out, "");
  const std::string file = swap_dir.path() + "/plain-file";
  std::ofstream(file) << "not a directory";
  r = run_cli(out, "io-bench --path " + swap_dir.path() + " --path " + file + " --size 1MiB");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--path '" + file + "' is not a directory"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("--path '" + swap_dir.path() + "'"), std::string::npos) << r.err;
  r = run_cli(out, "io-bench --size 1MiB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--path"), std::string::npos) << r.err;
}

TEST(IoBenchCliTest, CtrlCStopsAndRemovesTheFiles) {
  TempDir out, swap_dir;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::freopen(out.file("out.txt").c_str(), "w", stdout);
    std::freopen(out.file("err.txt").c_str(), "w", stderr);
    ::execl(STRATA_CLI, STRATA_CLI, "io-bench", "--path", swap_dir.path().c_str(), "--size",
            "512MiB", "--repeat", "1000", "--op", "both", nullptr);
    ::_exit(127);
  }
  // Wait (bounded) until the swap file exists, then interrupt.
  const std::string swap_file = swap_dir.file("strata-" + std::to_string(pid) + ".swap");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(swap_file) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(std::filesystem::exists(swap_file));
  ::kill(pid, SIGINT);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string err = slurp(out.file("err.txt"));
  ASSERT_TRUE(WIFEXITED(status)) << err;
  EXPECT_EQ(WEXITSTATUS(status), 130) << err;
  EXPECT_NE(err.find("benchmark files removed"), std::string::npos) << err;
  EXPECT_TRUE(std::filesystem::is_empty(swap_dir.path()));
}

}  // namespace
}  // namespace strata
