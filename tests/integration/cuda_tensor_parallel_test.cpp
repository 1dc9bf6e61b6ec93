// The tensor-parallel layers on the CUDA backend: T ranks of one step, each with a CUDA device
// of its own on the one GPU, against the float64 PyTorch family goldens, as the CPU test
// (tensor_parallel_test.cpp) does. NCCL puts no two ranks on one GPU, so the ranks' collectives
// here meet in process over the host: each one copies its device buffer to pinned host memory,
// the in-process communicator sums or gathers, and the result goes back (StagedTensorGroup).
// This runs each rank's split kernels (sliced GEMMs, embedding ids outside the slice, the
// vocabulary-parallel cross-entropy) on the GPU; the NCCL path is CudaNcclTest's.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "strata/model/param_layout.h"
#include "tests/integration/tensor_parallel_golden.h"
#include "tests/testing/test_name.h"

namespace strata::model {
namespace {

// A TensorGroup of device buffers over a communicator of host buffers, through one pinned
// staging buffer sized for the largest call.
class StagedTensorGroup final : public TensorGroup {
 public:
  StagedTensorGroup(dist::Communicator& host, device::Device& gpu, std::int64_t kv_heads)
      : host_(host), gpu_(gpu), kv_replicas_(kv_head_replicas(kv_heads, host.world_size())) {}

  Status init() {
    if (kv_replicas_ > 1) {
      STRATA_ASSIGN_OR_RETURN(
          replicas_, host_.split(host_.rank() / kv_replicas_, host_.rank(), "kv head replicas",
                                 device::StreamKind::kTensorCollective));
    }
    return Status::ok();
  }

  int size() const override { return host_.world_size(); }
  int rank() const override { return host_.rank(); }
  int kv_replicas() const override { return kv_replicas_; }

  Status all_reduce_sum(void* buffer, std::int64_t count, DType dtype,
                        std::string_view what) override {
    return reduce(host_, buffer, count, dtype, what);
  }
  Status kv_replica_sum(void* buffer, std::int64_t count, DType dtype,
                        std::string_view what) override {
    return replicas_ == nullptr ? Status::ok() : reduce(*replicas_, buffer, count, dtype, what);
  }
  Status all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                    std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    STRATA_ASSIGN_OR_RETURN(std::byte * host, staging(bytes * (1 + size())));
    auto& stream = gpu_.stream(device::StreamKind::kCompute);
    gpu_.copy_to_host(host, send, bytes, stream);
    stream.synchronize();
    STRATA_RETURN_IF_ERROR(host_.all_gather(host, host + bytes, count, dtype, what).wait());
    gpu_.copy_to_device(recv, host + bytes, bytes * size(), stream);
    stream.synchronize();
    return Status::ok();
  }
  Status reduce_scatter_sum(const void* send, void* recv, std::int64_t count, DType dtype,
                            std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    STRATA_ASSIGN_OR_RETURN(std::byte * host, staging(bytes * (1 + size())));
    auto& stream = gpu_.stream(device::StreamKind::kCompute);
    gpu_.copy_to_host(host, send, bytes * size(), stream);
    stream.synchronize();
    STRATA_RETURN_IF_ERROR(
        host_.reduce_scatter(host, host + bytes * size(), count, dtype, dist::ReduceOp::kSum, what)
            .wait());
    gpu_.copy_to_device(recv, host + bytes * size(), bytes, stream);
    stream.synchronize();
    return Status::ok();
  }

 private:
  Status reduce(dist::Communicator& comm, void* buffer, std::int64_t count, DType dtype,
                std::string_view what) {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    STRATA_ASSIGN_OR_RETURN(std::byte * host, staging(bytes));
    auto& stream = gpu_.stream(device::StreamKind::kCompute);
    gpu_.copy_to_host(host, buffer, bytes, stream);
    stream.synchronize();
    STRATA_RETURN_IF_ERROR(
        comm.all_reduce(host, host, count, dtype, dist::ReduceOp::kSum, what).wait());
    gpu_.copy_to_device(buffer, host, bytes, stream);
    stream.synchronize();
    return Status::ok();
  }
  Result<std::byte*> staging(std::size_t bytes) {
    if (staging_.size() < bytes) {
      STRATA_ASSIGN_OR_RETURN(staging_, gpu_.allocate_pinned(bytes, "tensor-parallel staging"));
    }
    return static_cast<std::byte*>(staging_.data());
  }

  dist::Communicator& host_;
  device::Device& gpu_;
  int kv_replicas_;
  std::unique_ptr<dist::Communicator> replicas_;
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
        StagedTensorGroup group(*ranks.comms[static_cast<std::size_t>(rank)], **gpu,
                                golden.config.num_key_value_heads);
        const Status made = group.init();
        std::string failures = made.is_ok() ? testing::tensor_parallel_golden_step(
                                                  golden, **gpu, group, false, sequence_parallel)
                                            : made.to_string();
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
