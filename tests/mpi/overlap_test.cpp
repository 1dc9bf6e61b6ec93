// Collectives progress while the calling thread computes without making any MPI call: a
// collective issued before ~0.3 s of compute is finished by the time compute ends, so its wait
// returns in a small fraction of the time the same collective takes when waited on at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "tests/testing/mpi_env.h"

namespace strata::dist {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

using Env = ::strata::testing::MpiEnv;
Env& env() { return ::strata::testing::mpi_env(); }

// Stands in for a layer's forward or backward: keeps this thread busy for `ms` without any call
// into the communicator, as the model's compute does between issuing a collective and waiting.
double compute_for(double ms) {
  const auto start = Clock::now();
  double acc = 1.0;
  while (ms_since(start) < ms) {
    for (int i = 0; i < 10000; ++i) acc = acc * 1.0000001 + 1e-9;
  }
  return acc;
}

struct Timing {
  double immediate_ms;   // issue, then wait at once: the collective's own duration
  double overlapped_ms;  // issue, compute, then wait: what compute did not hide
};

// Sizes at which each collective takes a few ms to tens of ms on a loaded two-core machine.
constexpr std::int64_t kElems = std::int64_t{1} << 22;  // f32: 16 MiB per rank, bf16: 8 MiB

template <typename Issue>
Timing measure(Communicator& c, Issue issue, double compute_ms) {
  Timing t{};
  EXPECT_TRUE(c.barrier("overlap: align").is_ok());
  auto start = Clock::now();
  EXPECT_TRUE(issue().wait().is_ok());
  t.immediate_ms = ms_since(start);
  EXPECT_TRUE(c.barrier("overlap: align").is_ok());
  CommHandle h = issue();
  EXPECT_GT(compute_for(compute_ms), 0.0);  // uses the result, so the loop is not optimized out
  start = Clock::now();
  EXPECT_TRUE(h.wait().is_ok());
  t.overlapped_ms = ms_since(start);
  return t;
}

// Runs `issue` a fixed number of rounds (every rank the same, so the collectives match), each
// waited at once and overlapped with compute. A round hides the collective when its overlapped
// wait is below a tenth of the immediate one (or under 0.5 ms); the test wants most rounds hidden,
// so one stall of a loaded machine does not fail it, while a communicator that progresses only
// inside its wait fails nearly every round (the first steps of a collective, done when it is
// issued, sometimes cover it by luck on one round).
template <typename Issue>
void expect_overlap(const char* name, Issue issue) {
  Communicator& c = *env().comm;
  constexpr double kComputeMs = 300;
  constexpr int kRounds = 3;
  std::vector<Timing> rounds;
  int hidden = 0;
  for (int round = 0; round < kRounds; ++round) {
    const Timing t = measure(c, issue, kComputeMs);
    rounds.push_back(t);
    if (t.overlapped_ms < std::max(0.1 * t.immediate_ms, 0.5)) ++hidden;
    if (c.rank() == 0) {
      std::printf("%s np=%d round %d: immediate %.2f ms, after %.0f ms of compute %.2f ms\n", name,
                  c.world_size(), round, t.immediate_ms, kComputeMs, t.overlapped_ms);
    }
  }
  // The compute must be long enough to hide the whole collective, or the test proves nothing.
  double shortest = rounds[0].immediate_ms;
  for (const Timing& t : rounds) shortest = std::min(shortest, t.immediate_ms);
  ASSERT_LT(shortest, 0.8 * kComputeMs) << "collective too slow to be hidden by the compute";
  EXPECT_GE(hidden, kRounds - 1) << name << " on rank " << c.rank()
                                 << " progressed while the caller computed in only " << hidden
                                 << " of " << kRounds << " rounds: last round waited "
                                 << rounds.back().overlapped_ms << " ms after compute vs "
                                 << rounds.back().immediate_ms << " ms when waited at once";
}

std::vector<float> random_floats(std::int64_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = static_cast<float>(rng.normal());
  return v;
}

TEST(Overlap, AllGatherProgressesDuringCompute) {
  Communicator& c = *env().comm;
  if (c.world_size() < 2) GTEST_SKIP() << "one rank: collectives are local copies";
  const auto send = random_floats(kElems, 7 + static_cast<std::uint64_t>(c.rank()));
  std::vector<float> recv(static_cast<std::size_t>(kElems * c.world_size()));
  expect_overlap("all_gather", [&] {
    return c.all_gather(send.data(), recv.data(), kElems, DType::kF32, "overlap");
  });
  // The data arrived whole.
  for (int r = 0; r < c.world_size(); ++r) {
    const auto want = random_floats(kElems, 7 + static_cast<std::uint64_t>(r));
    ASSERT_TRUE(std::equal(want.begin(), want.end(),
                           recv.begin() + static_cast<std::ptrdiff_t>(r * kElems)))
        << "rank " << r << "'s block";
  }
}

TEST(Overlap, AllReduceProgressesDuringCompute) {
  Communicator& c = *env().comm;
  if (c.world_size() < 2) GTEST_SKIP() << "one rank: collectives are local copies";
  const auto send = random_floats(kElems, 11 + static_cast<std::uint64_t>(c.rank()));
  std::vector<float> recv(static_cast<std::size_t>(kElems));
  expect_overlap("all_reduce", [&] {
    return c.all_reduce(send.data(), recv.data(), kElems, DType::kF32, ReduceOp::kSum, "overlap");
  });
  std::vector<double> want(static_cast<std::size_t>(kElems), 0.0), abs_sum(want.size(), 0.0);
  for (int r = 0; r < c.world_size(); ++r) {
    const auto v = random_floats(kElems, 11 + static_cast<std::uint64_t>(r));
    for (std::size_t i = 0; i < v.size(); ++i) want[i] += v[i], abs_sum[i] += std::abs(v[i]);
  }
  // w - 1 roundings of partial sums in any order, each at most 2^-24 of sum |v_r|, and the
  // result's own.
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double bound = (c.world_size() - 1) * 0x1p-24 * abs_sum[i] + 0x1p-24 * std::abs(want[i]);
    ASSERT_NEAR(recv[i], want[i], bound) << "i=" << i;
  }
}

// The bf16 sum is a user-defined MPI op: the reduction's arithmetic also runs while progressing.
TEST(Overlap, Bf16AllReduceProgressesDuringCompute) {
  Communicator& c = *env().comm;
  if (c.world_size() < 2) GTEST_SKIP() << "one rank: collectives are local copies";
  const auto bf16_of_rank = [](int r) {
    const auto v = random_floats(kElems, 13 + static_cast<std::uint64_t>(r));
    std::vector<std::uint16_t> h(v.size());
    convert(v.data(), DType::kF32, h.data(), DType::kBF16, v.size());
    return h;
  };
  const auto send = bf16_of_rank(c.rank());
  std::vector<std::uint16_t> recv(send.size());
  expect_overlap("bf16 all_reduce", [&] {
    return c.all_reduce(send.data(), recv.data(), kElems, DType::kBF16, ReduceOp::kSum, "overlap");
  });
  std::vector<double> want(send.size(), 0.0), abs_sum(send.size(), 0.0);
  for (int r = 0; r < c.world_size(); ++r) {
    const auto h = bf16_of_rank(r);
    for (std::size_t i = 0; i < h.size(); ++i) {
      const double v = load_as_f32(h.data(), DType::kBF16, i);
      want[i] += v;
      abs_sum[i] += std::abs(v);
    }
  }
  // Each of the w - 1 pairwise sums rounds to bf16 once: at most 2^-8 of sum |v_r| each.
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(load_as_f32(recv.data(), DType::kBF16, i), want[i],
                (c.world_size() - 1) * 0x1p-8 * abs_sum[i])
        << "i=" << i;
  }
}

}  // namespace
}  // namespace strata::dist

int main(int argc, char** argv) { return strata::testing::run_mpi_tests(argc, argv); }
