// The `strata` binary as a user runs it: exit codes, error messages, Ctrl-C.
#include "tests/testing/cli.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "strata/build_config.h"
#include "strata/core/json.h"
#include "strata/core/rng.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

using testing::run_cli;
using testing::RunResult;
using testing::slurp;

Json tiny(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "strata moves tensors between tiers. ";
  Json j = Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64},
    "seq_len": 16, "batch_size": 2, "max_steps": 3, "threads": 1, "log_every": 1
  })");
  j["data"] = {{"path", dir.write("data.txt", text)}, {"format", "text"}};
  j["save_dir"] = dir.file("ckpt");
  return j;
}

// `strata train DIR/c.json` in a child process, its output in DIR/out.txt and DIR/err.txt; waits
// (60 s at most) until the output shows `seen`, polling every `poll_ms`. Returns the child.
pid_t start_train_until(const TempDir& dir, const std::string& seen, int poll_ms) {
  const std::string out = dir.file("out.txt");
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::freopen(out.c_str(), "w", stdout);
    std::freopen(dir.file("err.txt").c_str(), "w", stderr);
    ::execl(STRATA_CLI, STRATA_CLI, "train", dir.file("c.json").c_str(), nullptr);
    ::_exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (pid > 0 && slurp(out).find(seen) == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
  }
  return pid;
}

TEST(CliTest, TrainsAndWritesMetrics) {
  TempDir dir;
  dir.write("c.json", tiny(dir).dump());
  RunResult r = run_cli(dir, "train " + dir.file("c.json") + " --metrics " + dir.file("m.jsonl") +
                                 " --set max_steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("step 2/2 | loss"), std::string::npos) << r.out;
  std::ifstream m(dir.file("m.jsonl"));
  std::string line;
  int lines = 0;
  while (std::getline(m, line)) {
    Json j = Json::parse(line);
    for (const char* k : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms",
                          "peak_device_bytes", "h2d_bytes", "nvme_read_bytes"}) {
      EXPECT_TRUE(j.contains(k)) << k;
    }
    ++lines;
  }
  EXPECT_EQ(lines, 2);
}

// The README's "Your own data" path: JSON lines of prompts and completions to a token file with
// a loss mask, then a fine-tune that evaluates held-out data.
// The failure tests' seam (--inject-fault, not in --help): a malformed spec is a usage error
// naming it; one that never strikes (rank 5 of one) leaves the run as it was.
TEST(CliTest, InjectFaultIsCheckedAndOnlyStrikesItsRankAndStep) {
  TempDir dir;
  dir.write("c.json", tiny(dir).dump());
  for (const char* bad : {"kill", "kill:1", "boom:0:1", "kill:x:1", "stall:0:0", "kill:0:1x"}) {
    RunResult r = run_cli(dir, "train " + dir.file("c.json") + " --inject-fault " + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find(std::string("--inject-fault '") + bad +
                         "': expected kill:RANK:STEP, stall:RANK:STEP or overflow:RANK:STEP"),
              std::string::npos)
        << r.err;
  }
  RunResult ok =
      run_cli(dir, "train " + dir.file("c.json") + " --set max_steps=2 --inject-fault kill:5:1");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find("step 2/2 | loss"), std::string::npos) << ok.out;
  RunResult help = run_cli(dir, "train --help");
  EXPECT_EQ(help.out.find("inject-fault"), std::string::npos) << help.out;
}

TEST(CliTest, TokenizeThenFineTuneWithEvaluation) {
  TempDir dir;
  const std::string ex = std::string(STRATA_SOURCE_DIR) + "/examples";
  for (const char* split : {"train", "eval"}) {
    RunResult t = run_cli(dir, "tokenize --tokenizer " + ex + "/sft/tokenizer.json --input " + ex +
                                   "/sft/" + split + ".jsonl --output " + dir.file(split) + ".bin");
    ASSERT_EQ(t.exit_code, 0) << t.err;
    EXPECT_NE(t.out.find("documents supervised, the loss counts"), std::string::npos) << t.out;
    EXPECT_TRUE(fs::exists(dir.file(std::string(split) + ".bin.mask")));
  }
  RunResult r =
      run_cli(dir, "train " + ex + "/sft.json --set data.path=\"" + dir.file("train.bin") +
                       "\" --set eval_data.path=\"" + dir.file("eval.bin") +
                       "\" --set max_steps=4 --set eval_every=2 --set save_dir=\"\" --metrics " +
                       dir.file("m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("loss mask " + dir.file("train.bin.mask")), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("eval at step 2/4 | loss"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("eval at step 4/4 | loss"), std::string::npos) << r.out;
  std::ifstream m(dir.file("m.jsonl"));
  std::string line;
  int evaluated = 0;
  while (std::getline(m, line)) evaluated += Json::parse(line).contains("eval_loss") ? 1 : 0;
  EXPECT_EQ(evaluated, 2);
}

TEST(CliTest, TokenizeErrorsNameTheFileAndLine) {
  TempDir dir;
  dir.write("bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"unterminated}\n");
  RunResult r = run_cli(dir, "tokenize --tokenizer " + std::string(STRATA_SOURCE_DIR) +
                                 "/examples/sft/tokenizer.json --input " + dir.file("bad.jsonl") +
                                 " --output " + dir.file("out.bin"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find(dir.file("bad.jsonl") + ":2: not a JSON object"), std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(dir.file("out.bin")));
}

TEST(CliTest, UnknownKeyExitsWithMessage) {
  TempDir dir;
  Json j = tiny(dir);
  j["learning_rate"] = 1;
  dir.write("c.json", j.dump());
  RunResult r = run_cli(dir, "train " + dir.file("c.json"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("'learning_rate': unknown key"), std::string::npos) << r.err;
}

// cuBLAS is opened with a CUDA device, not linked (its initializers took most of a CUDA
// build's start-up): a command that never makes a CUDA device never maps it, and `strata info`,
// which reports its version, does. The dynamic loader's own log (LD_DEBUG=files) says which
// files the process opened.
TEST(CliTest, CublasOpensOnlyWhenAskedFor) {
  TempDir dir;
  const testing::RunResult help = testing::run_command(dir, "LD_DEBUG=files " STRATA_CLI " --help");
  ASSERT_EQ(help.exit_code, 0) << help.err;
  ASSERT_NE(help.err.find("file="), std::string::npos) << "LD_DEBUG printed nothing:\n" << help.err;
  EXPECT_EQ(help.err.find("libcublas"), std::string::npos) << help.err;
  const testing::RunResult info = testing::run_command(dir, "LD_DEBUG=files " STRATA_CLI " info");
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_EQ(info.err.find("libcublas") != std::string::npos, STRATA_HAVE_CUDA != 0) << info.err;
  if (STRATA_HAVE_CUDA) {
    EXPECT_NE(info.out.find("cuBLASLt "), std::string::npos) << info.out;
  }
}

// A command line CLI11 cannot parse (an unknown flag, a missing argument, a subcommand that
// does not exist) is a usage error, exit code 2 as README says; --help and --version exit 0.
TEST(CliTest, EveryUsageErrorExitsTwo) {
  TempDir dir;
  dir.write("c.json", tiny(dir).dump());
  dir.write("hosts", "localhost slots=0\n");
  for (const std::string& args : std::vector<std::string>{
           "train " + dir.file("c.json") + " --no-such-flag", "train", "estimate",
           "no-such-command", "train " + dir.file("c.json") + " --set",
           "launch --ranks 2 --host-timeout-s 0 -- " + dir.file("c.json"),
           "launch --ranks 2 --hostfile " + dir.file("hosts") + " -- " + dir.file("c.json")}) {
    SCOPED_TRACE(args);
    const RunResult r = run_cli(dir, args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_FALSE(r.err.empty());
  }
  EXPECT_EQ(run_cli(dir, "--help").exit_code, 0);
  EXPECT_EQ(run_cli(dir, "train --help").exit_code, 0);
  EXPECT_EQ(run_cli(dir, "--version").exit_code, 0);
}

// strata launch --hostfile asks every listed host to start a process before an attempt, a
// bounded number at once, a failed start tried once more: 40 hosts, an mpirun that takes 0.3 s to
// answer for each, never for h39, fails once for h38 and always for h37; the probes never exceed
// 32 at a time, every host is asked, h38 is used, and h39 and h37 are named with why.
TEST(CliTest, LaunchAsksTheHostsOfAHostfileABoundedNumberAtATime) {
  TempDir dir;
  dir.write("c.json", tiny(dir).dump());
  std::string hosts;
  for (int h = 0; h < 40; ++h) hosts += "h" + std::to_string(h) + " slots=1\n";
  dir.write("hosts", hosts);
  // The probe is `mpirun -np 1 --host H true`; the job itself fails, so launch gives up.
  const std::string probes = dir.file("probes"), once = dir.file("h38-failed");
  dir.write("mpirun",
            "#!/bin/sh\n"
            "case \"$*\" in *' true') ;; *) echo \"job $*\" >>" +
                probes +
                "; exit 1 ;; esac\n"
                "case \"$*\" in *'--host h39 '*) exec sleep 100 ;; esac\n"
                "case \"$*\" in *'--host h37 '*) exit 3 ;; esac\n"
                "case \"$*\" in *'--host h38 '*) [ -e " +
                once + " ] || { touch " + once +
                "; exit 1; } ;; esac\n"
                "echo + >>" +
                probes + "\nsleep 0.3\necho - >>" + probes + "\n");
  ASSERT_EQ(::chmod(dir.file("mpirun").c_str(), 0755), 0);
  const RunResult r = run_cli(dir,
                              "launch --ranks 2 --max-restarts 0 --host-timeout-s 2 "
                              "--mpirun " +
                                  dir.file("mpirun") + " --hostfile " + dir.file("hosts") + " -- " +
                                  dir.file("c.json"));
  EXPECT_NE(r.exit_code, 0);
  const std::string err = r.out + r.err;
  EXPECT_NE(err.find("host h39 did not start a process within 2 s"), std::string::npos) << err;
  EXPECT_NE(err.find("host h37 could not start a process (mpirun exit code 3, tried twice)"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("host h38 "), std::string::npos) << err;
  EXPECT_NE(err.find("38 of the 40 hosts"), std::string::npos) << err;
  int at_once = 0, most = 0, started = 0;
  std::istringstream lines(slurp(probes));
  for (std::string line; std::getline(lines, line);) {
    if (line != "+" && line != "-") continue;  // the job's own mpirun
    at_once += line == "+" ? 1 : -1;
    started += line == "+" ? 1 : 0;
    most = std::max(most, at_once);
  }
  EXPECT_EQ(started, 38);  // h39 and h37 never write
  EXPECT_LE(most, 32);
  EXPECT_GT(most, 1);  // in parallel
}

// strata estimate says first whether the plan fits, each budget against what it needs; under
// --json a config that cannot run is a JSON object too ({"fits": false, "error": ...}).
TEST(CliTest, EstimateGivesAVerdictFirstAndJsonForRefusals) {
  TempDir dir;
  Json j = tiny(dir);
  j["device_memory_limit"] = "1GiB";
  dir.write("c.json", j.dump());
  RunResult r = run_cli(dir, "estimate " + dir.file("c.json"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("fits: device ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find(" of its 1.00 GiB, pinned host "), std::string::npos) << r.out;
  r = run_cli(dir, "estimate " + dir.file("c.json") + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  Json out = Json::parse(r.out);
  EXPECT_EQ(out.at("fits"), true);
  EXPECT_EQ(out.at("budgets").at("device").at("budget_bytes"), std::uint64_t{1} << 30);
  EXPECT_LE(out.at("budgets").at("device").at("needed_bytes").get<std::uint64_t>(),
            std::uint64_t{1} << 30);
  r = run_cli(dir, "estimate " + dir.file("c.json") + " --json --set device_memory_limit=4KiB");
  EXPECT_EQ(r.exit_code, 1);
  out = Json::parse(r.out);
  EXPECT_EQ(out.at("fits"), false);
  EXPECT_EQ(out.at("exit_code"), 1);
  EXPECT_NE(out.at("error").get<std::string>().find("device_memory_limit"), std::string::npos)
      << r.out;
}

TEST(CliTest, MalformedJsonNamesTheFile) {
  TempDir dir;
  dir.write("c.json", "{\"model\": ");
  RunResult r = run_cli(dir, "train " + dir.file("c.json"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find(dir.file("c.json")), std::string::npos) << r.err;
}

TEST(CliTest, BadSetValueIsReported) {
  TempDir dir;
  dir.write("c.json", tiny(dir).dump());
  RunResult r = run_cli(dir, "train " + dir.file("c.json") + " --set seq_len=abc");
  EXPECT_EQ(r.exit_code, 2);
  // Blamed on the command line, not on the file.
  EXPECT_NE(r.err.find("'seq_len' (from --set seq_len): expected an integer"), std::string::npos)
      << r.err;
}

// With device "cuda" and no GPU here, estimate says the compute is not predicted and how to
// predict it; --gpu NAME predicts with the named GPU's published rate, and "auto" chooses by it;
// an unknown name is a usage error naming the ones it knows.
TEST(CliTest, EstimateWithoutTheGpuPredictsWithANamedOnesRate) {
  TempDir dir;
  const std::string recipe =
      std::string(STRATA_SOURCE_DIR) +
      "/examples/recipes/llama3.1-8b-lora-24g.json --set model=" + STRATA_SOURCE_DIR +
      "/examples/models/Llama-3.1-8B-Instruct";
  RunResult none = run_cli(dir, "estimate " + recipe);
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_NE(none.out.find("predicted step: not predicted, no rate for the compute (--gpu NAME"),
            std::string::npos)
      << none.out;
  RunResult h100 = run_cli(dir, "estimate " + recipe + " --gpu h100");
  ASSERT_EQ(h100.exit_code, 0) << h100.err;
  EXPECT_NE(h100.out.find("assumed: H100 SXM's published dense bf16/fp16 peak, 989 TFLOP/s"),
            std::string::npos)
      << h100.out;
  EXPECT_EQ(h100.out.find("compute 0.00 s"), std::string::npos) << h100.out;
  // "auto" chooses the placement by the named GPU's rate too: the step it chose by (3 decimals)
  // is the step predicted (2 decimals), not one without the compute.
  RunResult placed = run_cli(dir, "estimate " + recipe +
                                      " --set offload_param=auto --set offload_optimizer=auto "
                                      "--gpu h100");
  ASSERT_EQ(placed.exit_code, 0) << placed.err;
  const auto seconds_after = [&](const std::string& key) {
    const std::size_t at = placed.out.find(key);
    return at == std::string::npos ? -1.0 : std::stod(placed.out.substr(at + key.size()));
  };
  const double chosen_by = seconds_after(": predicted step ");
  const double predicted = seconds_after("\npredicted step: ");
  ASSERT_GT(chosen_by, 0) << placed.out;
  ASSERT_GT(predicted, 0) << placed.out;
  EXPECT_NEAR(chosen_by, predicted, 0.0051) << placed.out;
  RunResult bad = run_cli(dir, "estimate " + recipe + " --gpu v100");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--gpu v100: expected one of h100, h200, a100, l40s, 4090, 3090"),
            std::string::npos)
      << bad.err;
}

// strata plot draws a run's metrics file as a PNG; a missing file or one that is not a metrics
// file is a usage error naming it.
TEST(CliTest, PlotDrawsTheMetricsOfARun) {
  TempDir dir;
  dir.write("c.json", tiny(dir).dump());
  RunResult train =
      run_cli(dir, "train " + dir.file("c.json") + " --metrics " + dir.file("m.jsonl"));
  ASSERT_EQ(train.exit_code, 0) << train.err;
  RunResult plot = run_cli(dir, "plot " + dir.file("m.jsonl") + " -o " + dir.file("loss.png"));
  ASSERT_EQ(plot.exit_code, 0) << plot.err;
  EXPECT_NE(plot.out.find("wrote " + dir.file("loss.png") + " (1 run, 3 steps)"), std::string::npos)
      << plot.out;
  const std::string png = testing::slurp(dir.file("loss.png"));
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  RunResult missing = run_cli(dir, "plot " + dir.file("none.jsonl") + " -o " + dir.file("x.png"));
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("none.jsonl: no such metrics file"), std::string::npos) << missing.err;
  dir.write("bad.jsonl", "{\"loss\": 1}\n");
  RunResult bad = run_cli(dir, "plot " + dir.file("bad.jsonl") + " -o " + dir.file("x.png"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("bad.jsonl:1: no \"step\""), std::string::npos) << bad.err;
}

// strata info names the build's backends, the CPU backend's SIMD path and GEMM library as a
// device made now reports them, and the kernel's huge-page mode.
TEST(CliTest, InfoNamesTheBackendsTheSimdPathTheGemmLibraryAndHugePages) {
  TempDir dir;
  RunResult r = run_cli(dir, "info");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* part :
       {"backends: cpu; cuda: ", "cpu backend: cpu/", "(SIMD path ", "; GEMMs: ", "huge pages: "}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
}

// --list-keys prints every key with its default and needs no config; without either, the usage
// error says what is missing (exit code 2).
TEST(CliTest, ListKeysPrintsEveryKeyAndAMissingConfigIsAUsageError) {
  TempDir dir;
  RunResult keys = run_cli(dir, "train --list-keys");
  EXPECT_EQ(keys.exit_code, 0) << keys.err;
  for (const char* line : {"optimizer.lr = 0.001\n", "zero_stage = 3\n",
                           "lr_schedule.type = constant\n", "gradient_accumulation_steps = 0\n",
                           "deepspeed = null, or a DeepSpeed config file's path"}) {
    EXPECT_NE(keys.out.find(line), std::string::npos) << line << "\n" << keys.out;
  }
  RunResult none = run_cli(dir, "train");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("a config file is required"), std::string::npos) << none.err;
}

// --deepspeed joins a DeepSpeed file's keys, and the run lists those it left to Strata.
TEST(CliTest, DeepSpeedFlagJoinsTheFileAndListsWhatStrataDecides) {
  TempDir dir;
  dir.write("c.json", tiny(dir).dump());
  dir.write("ds.json", R"({"zero_optimization": {"stage": 2, "overlap_comm": true}})");
  RunResult r = run_cli(dir, "train " + dir.file("c.json") + " --deepspeed " + dir.file("ds.json"));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("deepspeed " + dir.file("ds.json") +
                       ": its keys joined; decided by Strata: zero_optimization.overlap_comm\n"),
            std::string::npos)
      << r.out;
  RunResult clash = run_cli(dir, "train " + dir.file("c.json") + " --deepspeed " +
                                     dir.file("ds.json") + " --set zero_stage=3");
  EXPECT_EQ(clash.exit_code, 2);
  EXPECT_NE(clash.err.find("'zero_optimization.stage' makes 'zero_stage' 2, but --set zero_stage "
                           "makes it 3"),
            std::string::npos)
      << clash.err;
}

// Ctrl-C stops after the step with a checkpoint, written in the background (save_async: the
// offloaded optimizer) or not: the process ends only once it is complete, and it resumes.
TEST(CliTest, CtrlCStopsAfterTheStepAndLeavesAResumableCheckpoint) {
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "save_async" : "synchronous");
    TempDir dir;
    Json j = tiny(dir);
    j["max_steps"] = 1000000;
    if (async) {
      j["save_async"] = true;
      j["offload_optimizer"] = "cpu";
    }
    dir.write("c.json", j.dump());
    const std::string out = dir.file("out.txt");
    // Once training is visibly under way, interrupt.
    const pid_t pid = start_train_until(dir, "step 2/", 20);
    ASSERT_GE(pid, 0);
    ::kill(pid, SIGINT);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status)) << slurp(dir.file("err.txt"));
    EXPECT_EQ(WEXITSTATUS(status), 130) << slurp(dir.file("err.txt"));
    EXPECT_NE(slurp(out).find(async ? " in the background)" : "saved checkpoint"),
              std::string::npos)
        << slurp(out);
    ASSERT_TRUE(std::filesystem::exists(dir.file("ckpt/latest")));
    // Resume and run two more steps past where it stopped.
    const std::string latest = slurp(dir.file("ckpt/latest"));
    const int stopped_at = std::stoi(latest.substr(latest.find('-') + 1));
    RunResult r = run_cli(dir, "train " + dir.file("c.json") + " --resume " + dir.file("ckpt") +
                                   " --set max_steps=" + std::to_string(stopped_at + 2));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("step " + std::to_string(stopped_at + 2) + "/"), std::string::npos)
        << r.out;
  }
}

// save_async: SIGKILL at a random moment (seeded) while checkpoints are written in the
// background, every step, with the optimizer on NVMe: `latest` always names a complete
// checkpoint, which resumes.
TEST(CliTest, AsynchronousSavesKilledAnywhereLeaveAResumableLatest) {
  for (const unsigned seed : {1u, 2u, 3u, 4u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    TempDir dir;
    Json j = tiny(dir);
    j["max_steps"] = 1000000;
    j["save_every"] = 1;
    j["save_async"] = true;
    j["offload_optimizer"] = "nvme";
    j["swap_paths"] = {dir.file("swap")};
    std::filesystem::create_directories(dir.file("swap"));
    dir.write("c.json", j.dump());
    const pid_t pid = start_train_until(dir, "saved checkpoint", 5);
    ASSERT_GE(pid, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(Rng(seed).next_u64() % 200));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << slurp(dir.file("err.txt"));
    const std::string latest = slurp(dir.file("ckpt/latest"));
    ASSERT_FALSE(latest.empty());
    const int at = std::stoi(latest.substr(latest.find('-') + 1));
    RunResult r = run_cli(dir, "train " + dir.file("c.json") + " --resume " + dir.file("ckpt") +
                                   " --set max_steps=" + std::to_string(at + 1));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("step " + std::to_string(at + 1) + "/"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace strata
