// Every collective against a serial reference, for whatever world size mpirun starts (ctest runs
// this with 1, 2, 3 and 4 ranks; one rank is the single-rank communicator), including counts that
// are not multiples of anything (and in-place all-reduces of 64 KiB or more, which go from a copy
// on 4 ranks or more).
#include "strata/dist/communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "tests/testing/all_to_all_check.h"
#include "tests/testing/mpi_env.h"

namespace strata::dist {
namespace {

// The value rank r contributes at index i: known to every rank, so each can check the result.
float value(int r, std::int64_t i) {
  Rng rng(static_cast<std::uint64_t>(r) * 1000003u + static_cast<std::uint64_t>(i));
  return static_cast<float>(rng.normal());
}

using Env = ::strata::testing::MpiEnv;
Env& env() { return ::strata::testing::mpi_env(); }

std::vector<std::uint16_t> to_half(const std::vector<float>& v, DType d) {
  std::vector<std::uint16_t> out(v.size());
  convert(v.data(), DType::kF32, out.data(), d, v.size());
  return out;
}

class CommTest : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(CommTest, AllGather) {
  Communicator& c = *env().comm;
  const std::int64_t n = GetParam();
  const int w = c.world_size();
  std::vector<float> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n * w), NAN);
  for (std::int64_t i = 0; i < n; ++i) send[static_cast<std::size_t>(i)] = value(c.rank(), i);
  ASSERT_TRUE(c.all_gather(send.data(), recv.data(), n, DType::kF32, "test").wait().is_ok());
  for (int r = 0; r < w; ++r)
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[static_cast<std::size_t>(r * n + i)], value(r, i));
}

// A sum of w f32 values in any order, rounded to f32: (w - 1) roundings of partial sums, each at
// most u = 2^-24 of sum |v_r|, and the result's own; an average adds one division's rounding.
double f32_sum_bound(int w, double abs_sum, double want) {
  constexpr double kU = 0x1p-24;
  return std::max(w - 1, 0) * kU * abs_sum + 2 * kU * std::abs(want);
}

TEST_P(CommTest, ReduceScatterSumAndAvg) {
  Communicator& c = *env().comm;
  const std::int64_t n = GetParam();
  const int w = c.world_size();
  std::vector<float> send(static_cast<std::size_t>(n * w));
  for (std::int64_t i = 0; i < n * w; ++i) send[static_cast<std::size_t>(i)] = value(c.rank(), i);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    std::vector<float> recv(static_cast<std::size_t>(n), NAN);
    ASSERT_TRUE(
        c.reduce_scatter(send.data(), recv.data(), n, DType::kF32, op, "test").wait().is_ok());
    for (std::int64_t i = 0; i < n; ++i) {
      double want = 0, abs_sum = 0;
      for (int r = 0; r < w; ++r) {
        want += value(r, c.rank() * n + i);
        abs_sum += std::abs(value(r, c.rank() * n + i));
      }
      if (op == ReduceOp::kAvg) want /= w, abs_sum /= w;
      ASSERT_NEAR(recv[static_cast<std::size_t>(i)], want, f32_sum_bound(w, abs_sum, want));
    }
  }
}

TEST_P(CommTest, AllReduceInPlaceAndOutOfPlace) {
  Communicator& c = *env().comm;
  const std::int64_t n = GetParam();
  const int w = c.world_size();
  std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n), NAN);
  for (std::int64_t i = 0; i < n; ++i) a[static_cast<std::size_t>(i)] = value(c.rank(), i);
  ASSERT_TRUE(
      c.all_reduce(a.data(), b.data(), n, DType::kF32, ReduceOp::kSum, "test").wait().is_ok());
  ASSERT_TRUE(
      c.all_reduce(a.data(), a.data(), n, DType::kF32, ReduceOp::kAvg, "test").wait().is_ok());
  for (std::int64_t i = 0; i < n; ++i) {
    double want = 0, abs_sum = 0;
    for (int r = 0; r < w; ++r) want += value(r, i), abs_sum += std::abs(value(r, i));
    ASSERT_NEAR(b[static_cast<std::size_t>(i)], want, f32_sum_bound(w, abs_sum, want));
    ASSERT_NEAR(a[static_cast<std::size_t>(i)], want / w, f32_sum_bound(w, abs_sum / w, want / w));
  }
}

TEST_P(CommTest, HalfPrecisionReductionsRoundOnce) {
  Communicator& c = *env().comm;
  const std::int64_t n = GetParam();
  const int w = c.world_size();
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<float> mine(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) mine[static_cast<std::size_t>(i)] = value(c.rank(), i);
    auto buf = to_half(mine, d);
    ASSERT_TRUE(c.all_reduce(buf.data(), buf.data(), n, d, ReduceOp::kSum, "test").wait().is_ok());
    for (std::int64_t i = 0; i < n; ++i) {
      double want = 0, abs_sum = 0;
      for (int r = 0; r < w; ++r) {
        const double v = load_as_f32(to_half({value(r, i)}, d).data(), d, 0);
        want += v;
        abs_sum += std::abs(v);
      }
      const double got = load_as_f32(buf.data(), d, static_cast<std::size_t>(i));
      // Each of the w - 1 pairwise sums (in f32, exact for two half values of nearby exponent)
      // rounds to the half type once: at most u_half of a partial sum, itself <= sum |v_r|.
      const double u_half = d == DType::kBF16 ? 0x1p-8 : 0x1p-11;
      ASSERT_NEAR(got, want, (w - 1) * u_half * abs_sum) << dtype_name(d) << " i=" << i;
    }
  }
}

TEST_P(CommTest, BroadcastAndGatherHost) {
  Communicator& c = *env().comm;
  const std::int64_t n = GetParam();
  const int w = c.world_size();
  const int root = w - 1;
  std::vector<float> buf(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) buf[static_cast<std::size_t>(i)] = value(c.rank(), i);
  ASSERT_TRUE(c.broadcast(buf.data(), n, DType::kF32, root, "test").wait().is_ok());
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(buf[static_cast<std::size_t>(i)], value(root, i));
  std::vector<float> mine(static_cast<std::size_t>(n)), all(static_cast<std::size_t>(n * w), NAN);
  for (std::int64_t i = 0; i < n; ++i) mine[static_cast<std::size_t>(i)] = value(c.rank(), i);
  ASSERT_TRUE(c.gather_host(mine.data(), all.data(), n, DType::kF32, 0, "test").is_ok());
  if (c.rank() == 0) {
    for (int r = 0; r < w; ++r)
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(all[static_cast<std::size_t>(r * n + i)], value(r, i));
  }
}

// Point-to-point around the ring of whatever ranks mpirun starts: every rank sends three
// messages to the next and receives three from the previous, all issued before any is waited
// for (MPI matches them in order), in f32 and bf16.
TEST_P(CommTest, SendsAndReceivesMatchInOrderAroundARing) {
  Communicator& c = *env().comm;
  const int w = c.world_size();
  if (w < 2) GTEST_SKIP() << "point-to-point needs two ranks";
  const std::int64_t n = GetParam();
  const int next = (c.rank() + 1) % w, prev = (c.rank() + w - 1) % w;
  for (DType d : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(d));
    std::vector<std::vector<float>> out(3, std::vector<float>(static_cast<std::size_t>(n)));
    std::vector<std::vector<std::uint16_t>> out16(3), in16(3);
    std::vector<std::vector<float>> in(3, std::vector<float>(static_cast<std::size_t>(n), NAN));
    std::vector<CommHandle> handles;
    for (int m = 0; m < 3; ++m) {
      for (std::int64_t i = 0; i < n; ++i) {
        out[m][static_cast<std::size_t>(i)] = value(c.rank() * 10 + m, i);
      }
      if (d == DType::kBF16) {
        out16[m] = to_half(out[m], d);
        in16[m].assign(static_cast<std::size_t>(n), 0);
        handles.push_back(c.send(out16[m].data(), n, d, next, "activations"));
        handles.push_back(c.recv(in16[m].data(), n, d, prev, "activations"));
      } else {
        handles.push_back(c.send(out[m].data(), n, d, next, "activations"));
        handles.push_back(c.recv(in[m].data(), n, d, prev, "activations"));
      }
    }
    for (auto& h : handles) ASSERT_TRUE(h.wait().is_ok());
    for (int m = 0; m < 3; ++m) {
      std::vector<float> want(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i)
        want[static_cast<std::size_t>(i)] = value(prev * 10 + m, i);
      if (d == DType::kBF16) {
        ASSERT_EQ(in16[m], to_half(want, d));
      } else {
        ASSERT_EQ(in[m], want);
      }
    }
  }
}

// A count for each pair, some none: every block lands at its sender's place, in rank order.
TEST_P(CommTest, AllToAllWithACountForEachPair) {
  ::strata::testing::check_all_to_all(*env().comm, GetParam() % 9000);
}

INSTANTIATE_TEST_SUITE_P(Counts, CommTest, ::testing::Values(1, 7, 1000, 65537));

// A send, however small, is done only once its receive is posted (as NCCL's are), never from a
// copy in MPI's buffers: a pipeline schedule that relies on buffering fails here, not first on
// GPUs. Rank 1 posts its receive only after a barrier that rank 0 enters after checking.
TEST(CommPointToPoint, ASendIsDoneOnlyOnceItsReceiveIsPosted) {
  Communicator& c = *env().comm;
  if (c.world_size() < 2) GTEST_SKIP() << "point-to-point needs two ranks";
  if (c.rank() < 2) {
    ASSERT_TRUE(c.connect(std::vector<int>{1 - c.rank()}, "test").is_ok());
  }
  float x = 1.5f, y = 0.0f;
  if (c.rank() == 0) {
    CommHandle h = c.send(&x, 1, DType::kF32, 1, "early send");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(h.ready()) << "the send finished before rank 1 posted its receive";
    ASSERT_TRUE(c.barrier("receive not yet posted").is_ok());
    ASSERT_TRUE(h.wait().is_ok());
  } else if (c.rank() == 1) {
    ASSERT_TRUE(c.barrier("receive not yet posted").is_ok());
    ASSERT_TRUE(c.recv(&y, 1, DType::kF32, 0, "late receive").wait().is_ok());
    EXPECT_EQ(y, 1.5f);
  } else {
    ASSERT_TRUE(c.barrier("receive not yet posted").is_ok());
  }
}

TEST(CommHost, ReductionsAndGathers) {
  Communicator& c = *env().comm;
  double v[2] = {static_cast<double>(c.rank()), 1.0};
  ASSERT_TRUE(c.all_reduce_host(v, 2, ReduceOp::kSum, "test").is_ok());
  const int w = c.world_size();
  EXPECT_EQ(v[0], w * (w - 1) / 2.0);
  EXPECT_EQ(v[1], w);
  const std::uint64_t mine = 100 + static_cast<std::uint64_t>(c.rank());
  std::vector<std::uint64_t> all(static_cast<std::size_t>(w));
  ASSERT_TRUE(c.all_gather_host(&mine, all.data(), 1, "test").is_ok());
  for (int r = 0; r < w; ++r)
    EXPECT_EQ(all[static_cast<std::size_t>(r)], 100u + static_cast<std::uint64_t>(r));
  EXPECT_TRUE(c.barrier("test").is_ok());
  // Volume accounting: an all-gather of n floats moves world * n * 4 bytes into every rank.
  const std::uint64_t before = c.stats().all_gather_bytes;
  std::vector<float> send(10, 1.0f), recv(static_cast<std::size_t>(10 * w));
  ASSERT_TRUE(c.all_gather(send.data(), recv.data(), 10, DType::kF32, "test").wait().is_ok());
  EXPECT_EQ(c.stats().all_gather_bytes - before,
            static_cast<std::uint64_t>(10 * 4 * (w == 1 ? 1 : w)));
}

}  // namespace
}  // namespace strata::dist

int main(int argc, char** argv) { return strata::testing::run_mpi_tests(argc, argv); }
