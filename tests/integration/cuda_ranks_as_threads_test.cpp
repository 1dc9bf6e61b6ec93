// Ranks as threads of one process: each rank its own Trainer on its own device, the ranks meeting
// over an in-process group staged through pinned host memory (TrainOptions::make_communicator).
// So the multi-rank paths run on one GPU, where NCCL puts no two ranks: a tied embedding cut into
// 2 pipeline stages (the last stage's head reads the copy the first stage sends; the head's part
// of the embedding gradient goes back), 1F1B and interleaved, trains the losses and gradient
// norms of one stage (to the bit where two one-stage runs agree bit for bit, else to 1e-4); the
// experts shared out over 2 ranks under ZeRO-3 (their tokens dispatched by all-to-all) train the
// losses of one rank within another summation order's bound. Each on the CPU backend everywhere
// (the pipeline to the bit, as under mpirun) and on a GPU where there is one.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/build_config.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tests/integration/train_history.h"
#include "tests/testing/family_models.h"
#include "tests/testing/in_process_ranks.h"
#include "tests/testing/staged_communicator.h"
#include "tests/testing/temp_dir.h"
#if STRATA_HAVE_CUDA
#include "kernels/runtime.h"
#endif

namespace strata::train {
namespace {

using strata::testing::TempDir;

// The tiny model tied, with 4 layers (2 stages of 2, or 2 stages of 2 chunks of 1: interleaved)
// and 4 micro-batches a step, on `device`.
Json small_config(const TempDir& dir, const std::string& device) {
  Json j = gpu_tiny_config(dir);
  j["model"]["num_hidden_layers"] = 4;
  j["model"]["tie_word_embeddings"] = true;
  j["batch_size"] = 8;
  j["device"] = device;
  return j;
}

// `world` trainers of `j`, a thread each, over one in-process group staged through each rank's
// own device; each rank's run.
std::vector<History> train_as_threads(const Json& j, int world) {
  // A rank left waiting 20 s fails the run (these take under a second on two cores) rather than
  // holding up the GPU check's other tests.
  strata::testing::InProcessRanks ranks =
      strata::testing::make_in_process_ranks(world, std::chrono::seconds(20));
  std::vector<History> runs(static_cast<std::size_t>(world));
  ranks.run([&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    TrainOptions o;
    o.make_communicator = [&ranks,
                           r](device::Device& d) -> Result<std::unique_ptr<dist::Communicator>> {
      return std::unique_ptr<dist::Communicator>(
          new strata::testing::StagedCommunicator(std::move(ranks.comms[r]), d));
    };
    runs[r] = train_history(j, o);
  });
  return runs;
}

class RanksAsThreadsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() != "cuda") return;
#if STRATA_HAVE_CUDA
    const kernels::GpuInfo info = kernels::query_gpus();
    if (info.count == 0 && !rehearsing_gpu_tests()) GTEST_SKIP() << "no GPU: " << info.error;
#else
    GTEST_SKIP() << "built without CUDA";
#endif
  }
};

TEST_P(RanksAsThreadsTest, TiedEmbeddingInTwoStagesTrainsTheLossesOfOne) {
  TempDir dir;
  const Json base = small_config(dir, GetParam());
  const History one = train_history(base);
  ASSERT_EQ(one.loss.size(), 4u);
  EXPECT_LT(one.loss.back(), one.loss.front());
  // The CPU backend's kernels are deterministic; a GPU's may not be (atomics).
  const bool deterministic = GetParam() == "cpu" || train_history(base).loss == one.loss;
  for (const char* schedule : {"1f1b", "interleaved"}) {
    SCOPED_TRACE(schedule);
    Json k = base;
    k["pipeline_parallel_size"] = 2;
    k["pipeline_schedule"] = schedule;
    const std::vector<History> stages = train_as_threads(k, 2);
    for (std::size_t rank = 0; rank < stages.size(); ++rank) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      const History& got = stages[rank];
      ASSERT_EQ(got.loss.size(), one.loss.size());
      EXPECT_GT(got.sent_bytes, 0u);  // the stages' traffic went through the staged group
      if (deterministic) {
        EXPECT_EQ(got.loss, one.loss);
        EXPECT_EQ(got.grad_norm, one.grad_norm);
        continue;
      }
      // Sums in another order on the GPU: the 1e-4 that fp32 GPU runs hold against the CPU
      // backend's (CudaTrainTest) bounds any order's rounding of these tiny runs.
      for (std::size_t i = 0; i < one.loss.size(); ++i) {
        EXPECT_NEAR(got.loss[i], one.loss[i], 1e-4 * std::abs(one.loss[i])) << "step " << i + 1;
        EXPECT_NEAR(got.grad_norm[i], one.grad_norm[i], 1e-4 * std::abs(one.grad_norm[i]))
            << "step " << i + 1;
      }
    }
  }
}

// Qwen3-MoE's 16 experts over 2 ranks (8 each) under ZeRO-3, against one rank with all 16: the
// same tokens through the same experts, their gradients summed over the ranks in another order.
// The bound is MoeExpertParallel's under mpirun (1e-5), or on a GPU the fp32 GPU runs' 1e-4.
TEST_P(RanksAsThreadsTest, ExpertsOverTwoRanksTrainTheLossesOfOne) {
  TempDir dir;
  Json base = small_config(dir, GetParam());
  base["model"] = strata::testing::family_model("qwen3-moe", 2);
  base["zero_stage"] = 3;
  const History one = train_history(base);
  ASSERT_EQ(one.loss.size(), 4u);
  Json k = base;
  k["expert_parallel_size"] = 2;
  const std::vector<History> ranks = train_as_threads(k, 2);
  const double rtol = GetParam() == "cpu" ? 1e-5 : 1e-4;
  for (std::size_t rank = 0; rank < ranks.size(); ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const History& got = ranks[rank];
    ASSERT_EQ(got.loss.size(), one.loss.size());
    EXPECT_GT(got.all_to_all_bytes, 0u);  // tokens went to the other rank's experts
    for (std::size_t i = 0; i < one.loss.size(); ++i) {
      EXPECT_NEAR(got.loss[i], one.loss[i], rtol * std::abs(one.loss[i])) << "step " << i + 1;
      EXPECT_NEAR(got.grad_norm[i], one.grad_norm[i], rtol * std::abs(one.grad_norm[i]))
          << "step " << i + 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, RanksAsThreadsTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace strata::train
