// Shared pieces of the tiered store tests: a CPU device, an in-memory swap space (from
// tests/testing/backends.h), random bytes.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "tests/testing/backends.h"

namespace strata::mem::testing {

// True under ThreadSanitizer, where the randomized tests run fewer steps.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderTsan = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kUnderTsan = true;
#else
inline constexpr bool kUnderTsan = false;
#endif
#else
inline constexpr bool kUnderTsan = false;
#endif

using ::strata::testing::make_cpu_device;

inline std::unique_ptr<io::SwapSpace> make_memory_swap(io::FaultInjection faults = {},
                                                       std::size_t block_size_bytes = 16 * 1024) {
  return ::strata::testing::make_swap(std::move(faults), block_size_bytes);
}

inline std::vector<std::byte> random_bytes(std::size_t n, Rng& rng) {
  std::vector<std::byte> v(n);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t x = rng.next_u64();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<std::byte>(rng.next_u64());
  return v;
}

inline std::int64_t first_mismatch(const void* a, const void* b, std::size_t n) {
  const auto* x = static_cast<const std::byte*>(a);
  const auto* y = static_cast<const std::byte*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    if (x[i] != y[i]) return static_cast<std::int64_t>(i);
  }
  return -1;
}

inline StoreOptions small_options(std::uint64_t device_budget, std::uint64_t host_budget,
                                  std::uint64_t nvme_budget = 0) {
  StoreOptions o;
  o.budget_bytes = {device_budget, host_budget, nvme_budget};
  o.staging_buffer_bytes = 8 * 1024;
  o.num_staging_buffers = 3;
  return o;
}

}  // namespace strata::mem::testing
