// The tensor-parallel layers on the CUDA backend: T ranks of one step, each with a CUDA device
// of its own on the one GPU, against the float64 PyTorch family goldens, as the CPU test
// (tensor_parallel_test.cpp) does. NCCL puts no two ranks on one GPU, so the ranks' collectives
// here meet in process over the host: each one copies its device buffer to pinned host memory,
// the CPU test's in-process group sums or gathers, and the result goes back
// (testing::StagedCommunicator under the trainer's own tensor group).
// This runs each rank's split kernels (sliced GEMMs, embedding ids outside the slice, the
// vocabulary-parallel cross-entropy) on the GPU; the NCCL path is CudaNcclTest's.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "strata/zero/tensor_group.h"
#include "tests/integration/tensor_parallel_golden.h"
#include "tests/testing/staged_communicator.h"
#include "tests/testing/test_name.h"

namespace strata::model {
namespace {

class CudaTensorParallelTest : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {
 protected:
  void SetUp() override {
    const kernels::GpuInfo info = kernels::query_gpus();
    if (info.count == 0) GTEST_SKIP() << "no GPU: " << info.error;
  }
};

TEST_P(CudaTensorParallelTest, EachRanksSliceOfTheStepMatchesPyTorch) {
  const auto& [name, size, sequence_parallel] = GetParam();
  testing::expect_every_rank_matches(
      name, size,
      [&](const testing::TensorParallelGolden& golden, int rank,
          strata::testing::InProcessRanks& ranks) -> std::string {
        device::DeviceOptions o;
        o.kind = device::DeviceKind::kCuda;
        o.device_index = 0;
        o.memory_limit_bytes = 512ull << 20;
        auto gpu = device::create_device(o);
        if (!gpu.is_ok()) return gpu.status().to_string();
        const auto r = static_cast<std::size_t>(rank);
        strata::testing::StagedCommunicator staged(std::move(ranks.comms[r]), **gpu);
        auto group = zero::make_tensor_group(staged, **gpu, golden.config.num_key_value_heads);
        if (!group.is_ok()) return group.status().to_string();
        std::string failures =
            testing::tensor_parallel_golden_step(golden, **gpu, **group, false, sequence_parallel);
        const Status sticky = (*gpu)->last_error();
        if (!sticky.is_ok()) failures += "sticky CUDA error: " + sticky.to_string();
        return failures;
      });
}

INSTANTIATE_TEST_SUITE_P(
    Families, CudaTensorParallelTest,
    ::testing::Combine(::testing::Values("llama3", "qwen2", "qwen3", "mistral"),
                       ::testing::Values(2, 4), ::testing::Bool()),
    [](const auto& info) {
      return strata::testing::test_name(std::get<0>(info.param) + "_T" +
                                        std::to_string(std::get<1>(info.param))) +
             (std::get<2>(info.param) ? "SequenceParallel" : "");
    });

}  // namespace
}  // namespace strata::model

#endif  // STRATA_HAVE_CUDA
