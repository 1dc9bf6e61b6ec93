// The CUDA device itself: a clear error without a GPU (this runs everywhere), and on a GPU the
// budget (an error beyond it, never an overrun), peak tracking, reuse of freed blocks, copies
// across streams ordered by events, and pinned host memory.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kernels/runtime.h"
#include "tests/unit/device/cuda_test_util.h"

namespace strata::device {
namespace {

using testing::GpuTest;
using testing::make_gpu_device;

bool gpu_present() { return kernels::query_gpus().count > 0; }

TEST(CudaProbeTest, NoGpuIsAClearError) {
  if (gpu_present()) GTEST_SKIP() << "a GPU is present; this checks the message without one";
  DeviceOptions o;
  o.kind = device::DeviceKind::kCuda;
  o.memory_limit_bytes = std::uint64_t{1} << 30;
  auto d = create_device(o);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("no GPU"), std::string::npos) << d.status().message();
  EXPECT_NE(d.status().message().find("device: \"cpu\""), std::string::npos)
      << d.status().message();
  // The registry line says the same.
  EXPECT_NE(describe_backends().find("no GPU"), std::string::npos) << describe_backends();
}

class CudaDeviceTest : public GpuTest {};

TEST_F(CudaDeviceTest, MemoryLimitIsRequired) {
  DeviceOptions o;
  o.kind = device::DeviceKind::kCuda;
  auto d = create_device(o);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("device_memory_limit"), std::string::npos);
}

TEST_F(CudaDeviceTest, OutOfBudgetAllocationIsAnError) {
  std::string why;
  auto dev = make_gpu_device(&why, {}, 64 << 20);
  ASSERT_NE(dev, nullptr) << why;
  const MemoryStats base = dev->memory_stats();  // the cuBLAS workspace is in the budget
  EXPECT_EQ(base.limit_bytes, 64u << 20);
  EXPECT_GT(base.in_use_bytes, 0u);
  auto a = dev->allocate(20 << 20, "a");
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  auto too_big = dev->allocate(60 << 20, "the weights");
  ASSERT_FALSE(too_big.is_ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(too_big.status().message().find("the weights"), std::string::npos);
  EXPECT_NE(too_big.status().message().find("device_memory_limit"), std::string::npos);
  EXPECT_LE(dev->memory_stats().in_use_bytes, dev->memory_stats().limit_bytes);
  // What remains is usable to the byte (after rounding to 256).
  const std::uint64_t left = base.limit_bytes - dev->memory_stats().in_use_bytes;
  auto rest = dev->allocate(left, "rest");
  EXPECT_TRUE(rest.is_ok()) << rest.status().to_string();
  EXPECT_FALSE(dev->allocate(1, "one more byte").is_ok());
}

TEST_F(CudaDeviceTest, AccountingAndPeak) {
  const MemoryStats s0 = gpu_->memory_stats();
  {
    auto a = gpu_->allocate(1000, "a");  // rounded to 1024
    auto b = gpu_->allocate(3 << 20, "b");
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    EXPECT_EQ(gpu_->memory_stats().in_use_bytes, s0.in_use_bytes + 1024 + (3 << 20));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % 256, 0u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 256, 0u);
  }
  const MemoryStats s1 = gpu_->memory_stats();
  EXPECT_EQ(s1.in_use_bytes, s0.in_use_bytes);
  EXPECT_EQ(s1.peak_bytes, s0.in_use_bytes + 1024 + (3 << 20));
  EXPECT_EQ(s1.num_allocations, s0.num_allocations + 2);
  gpu_->reset_peak();
  EXPECT_EQ(gpu_->memory_stats().peak_bytes, s1.in_use_bytes);
}

// Freed blocks come back (after the GPU work before the free has finished): filling the budget
// again and again never fails.
TEST_F(CudaDeviceTest, FreedMemoryIsReused) {
  std::string why;
  auto dev = make_gpu_device(&why, {}, 256 << 20);
  ASSERT_NE(dev, nullptr) << why;
  const std::uint64_t avail = dev->memory_stats().limit_bytes - dev->memory_stats().in_use_bytes;
  for (int round = 0; round < 20; ++round) {
    std::vector<DeviceBuffer> bufs;
    for (std::uint64_t used = 0; used + (16 << 20) <= avail; used += 16 << 20) {
      auto b = dev->allocate(16 << 20, "chunk");
      ASSERT_TRUE(b.is_ok()) << "round " << round << ": " << b.status().to_string();
      dev->fill_zero(b->data(), b->size(), dev->stream(StreamKind::kCompute));
      bufs.push_back(std::move(b).value());
    }
  }
  EXPECT_TRUE(dev->last_error().is_ok());
}

TEST_F(CudaDeviceTest, CopiesAcrossStreamsOrderedByEvents) {
  const std::size_t n = 1 << 22;
  std::vector<float> src(n), back(n, -1.0f);
  std::iota(src.begin(), src.end(), 1.0f);
  auto buf = gpu_->allocate(n * 4, "x");
  auto buf2 = gpu_->allocate(n * 4, "y");
  ASSERT_TRUE(buf.is_ok() && buf2.is_ok());
  auto& h2d = gpu_->stream(StreamKind::kHostToDevice);
  auto& compute = gpu_->stream(StreamKind::kCompute);
  auto& d2h = gpu_->stream(StreamKind::kDeviceToHost);
  EXPECT_NE(h2d.native_handle(), nullptr);
  gpu_->copy_to_device(buf->data(), src.data(), n * 4, h2d);
  gpu_->wait_event(compute, gpu_->record_event(h2d));
  // y = x + x on the compute stream, then back through the d2h stream.
  gpu_ops().add(buf->data(), buf->data(), buf2->data(), static_cast<std::int64_t>(n), DType::kF32);
  gpu_->wait_event(d2h, gpu_->record_event(compute));
  gpu_->copy_to_host(back.data(), buf2->data(), n * 4, d2h);
  const Event done = gpu_->record_event(d2h);
  done.synchronize();
  EXPECT_TRUE(done.ready());
  for (std::size_t i = 0; i < n; i += 4099) ASSERT_EQ(back[i], 2 * src[i]) << i;
  EXPECT_TRUE(Event().ready());  // default events are complete
}

TEST_F(CudaDeviceTest, FillZeroAndPinnedRoundTrip) {
  const std::size_t n = 3 << 20;
  auto pinned = gpu_->allocate_pinned(n, "staging");
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  EXPECT_TRUE(pinned->page_locked());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pinned->data()) % 4096, 0u);
  std::memset(pinned->data(), 0x5A, n);
  auto buf = gpu_->allocate(n, "x");
  ASSERT_TRUE(buf.is_ok());
  auto& s = gpu_->stream(StreamKind::kHostToDevice);
  gpu_->copy_to_device(buf->data(), pinned->data(), n, s);
  gpu_->fill_zero(static_cast<std::byte*>(buf->data()) + 4096, 4096, s);
  std::vector<unsigned char> back(n);
  gpu_->copy_to_host(back.data(), buf->data(), n, s);
  s.synchronize();
  for (std::size_t i = 0; i < n; i += 511) {
    const bool zeroed = i >= 4096 && i < 8192;
    ASSERT_EQ(back[i], zeroed ? 0 : 0x5A) << i;
  }

  std::vector<unsigned char> host(1 << 20, 7);
  auto reg = gpu_->register_host(host.data(), host.size());
  ASSERT_TRUE(reg.is_ok()) << reg.status().to_string();
  EXPECT_TRUE(reg->page_locked());
  gpu_->copy_to_device(buf->data(), host.data(), host.size(), s);
  gpu_->copy_to_host(back.data(), buf->data(), host.size(), s);
  s.synchronize();
  EXPECT_EQ(back[12345], 7);
}

}  // namespace
}  // namespace strata::device

#endif  // STRATA_HAVE_CUDA
