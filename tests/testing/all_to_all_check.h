// all_to_all_v's check, the same for every transport: rank a sends rank b all_to_all_count(a, b)
// values (some pairs none, each rank some to itself), each naming its sender, its receiver and its
// place, so a block that lands at another rank's offset or in another order is seen.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "strata/dist/communicator.h"

namespace strata::testing {

inline std::int64_t all_to_all_count(int a, int b, std::int64_t n) {
  return ((a * 7 + b * 3 + n) % 5) * n / 2 + (a == b ? 1 : 0);
}
// Exact in f32 while a, b < 16 and i < 10000.
inline float all_to_all_value(int a, int b, std::int64_t i) {
  return static_cast<float>(a * 1000000 + b * 10000 + i);
}

// Runs one all_to_all_v on `c` with n's counts and checks what this rank received and what its
// counters say it sent.
inline void check_all_to_all(dist::Communicator& c, std::int64_t n) {
  const int me = c.rank(), world = c.world_size();
  std::vector<std::int64_t> sends, receives;
  std::vector<float> send, expected;
  std::uint64_t to_others = 0;
  for (int r = 0; r < world; ++r) {
    sends.push_back(all_to_all_count(me, r, n));
    receives.push_back(all_to_all_count(r, me, n));
    for (std::int64_t i = 0; i < sends.back(); ++i) send.push_back(all_to_all_value(me, r, i));
    for (std::int64_t i = 0; i < receives.back(); ++i) {
      expected.push_back(all_to_all_value(r, me, i));
    }
    if (r != me) to_others += static_cast<std::uint64_t>(sends.back()) * sizeof(float);
  }
  std::vector<float> got(expected.size(), -1.0f);
  const std::uint64_t before = c.stats().all_to_all_bytes;
  const Status s =
      c.all_to_all_v(send.data(), sends, got.data(), receives, DType::kF32, "tokens").wait();
  ASSERT_TRUE(s.is_ok()) << s.message();
  EXPECT_EQ(got, expected) << "rank " << me << " of " << world << ", n " << n;
  EXPECT_EQ(c.stats().all_to_all_bytes - before, to_others);
}

}  // namespace strata::testing
