// The NCCL communicator on one GPU (one rank: NCCL refuses two ranks on the same GPU): every
// collective gives the serial result, reading input that kernels on the compute stream wrote just
// before it (the collectives run on a stream of their own and must wait for that work). Skips
// without a GPU; built with CUDA and NCCL (one process needs no MPI).
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA && STRATA_HAVE_NCCL

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "kernels/runtime.h"
#include "strata/core/dtype.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"

namespace strata::dist {
namespace {

TEST(CudaNcclTest, CollectivesSeeTheComputeStreamsWritesAndGiveTheSerialResult) {
  const kernels::GpuInfo info = kernels::query_gpus();
  if (info.count == 0) GTEST_SKIP() << "no GPU: " << info.error;
  device::DeviceOptions dopts;
  dopts.kind = device::DeviceKind::kCuda;
  dopts.memory_limit_bytes = std::uint64_t{512} << 20;
  auto dev = device::create_device(dopts);
  ASSERT_TRUE(dev.is_ok()) << dev.status().message();
  device::Device& d = **dev;
  CommOptions copts;
  copts.backend = dist::CommBackend::kNccl;
  copts.timeout = std::chrono::seconds(60);
  auto made = create_communicator(copts, d);
  ASSERT_TRUE(made.is_ok()) << made.status().message();
  Communicator& comm = **made;
  ASSERT_EQ(comm.name(), "nccl");
  ASSERT_EQ(comm.world_size(), 1);

  constexpr std::int64_t kN = std::int64_t{1} << 22;  // 16 MiB of f32: the doubling takes a while
  std::vector<float> host(static_cast<std::size_t>(kN));
  for (std::int64_t i = 0; i < kN; ++i) host[static_cast<std::size_t>(i)] = 0.25f * (i % 1001);
  const std::size_t bytes = host.size() * sizeof(float);
  device::Stream& compute = d.stream(device::StreamKind::kCompute);
  auto in = d.allocate(bytes, "nccl test input");
  auto out = d.allocate(bytes, "nccl test output");
  ASSERT_TRUE(in.is_ok() && out.is_ok());
  std::vector<float> back(host.size());

  // Each collective reads `in` right after a kernel on the compute stream doubled it.
  auto run = [&](const char* what, auto issue) {
    SCOPED_TRACE(what);
    d.copy_to_device(in->data(), host.data(), bytes, compute);
    d.fill_zero(out->data(), bytes, compute);
    d.ops().add(in->data(), in->data(), in->data(), kN, DType::kF32);
    const Status s = issue().wait();
    ASSERT_TRUE(s.is_ok()) << s.message();
    d.copy_to_host(back.data(), out->data(), bytes, compute);
    compute.synchronize();
    for (std::size_t i = 0; i < host.size(); ++i) {
      ASSERT_EQ(back[i], 2.0f * host[i]) << "element " << i;
    }
  };
  run("all_gather", [&] { return comm.all_gather(in->data(), out->data(), kN, DType::kF32, "t"); });
  run("reduce_scatter", [&] {
    return comm.reduce_scatter(in->data(), out->data(), kN, DType::kF32, ReduceOp::kSum, "t");
  });
  run("all_reduce", [&] {
    return comm.all_reduce(in->data(), out->data(), kN, DType::kF32, ReduceOp::kAvg, "t");
  });
  run("broadcast", [&] {
    CommHandle h = comm.broadcast(in->data(), kN, DType::kF32, 0, "t");
    Status s = h.wait();
    // Broadcast is in place: move the result where the check reads it.
    d.ops().cast(in->data(), DType::kF32, out->data(), DType::kF32, kN);
    struct Done final : CommHandle::State {
      Status s;
      Status wait() override { return s; }
    };
    auto done = std::make_shared<Done>();
    done->s = s;
    return CommHandle(done);
  });
  run("all_to_all_v", [&] {
    const std::int64_t counts[1] = {kN};
    return comm.all_to_all_v(in->data(), counts, out->data(), counts, DType::kF32, "t");
  });
  EXPECT_EQ(comm.stats().collectives, 5u);
  EXPECT_EQ(comm.stats().all_to_all_bytes, 0u);  // nothing left the rank

  // A split on the tensor-parallel group's own stream (the process grid's tensor axis) orders
  // its collectives after the compute stream's work the same way.
  auto split = comm.split(0, 0, "test split", device::StreamKind::kTensorCollective);
  ASSERT_TRUE(split.is_ok()) << split.status().message();
  run("all_reduce on the tensor stream", [&] {
    return (*split)->all_reduce(in->data(), out->data(), kN, DType::kF32, ReduceOp::kSum, "t");
  });
}

// A handle shares the NCCL communicator, so waiting on it after the Communicator object is gone
// (an error path that unwinds the owner first) is safe; and a buffer freed right after a
// collective is enqueued is not reused until the collective stream is past it.
TEST(CudaNcclTest, HandlesOutliveTheCommunicatorAndFreesWaitForCollectives) {
  const kernels::GpuInfo info = kernels::query_gpus();
  if (info.count == 0) GTEST_SKIP() << "no GPU: " << info.error;
  device::DeviceOptions dopts;
  dopts.kind = device::DeviceKind::kCuda;
  dopts.memory_limit_bytes = std::uint64_t{256} << 20;
  auto dev = device::create_device(dopts);
  ASSERT_TRUE(dev.is_ok()) << dev.status().message();
  device::Device& d = **dev;
  constexpr std::int64_t kN = std::int64_t{1} << 24;  // 64 MiB of f32
  const std::size_t bytes = static_cast<std::size_t>(kN) * sizeof(float);
  device::Stream& compute = d.stream(device::StreamKind::kCompute);
  auto out = d.allocate(bytes, "nccl test output");
  ASSERT_TRUE(out.is_ok());
  CommHandle h;
  {
    CommOptions copts;
    copts.backend = dist::CommBackend::kNccl;
    copts.timeout = std::chrono::seconds(60);
    auto made = create_communicator(copts, d);
    ASSERT_TRUE(made.is_ok()) << made.status().message();
    auto in = d.allocate(bytes, "nccl test input");
    ASSERT_TRUE(in.is_ok());
    std::vector<float> ones(static_cast<std::size_t>(kN), 1.0f);
    d.copy_to_device(in->data(), ones.data(), bytes, compute);
    h = (*made)->all_reduce(in->data(), out->data(), kN, DType::kF32, ReduceOp::kSum, "t");
    in->reset();  // freed while the collective may still read it
    // The next allocation of that size must not be handed the same block before the
    // collective is done; writing it on the compute stream would corrupt the sum otherwise.
    auto reuse = d.allocate(bytes, "reuse");
    ASSERT_TRUE(reuse.is_ok());
    d.fill_zero(reuse->data(), bytes, compute);
    compute.synchronize();
  }  // the Communicator goes first
  const Status s = h.wait();
  ASSERT_TRUE(s.is_ok()) << s.message();
  std::vector<float> back(static_cast<std::size_t>(kN));
  d.copy_to_host(back.data(), out->data(), bytes, compute);
  compute.synchronize();
  for (std::size_t i = 0; i < back.size(); i += 4099) ASSERT_EQ(back[i], 1.0f) << "element " << i;
  EXPECT_TRUE(d.last_error().is_ok()) << d.last_error().message();
}

}  // namespace
}  // namespace strata::dist

#endif  // STRATA_HAVE_CUDA && STRATA_HAVE_NCCL
