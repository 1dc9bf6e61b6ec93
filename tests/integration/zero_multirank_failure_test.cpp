// Multi-rank failures under mpirun: a batch the ranks cannot split, a dead or stuck rank, device
// memory running out with collectives in flight end the run cleanly and in time; the elastic
// launcher restarts on the ranks left and continues as a resume by hand would.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/model/safetensors.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/trainer.h"
#include "tests/testing/family_models.h"
#include "tests/testing/multirank_runs.h"
#include "tests/testing/small_disk.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

using namespace testing;  // NOLINT: the multi-rank run helpers
namespace fs = std::filesystem;

TEST(ZeroFailures, MicroBatchThatDoesNotFitTheRanksSuggestsOneThatDoes) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "fit");
  j["micro_batch_size"] = 8;  // batch_size 8 on 2 ranks: 4 per rank at most
  fs::create_directories(dir.file("fit"));
  dir.write("fit/config.json", j.dump());
  const int rc = run(mpirun(dir, 2) + STRATA_CLI + " train " + dir.file("fit/config.json") +
                     " >/dev/null 2>" + dir.file("fit/err.txt"));
  std::stringstream err;
  err << std::ifstream(dir.file("fit/err.txt")).rdbuf();
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.str().find("batch_size 8 must be a multiple of micro_batch_size 8 x 2 ranks; "
                           "with 2 ranks use --set micro_batch_size=4"),
            std::string::npos)
      << err.str();
}

// A save onto a full disk, on every grid's way of gathering the model to rank 0 (data-parallel
// shards, tensor-parallel slices, pipeline stages): rank 0's write fails, it still takes part in
// every gather that follows (no rank is left waiting), and every rank ends with the disk's error
// instead of a crash or a hang; the save directory holds nothing half-written.
TEST(ZeroFailures, ASaveOntoAFullDiskEndsEveryRankWithTheError) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  SmallDisk disk(dir.file("disk"), 64u << 10);  // less than one optimizer shard
  if (!disk.why_not().empty()) GTEST_SKIP() << disk.why_not();
  for (const auto& [name, key] :
       {std::pair{"data", ""}, std::pair{"tensor", "tensor_parallel_size"},
        std::pair{"pipeline", "pipeline_parallel_size"}}) {
    SCOPED_TRACE(name);
    Json j = config(dir, name);
    if (*key != '\0') j[key] = 2;
    j["max_steps"] = 1;
    j["dist_timeout_s"] = 20;
    j["save_dir"] = dir.file(std::string("disk/") + name);
    const auto start = std::chrono::steady_clock::now();
    const int rc = run_train(dir, j, name, 2);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::stringstream err;
    err << std::ifstream(dir.file(std::string(name) + "/err.txt")).rdbuf();
    EXPECT_EQ(rc, 1) << err.str();
    EXPECT_NE(err.str().find("No space left on device"), std::string::npos) << err.str();
    EXPECT_EQ(err.str().find("STRATA_CHECK"), std::string::npos) << err.str();
    EXPECT_LT(seconds, 20) << "a rank waited for a gather that never came";
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(dir.file(std::string("disk/") + name))) {
      left.push_back(e.path().filename().string());
    }
    EXPECT_TRUE(left.empty()) << left.front();
  }
}

// Rank 1 kills itself (SIGKILL) when step 3 starts.
TEST(ZeroFailures, DeadRankEndsTheRunWithinTheTimeout) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r = run_with_fault(dir, "dead", "kill", 10);
  EXPECT_NE(r.rc, 0);
  EXPECT_LT(r.seconds, 10 + 30) << "the surviving rank did not give up within dist_timeout_s";
  EXPECT_NE(r.err.find("rank"), std::string::npos) << r.err;
}

// A rank that is alive but stuck (rank 1 stops for good as step 3 starts): the other rank's
// collective times out after dist_timeout_s, it says which operation and, from a liveness probe,
// which rank is stuck elsewhere, makes no MPI call
// after that (a late completion could write into buffers already freed), and the job ends.
TEST(ZeroFailures, StuckRankEndsTheRunWithATimeoutNamingTheOperation) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r = run_with_fault(dir, "stuck", "stall", 3);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("rank 0: "), std::string::npos) << r.err;
  // Each rank prints its own error; the line says whose it is.
  EXPECT_NE(r.err.find("strata train [rank 0]: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete in time; a peer rank may have died or be stuck"),
            std::string::npos)
      << r.err;
  // The stuck rank answers the liveness probe (its communication thread lives on) and is named
  // as not in the collective, idle since its last one.
  EXPECT_NE(r.err.find("answered but not in it: rank 1 ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(") is idle for "), std::string::npos) << r.err;
  // One timeout, reported once: nothing after it waited out another timeout.
  EXPECT_LT(r.seconds, 2 * 3 + 20) << r.err;
}

// The same with the layers split over both ranks: the tensor-parallel collective the other rank
// waits in ends it, named (the first of a step is the vocabulary-parallel embedding's sum).
TEST(ZeroFailures, StuckTensorParallelRankEndsTheRunNamingTheOperation) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r =
      run_with_fault(dir, "stuck-tp", "stall", 3, {{"tensor_parallel_size", 2}, {"save_dir", ""}});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("rank 0: all_reduce 'embedding'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete in time; a peer rank may have died or be stuck"),
            std::string::npos)
      << r.err;
  EXPECT_LT(r.seconds, 2 * 3 + 20) << r.err;
}

// The same with a mixture-of-experts model's experts shared out over both ranks: the expert
// group's exchange the other rank waits in (the first of a step, the rows each rank has for each
// expert) ends it, named, and names the stuck rank.
TEST(ZeroFailures, StuckExpertParallelRankEndsTheRunNamingTheExchange) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r = run_with_fault(dir, "stuck-ep", "stall", 3,
                                      {{"model", family_model("qwen3-moe", 2)},
                                       {"micro_batch_size", 1},
                                       {"zero_stage", 2},
                                       {"expert_parallel_size", 2},
                                       {"save_dir", ""}});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("rank 0: all_gather 'rows for each expert'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete in time; a peer rank may have died or be stuck"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("answered but not in it: rank 1 ("), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 2 * 3 + 20) << r.err;
}

// A device budget that runs out in backward, with collectives queued (prefetched gathers, a
// gradient bucket): every rank ends with the out-of-memory error, and tearing down does not
// free buffers that a queued collective then writes into (it did: heap corruption and SIGABRT
// after the error).
TEST(ZeroFailures, OutOfDeviceMemoryWithCollectivesInFlightEndsCleanly) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "oom");
  j["model"] = Json::parse(R"({"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
      "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
      "max_position_embeddings": 256})");
  j["seq_len"] = 128;
  j["micro_batch_size"] = 1;
  j["activation_checkpointing"] = true;
  j["offload_param"] = "cpu";
  j["offload_optimizer"] = "cpu";
  j["device_memory_limit"] = "20MiB";
  fs::create_directories(dir.file("oom"));
  dir.write("oom/config.json", j.dump());
  const int rc = run(mpirun(dir, 2) + STRATA_CLI + " train " + dir.file("oom/config.json") + " >" +
                     dir.file("oom/out.txt") + " 2>" + dir.file("oom/err.txt"));
  std::stringstream err;
  err << std::ifstream(dir.file("oom/err.txt")).rdbuf()
      << std::ifstream(dir.file("oom/out.txt")).rdbuf();
  EXPECT_NE(rc, 0) << "the budget no longer runs out; pick a smaller device_memory_limit";
  EXPECT_NE(err.str().find("no room on the device"), std::string::npos) << err.str();
  for (const char* crash : {"Signal:", "corrupted", "AddressSanitizer", "double free"}) {
    EXPECT_EQ(err.str().find(crash), std::string::npos) << err.str();
  }
}

std::string read_text(const std::string& path) {
  auto text = read_file(path);
  return text.is_ok() ? *text : "cannot read " + path;
}

// strata launch: rank 1 of 4 is killed (SIGKILL) as step 3 starts; the launcher restarts from the
// latest complete checkpoint (step 2) with the ranks left, 3, of which 2 run (a global batch of 4
// micro-batches of 2 does not split over 3), and the job finishes. The metrics hold each step
// once (1 and 2 from the first attempt, 3 to 5 from the second: the data continues with the next
// unseen batch), and steps 3-5 are the losses of a run resumed by hand from that checkpoint on 2
// ranks, and, to the bit, those the 4 ranks would have trained (deterministic_reduction: the
// same sums on any number of ranks). A config that fits no rank count at or above --min-ranks
// is given up on, saying why.
TEST(ZeroElastic, LaunchRestartsOnTheRanksLeftAndContinuesAsAResumeByHand) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "elastic");
  j.erase("deterministic_reduction");  // "auto": on for 4 ranks, and kept by the restart on 2
  j["max_steps"] = 5;
  j["save_every"] = 1;
  j["dist_timeout_s"] = 30;
  dir.write("elastic.json", j.dump());
  const std::string mpirun_args =
      " --mpirun-args '--oversubscribe --bind-to none --mca btl self,vader'";
  const std::string env = "OMPI_MCA_orte_tmpdir_base=" + dir.path() + " ";
  const int rc =
      run(env + STRATA_CLI + " launch --ranks 4" + mpirun_args + " -- " + dir.file("elastic.json") +
          " --inject-fault kill:1:3 >" + dir.file("launch.out") + " 2>&1");
  const std::string out = read_text(dir.file("launch.out"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("rank(s) 1 died"), std::string::npos) << out;
  EXPECT_NE(out.find("does not split over 3, so 2 of them run"), std::string::npos) << out;
  EXPECT_NE(out.find("attempt 2: 2 rank(s), resuming from " + dir.file("elastic/ckpt") + "/latest"),
            std::string::npos)
      << out;
  std::vector<std::int64_t> steps;
  {
    std::ifstream in(dir.file("elastic/metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) steps.push_back(Json::parse(line)["step"].get<std::int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<std::int64_t>{1, 2, 3, 4, 5}));
  const std::vector<double> launched = losses(dir.file("elastic/metrics.jsonl"));
  ASSERT_EQ(launched.size(), 5u);

  Json by_hand = config(dir, "by-hand");
  by_hand["max_steps"] = 5;
  dir.write("by-hand.json", by_hand.dump());
  ASSERT_EQ(run(mpirun(dir, 2) + STRATA_CLI + " train " + dir.file("by-hand.json") + " --resume " +
                dir.file("elastic/ckpt/step-00000002") + " >/dev/null 2>&1"),
            0);
  EXPECT_EQ(losses(dir.file("by-hand/metrics.jsonl")),
            std::vector<double>(launched.begin() + 2, launched.end()));
  // The run the failure interrupted, uninterrupted on its 4 ranks: every step's loss is the
  // launched run's, bit for bit (the same doubles: the metrics print every digit).
  Json four = config(dir, "four");
  four.erase("deterministic_reduction");
  four["max_steps"] = 5;
  dir.write("four.json", four.dump());
  ASSERT_EQ(
      run(mpirun(dir, 4) + STRATA_CLI + " train " + dir.file("four.json") + " >/dev/null 2>&1"), 0);
  EXPECT_EQ(losses(dir.file("four/metrics.jsonl")), launched);

  // Nothing from 3 (--min-ranks) to 3 ranks splits the batch: no attempt runs.
  const int refused =
      run(env + STRATA_CLI + " launch --ranks 3 --min-ranks 3" + mpirun_args + " -- " +
          dir.file("elastic.json") + " >" + dir.file("refused.out") + " 2>&1");
  EXPECT_NE(refused, 0);
  EXPECT_NE(read_text(dir.file("refused.out")).find("giving up"), std::string::npos)
      << read_text(dir.file("refused.out"));

  // A hostfile's slots bound the ranks: 2 listed, 2 run.
  dir.write("hosts", "localhost slots=2  # this machine\n");
  Json listed = config(dir, "listed");
  listed["max_steps"] = 1;
  dir.write("listed.json", listed.dump());
  const int hosted =
      run(env + STRATA_CLI + " launch --ranks 4 --hostfile " + dir.file("hosts") + mpirun_args +
          " -- " + dir.file("listed.json") + " >" + dir.file("listed.out") + " 2>&1");
  EXPECT_EQ(hosted, 0) << read_text(dir.file("listed.out"));
  EXPECT_NE(read_text(dir.file("listed.out")).find("attempt 1: 2 rank(s)"), std::string::npos)
      << read_text(dir.file("listed.out"));
}

}  // namespace
}  // namespace strata
