// Devices and swap spaces for tests above the device and io modules: a one-thread CPU device with
// an optional budget, and a swap space (in memory unless a directory is given) with small
// requests and optional injected faults.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/device/device.h"
#include "strata/io/fault_injection.h"
#include "strata/io/swap.h"

namespace strata::testing {

inline std::unique_ptr<device::Device> make_cpu_device(std::uint64_t limit_bytes = 0) {
  device::DeviceOptions o;
  o.kind = device::DeviceKind::kCpu;
  o.memory_limit_bytes = limit_bytes;
  o.compute_threads = 1;
  auto d = device::create_device(o);
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  return d.is_ok() ? std::move(d).value() : nullptr;
}

// In memory; with `dir`, files there through the default engine (io_uring where it works).
inline std::unique_ptr<io::SwapSpace> make_swap(io::FaultInjection faults = {},
                                                std::size_t block_size_bytes = 16 * 1024,
                                                const std::string& dir = "") {
  io::SwapOptions o;
  o.engine = dir.empty() ? io::SwapEngine::kMemory : io::SwapEngine::kAuto;
  if (!dir.empty()) o.paths = {dir};
  o.block_size_bytes = block_size_bytes;
  o.queue_depth = 4;
  o.posix_threads = 2;
  o.fault_injection = std::move(faults);
  auto s = io::SwapSpace::create(o);
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return s.is_ok() ? std::move(s).value() : nullptr;
}

}  // namespace strata::testing
