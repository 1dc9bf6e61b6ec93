// In-process ranks for tests: a CPU device per rank, the communicators of one
// dist::make_in_process_group over them, and a runner that gives each rank its own thread.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"

namespace strata::testing {

struct InProcessRanks {
  std::vector<std::unique_ptr<device::Device>> devices;
  std::vector<std::unique_ptr<dist::Communicator>> comms;

  // Runs body(rank) on one thread per rank and joins them all.
  void run(const std::function<void(int)>& body) {
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < comms.size(); ++r) {
      threads.emplace_back([&body, r] { body(static_cast<int>(r)); });
    }
    for (auto& t : threads) t.join();
  }
};

inline InProcessRanks make_in_process_ranks(
    int world, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  InProcessRanks g;
  std::vector<device::Device*> raw;
  for (int r = 0; r < world; ++r) {
    device::DeviceOptions o;
    o.compute_threads = 1;  // ranks share the machine's cores
    auto d = device::create_device(o);
    EXPECT_TRUE(d.is_ok()) << d.status().to_string();
    raw.push_back(d->get());
    g.devices.push_back(std::move(*d));
  }
  auto comms = dist::make_in_process_group(raw, timeout);
  EXPECT_TRUE(comms.is_ok()) << comms.status().to_string();
  g.comms = std::move(*comms);
  return g;
}

}  // namespace strata::testing
