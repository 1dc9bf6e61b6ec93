// Device::allocate_pinned and Device::register_host on the CPU backend: huge-page-aligned, usable
// memory outside the device budget, locked where the system allows, released by the RAII owners.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "strata/sys/host_mapping.h"
#include "tests/unit/device/ops_test_util.h"

namespace strata::device {
namespace {

TEST(PinnedMemoryTest, CpuPinnedBufferIsAlignedUsableAndOutsideTheBudget) {
  auto dev = testing::make_device(1, 1 << 20);
  auto p = dev->allocate_pinned(3 << 20, "staging");  // larger than the 1 MiB device budget
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->size(), 3u << 20);
  // The one kind of DMA memory (sys/host_mapping.h): 2 MiB-aligned, so its whole 2 MiB pieces
  // can be huge pages.
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p->data()) % sys::HostMapping::kHugePageBytes, 0u);
  EXPECT_EQ(dev->memory_stats().in_use_bytes, 0u);
  std::memset(p->data(), 0x3C, p->size());
  // Copies from pinned memory through the copy streams work like any others.
  auto d = dev->allocate(4096, "x");
  ASSERT_TRUE(d.is_ok());
  auto& s = dev->stream(StreamKind::kHostToDevice);
  dev->copy_to_device(d->data(), p->data(), 4096, s);
  s.synchronize();
  EXPECT_EQ(static_cast<unsigned char*>(d->data())[4095], 0x3C);
  // Move leaves the source empty; reset returns the memory.
  PinnedBuffer moved = std::move(p).value();
  EXPECT_FALSE(moved.empty());
  moved.reset();
  EXPECT_TRUE(moved.empty());
  EXPECT_TRUE(dev->allocate_pinned(0, "nothing")->empty());
}

TEST(PinnedMemoryTest, CpuRegistrationIsBestEffortAndUndone) {
  auto dev = testing::make_device(1);
  std::vector<unsigned char> host(1 << 20, 1);
  auto r = dev->register_host(host.data(), host.size());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_FALSE(r->empty());
  HostRegistration moved = std::move(r).value();
  moved.reset();
  EXPECT_TRUE(moved.empty());
  EXPECT_EQ(host[12345], 1);
}

// Strict host memory: copies from and to pinned or registered memory work; one touching plain
// (pageable) memory stops the process naming the copy, the way a slow synchronous copy on CUDA
// would otherwise go unnoticed on a machine without a GPU.
TEST(PinnedMemoryTest, StrictModeRefusesCopiesFromUnpinnedHostMemory) {
  DeviceOptions o;
  o.strict_host_memory = true;
  auto dev = create_device(o);
  ASSERT_TRUE(dev.is_ok());
  Device& d = **dev;
  auto buf = d.allocate(8192, "x");
  ASSERT_TRUE(buf.is_ok());
  auto& s = d.stream(StreamKind::kHostToDevice);
  auto pinned = d.allocate_pinned(8192, "staging");
  ASSERT_TRUE(pinned.is_ok());
  d.copy_to_device(buf->data(), pinned->as<std::byte>() + 100, 8000, s);  // inside: fine
  std::vector<std::byte> registered(8192);
  {
    auto r = d.register_host(registered.data(), registered.size());
    ASSERT_TRUE(r.is_ok());
    d.copy_to_host(registered.data(), buf->data(), 8192, d.stream(StreamKind::kDeviceToHost));
    d.stream(StreamKind::kDeviceToHost).synchronize();
  }
  s.synchronize();
  std::vector<std::byte> plain(8192);
  EXPECT_DEATH(d.copy_to_device(buf->data(), plain.data(), 8192, s), "strict_host_memory");
  // Past the end of a pinned range is not inside it either.
  EXPECT_DEATH(d.copy_to_device(buf->data(), pinned->as<std::byte>() + 4096, 8192, s),
               "strict_host_memory");
  // Once the registration is gone, the range is plain memory again.
  EXPECT_DEATH(d.copy_to_host(registered.data(), buf->data(), 8192, s), "strict_host_memory");
}

}  // namespace
}  // namespace strata::device
