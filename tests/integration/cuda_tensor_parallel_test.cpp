// The tensor-parallel layers on the CUDA backend: T ranks of one step, each with a CUDA device
// of its own on the one GPU, against the float64 PyTorch family goldens, as the CPU test
// (tensor_parallel_test.cpp) does. NCCL puts no two ranks on one GPU, so the ranks' collectives
// here meet in process over the host: each one copies its device buffer to pinned host memory,
// the CPU test's tensor group sums or gathers, and the result goes back (StagedTensorGroup).
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
#include "tests/testing/test_name.h"

namespace strata::model {
namespace {

// A TensorGroup of device buffers over the tensor group of host buffers that the CPU test uses
// (zero::make_tensor_group over in-process ranks): each call copies its input to one pinned
// staging buffer, runs there, and copies the result back.
class StagedTensorGroup final : public TensorGroup {
 public:
  StagedTensorGroup(TensorGroup& host, device::Device& gpu) : host_(host), gpu_(gpu) {}

  int size() const override { return host_.size(); }
  int rank() const override { return host_.rank(); }
  int kv_replicas() const override { return host_.kv_replicas(); }

  Status all_reduce_sum(void* buffer, std::int64_t count, DType dtype,
                        std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(buffer, n, buffer, n, 0, [&](std::byte* in, std::byte*) {
      return host_.all_reduce_sum(in, count, dtype, what);
    });
  }
  Status kv_replica_sum(void* buffer, std::int64_t count, DType dtype,
                        std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(buffer, n, buffer, n, 0, [&](std::byte* in, std::byte*) {
      return host_.kv_replica_sum(in, count, dtype, what);
    });
  }
  Status all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                    std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(send, n, recv, n * size(), n, [&](std::byte* in, std::byte* out) {
      return host_.all_gather(in, out, count, dtype, what);
    });
  }
  Status reduce_scatter_sum(const void* send, void* recv, std::int64_t count, DType dtype,
                            std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(send, n * size(), recv, n, n * size(), [&](std::byte* in, std::byte* out) {
      return host_.reduce_scatter_sum(in, out, count, dtype, what);
    });
  }

 private:
  static std::size_t bytes(std::int64_t count, DType dtype) {
    return static_cast<std::size_t>(count) * dtype_size(dtype);
  }
  // `in` [in_bytes] to the staging buffer's start, run(start, start + out_at), then out_bytes
  // from start + out_at to `out`.
  template <typename Run>
  Status staged(const void* in, std::size_t in_bytes, void* out, std::size_t out_bytes,
                std::size_t out_at, Run&& run) {
    const std::size_t need = std::max(in_bytes, out_at + out_bytes);
    if (staging_.size() < need) {
      STRATA_ASSIGN_OR_RETURN(staging_, gpu_.allocate_pinned(need, "tensor-parallel staging"));
    }
    auto* host = static_cast<std::byte*>(staging_.data());
    auto& stream = gpu_.stream(device::StreamKind::kCompute);
    gpu_.copy_to_host(host, in, in_bytes, stream);
    stream.synchronize();
    STRATA_RETURN_IF_ERROR(run(host, host + out_at));
    gpu_.copy_to_device(out, host + out_at, out_bytes, stream);
    stream.synchronize();
    return Status::ok();
  }

  TensorGroup& host_;
  device::Device& gpu_;
  device::PinnedBuffer staging_;
};

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
        auto host = zero::make_tensor_group(*ranks.comms[r], *ranks.devices[r],
                                            golden.config.num_key_value_heads);
        if (!host.is_ok()) return host.status().to_string();
        StagedTensorGroup group(**host, **gpu);
        std::string failures =
            testing::tensor_parallel_golden_step(golden, **gpu, group, false, sequence_parallel);
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
