// The in-process communicator (ranks as threads): every collective against a serial reference
// for 1 to 4 ranks, in place as well, sums in the canonical tree (pairs of ranks, then pairs of
// pairs) in f32, bf16 rounded once, as the MPI reduce-scatter does,
// and the errors: ranks that disagree, a rank that never comes, a bad root, a GPU-less device.
// The same collectives through testing::StagedCommunicator (device buffers staged through pinned
// host memory, as the GPU tests' ranks on one GPU meet) give the same results.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "tests/testing/all_to_all_check.h"
#include "tests/testing/in_process_ranks.h"
#include "tests/testing/staged_communicator.h"

namespace strata::dist {
namespace {

// The value rank r contributes at index i: every thread can compute every rank's.
float value(int r, std::int64_t i) {
  Rng rng(static_cast<std::uint64_t>(r) * 1000003u + static_cast<std::uint64_t>(i));
  return static_cast<float>(rng.normal());
}

// The ranks' sum as the canonical tree pairs them, written out for 1 to 4 ranks.
template <typename Leaf>
float tree_sum(int world, Leaf x) {
  switch (world) {
    case 1:
      return 0.0f + x(0);
    case 2:
      return (0.0f + x(0)) + x(1);
    case 3:
      return ((0.0f + x(0)) + x(1)) + (0.0f + x(2));
    default:
      return ((0.0f + x(0)) + x(1)) + ((0.0f + x(2)) + x(3));
  }
}

using Group = ::strata::testing::InProcessRanks;

Group make_group(int world, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  return ::strata::testing::make_in_process_ranks(world, timeout);
}

// The ranks of a group, each one's collectives staged through pinned memory of its own device.
Group make_staged_group(int world) {
  Group g = make_group(world);
  for (std::size_t r = 0; r < g.comms.size(); ++r) {
    g.comms[r] = std::make_unique<::strata::testing::StagedCommunicator>(std::move(g.comms[r]),
                                                                         *g.devices[r]);
  }
  return g;
}

// (ranks, staged)
class InProcessTest : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  Group group() const {
    return std::get<1>(GetParam()) ? make_staged_group(world()) : make_group(world());
  }
};

TEST_P(InProcessTest, EveryCollectiveMatchesTheSerialReference) {
  const int world = this->world();
  Group g = group();
  constexpr std::int64_t n = 1001;  // not a multiple of anything
  g.run([&](int rank) {
    Communicator& c = *g.comms[static_cast<std::size_t>(rank)];
    EXPECT_EQ(c.rank(), rank);
    EXPECT_EQ(c.world_size(), world);
    // all_gather, also in place (send inside recv at this rank's slot).
    std::vector<float> send(n), recv(static_cast<std::size_t>(n * world), NAN);
    for (std::int64_t i = 0; i < n; ++i) send[static_cast<std::size_t>(i)] = value(rank, i);
    ASSERT_TRUE(c.all_gather(send.data(), recv.data(), n, DType::kF32, "gather").wait().is_ok());
    std::vector<float> in_place(static_cast<std::size_t>(n * world), NAN);
    std::copy(send.begin(), send.end(), in_place.begin() + rank * n);
    ASSERT_TRUE(
        c.all_gather(in_place.data() + rank * n, in_place.data(), n, DType::kF32, "gather in place")
            .wait()
            .is_ok());
    for (int r = 0; r < world; ++r) {
      for (std::int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(recv[static_cast<std::size_t>(r * n + i)], value(r, i));
        ASSERT_EQ(in_place[static_cast<std::size_t>(r * n + i)], value(r, i));
      }
    }
    // reduce_scatter (sum) and all_reduce (average), in place: the canonical tree's sum.
    std::vector<float> big(static_cast<std::size_t>(n * world));
    for (std::int64_t i = 0; i < n * world; ++i) big[static_cast<std::size_t>(i)] = value(rank, i);
    std::vector<float> part(n);
    ASSERT_TRUE(c.reduce_scatter(big.data(), part.data(), n, DType::kF32, ReduceOp::kSum, "rs")
                    .wait()
                    .is_ok());
    for (std::int64_t i = 0; i < n; ++i) {
      const float want = tree_sum(world, [&](int r) { return value(r, rank * n + i); });
      ASSERT_EQ(part[static_cast<std::size_t>(i)], want) << "element " << i;
    }
    ASSERT_TRUE(c.all_reduce(send.data(), send.data(), n, DType::kF32, ReduceOp::kAvg, "ar")
                    .wait()
                    .is_ok());
    for (std::int64_t i = 0; i < n; ++i) {
      float want = tree_sum(world, [&](int r) { return value(r, i); });
      if (world > 1) want /= static_cast<float>(world);
      ASSERT_EQ(send[static_cast<std::size_t>(i)], want) << "element " << i;
    }
    // broadcast from the last rank.
    std::vector<float> b(n);
    for (std::int64_t i = 0; i < n; ++i) b[static_cast<std::size_t>(i)] = value(rank, i);
    ASSERT_TRUE(c.broadcast(b.data(), n, DType::kF32, world - 1, "bcast").wait().is_ok());
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(b[static_cast<std::size_t>(i)], value(world - 1, i));
    // Host helpers.
    double d[2] = {static_cast<double>(rank), 1.0};
    ASSERT_TRUE(c.all_reduce_host(d, 2, ReduceOp::kSum, "norms").is_ok());
    EXPECT_EQ(d[0], world * (world - 1) / 2.0);
    EXPECT_EQ(d[1], world);
    const std::uint64_t mine[2] = {static_cast<std::uint64_t>(rank), 7};
    std::vector<std::uint64_t> all(static_cast<std::size_t>(2 * world));
    ASSERT_TRUE(c.all_gather_host(mine, all.data(), 2, "ids").is_ok());
    for (int r = 0; r < world; ++r) EXPECT_EQ(all[static_cast<std::size_t>(2 * r)], r);
    std::vector<float> gathered(static_cast<std::size_t>(world), NAN);
    const float one = value(rank, 0);
    ASSERT_TRUE(c.gather_host(&one, gathered.data(), 1, DType::kF32, 0, "to root").is_ok());
    if (rank == 0) {
      for (int r = 0; r < world; ++r) EXPECT_EQ(gathered[static_cast<std::size_t>(r)], value(r, 0));
    }
    ASSERT_TRUE(c.barrier("end").is_ok());
  });
}

// bf16 sums are taken in f32 and rounded once: the bits one rank's f32 accumulator of the same
// gradients would round to.
TEST_P(InProcessTest, Bf16SumsAreTakenInF32AndRoundedOnce) {
  const int world = this->world();
  Group g = group();
  constexpr std::int64_t n = 4096;
  g.run([&](int rank) {
    Communicator& c = *g.comms[static_cast<std::size_t>(rank)];
    std::vector<bf16> v(n);
    for (std::int64_t i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = f32_to_bf16(value(rank, i));
    ASSERT_TRUE(
        c.all_reduce(v.data(), v.data(), n, DType::kBF16, ReduceOp::kSum, "bf16").wait().is_ok());
    for (std::int64_t i = 0; i < n; ++i) {
      const float acc =
          tree_sum(world, [&](int r) { return bf16_to_f32(f32_to_bf16(value(r, i))); });
      ASSERT_EQ(v[static_cast<std::size_t>(i)].bits, f32_to_bf16(acc).bits) << "element " << i;
    }
  });
}

// A count for each pair, some none: every block lands at its sender's place, in rank order.
TEST_P(InProcessTest, AllToAllWithACountForEachPair) {
  Group g = group();
  for (const std::int64_t n : {1, 7, 1000}) {
    g.run([&](int rank) {
      ::strata::testing::check_all_to_all(*g.comms[static_cast<std::size_t>(rank)], n);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, InProcessTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "Staged" : "");
                         });

// all_to_all_v refuses counts of the wrong size or sign, naming them, and ranks whose counts
// disagree are told which pair and both counts (one rank: its two counts).
TEST(InProcess, AllToAllCountsThatDoNotFitAreRefused) {
  Group g = make_group(2);
  float x[8] = {}, y[8] = {};
  const std::int64_t three[3] = {1, 1, 1}, negative[2] = {1, -1}, two[2] = {1, 1};
  Status s = g.comms[0]->all_to_all_v(x, three, y, two, DType::kF32, "tokens").wait();
  EXPECT_NE(s.message().find("all_to_all_v 'tokens': send_counts holds 3 counts; expected one for "
                             "each of the 2 ranks"),
            std::string::npos)
      << s.message();
  s = g.comms[1]->all_to_all_v(x, two, y, negative, DType::kF32, "tokens").wait();
  EXPECT_NE(s.message().find("recv_counts[1] is -1; expected 0 or more"), std::string::npos)
      << s.message();

  std::vector<Status> got(2);
  g.run([&](int rank) {
    const std::int64_t sends[2] = {1, rank == 0 ? 2 : 1}, receives[2] = {1, 1};
    got[static_cast<std::size_t>(rank)] =
        g.comms[static_cast<std::size_t>(rank)]
            ->all_to_all_v(x, sends, y, receives, DType::kF32, "tokens")
            .wait();
  });
  for (const Status& st : got) {
    EXPECT_NE(st.message().find("rank 0 sends 2 elements to rank 1, which expects 1 from it"),
              std::string::npos)
        << st.message();
  }
  // One rank sends itself what it receives.
  const std::unique_ptr<Communicator> one = make_single_rank_communicator(*g.devices[0]);
  const std::int64_t out[1] = {2}, in[1] = {3};
  s = one->all_to_all_v(x, out, y, in, DType::kF32, "tokens").wait();
  EXPECT_NE(s.message().find("sends 2 elements to itself but receives 3"), std::string::npos)
      << s.message();
}

TEST(InProcess, RanksThatDisagreeAreToldBothCalls) {
  Group g = make_group(2);
  std::vector<Status> got(2);
  g.run([&](int rank) {
    Communicator& c = *g.comms[static_cast<std::size_t>(rank)];
    std::vector<float> x(8, 1.0f);
    got[static_cast<std::size_t>(rank)] =
        c.all_reduce(x.data(), x.data(), rank == 0 ? 8 : 4, DType::kF32, ReduceOp::kSum, "grads")
            .wait();
  });
  for (const Status& s : got) {
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("rank 0: all_reduce 'grads' (8 x f32)"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("rank 1: all_reduce 'grads' (4 x f32)"), std::string::npos)
        << s.message();
  }
}

// A rank that never comes: the one waiting is told which collective timed out and which rank
// never reached it, and the group stays broken for every later collective instead of hanging.
TEST(InProcess, ARankThatNeverComesTimesOutAndBreaksTheGroup) {
  Group g = make_group(2, std::chrono::milliseconds(50));
  const Status s = g.comms[0]->barrier("before the step");
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("rank 0: barrier 'before the step'"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("did not complete in time; rank 1 has not reached it"),
            std::string::npos)
      << s.message();
  const Status later = g.comms[1]->barrier("later");
  EXPECT_FALSE(later.is_ok());

  // Of four, ranks 0 and 2 come: both are told that ranks 1 and 3 never did.
  Group four = make_group(4, std::chrono::milliseconds(50));
  std::vector<Status> got(4);
  four.run([&](int rank) {
    if (rank % 2 == 1) return;
    got[static_cast<std::size_t>(rank)] = four.comms[static_cast<std::size_t>(rank)]->barrier("x");
  });
  for (int rank : {0, 2}) {
    const std::string& m = got[static_cast<std::size_t>(rank)].message();
    EXPECT_NE(m.find("ranks 1, 3 have not reached it"), std::string::npos) << m;
  }
}

// Point-to-point: around a ring, several messages a pair in order, each received as sent, also
// with every receive issued before its send and the handles waited for in reverse; a
// receive nobody sends to times out naming it; a receive whose send disagrees names both; a peer
// that is this rank or none is refused.
TEST_P(InProcessTest, SendsAndReceivesMatchInOrderAroundARing) {
  const int world = this->world();
  if (world < 2) GTEST_SKIP() << "point-to-point needs two ranks";
  Group g = group();
  constexpr std::int64_t n = 513;
  g.run([&](int rank) {
    Communicator& c = *g.comms[static_cast<std::size_t>(rank)];
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    std::vector<std::vector<float>> out(3, std::vector<float>(n)), in(3, std::vector<float>(n));
    for (int m = 0; m < 3; ++m) {
      for (std::int64_t i = 0; i < n; ++i) out[m][i] = value(rank * 10 + m, i);
      ASSERT_TRUE(c.send(out[m].data(), n, DType::kF32, next, "activations").wait().is_ok());
    }
    for (int m = 0; m < 3; ++m) {
      ASSERT_TRUE(c.recv(in[m].data(), n, DType::kF32, prev, "activations").wait().is_ok());
      for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(in[m][i], value(prev * 10 + m, i));
    }
    // Receives first (a stage posts them ahead of the work its peer waits for), then the sends,
    // then the receives' handles in reverse: each still gets the message of its place.
    std::vector<CommHandle> posted;
    for (int m = 0; m < 3; ++m) {
      std::fill(in[m].begin(), in[m].end(), NAN);
      posted.push_back(c.recv(in[m].data(), n, DType::kF32, prev, "gradients"));
    }
    for (int m = 0; m < 3; ++m) {
      ASSERT_TRUE(c.send(out[m].data(), n, DType::kF32, next, "gradients").wait().is_ok());
    }
    for (int m = 2; m >= 0; --m) {
      ASSERT_TRUE(posted[static_cast<std::size_t>(m)].wait().is_ok());
      for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(in[m][i], value(prev * 10 + m, i));
    }
    EXPECT_EQ(c.stats().sent_bytes, 6u * n * 4);
  });
}

TEST(InProcess, PointToPointErrorsNameTheCall) {
  Group g = make_group(2, std::chrono::milliseconds(50));
  float x[4] = {};
  Status s = g.comms[0]->recv(x, 4, DType::kF32, 1, "gradient of stage 1").wait();
  EXPECT_NE(s.message().find("rank 0: recv 'gradient of stage 1' from rank 1 did not complete"),
            std::string::npos)
      << s.message();
  // The receive that timed out keeps its place in the pair's order (as a posted MPI receive
  // does): the next message from rank 1 is its, so the mismatch is shown on a fresh pair.
  Group h = make_group(2, std::chrono::milliseconds(50));
  ASSERT_TRUE(h.comms[1]->send(x, 2, DType::kF32, 0, "activations").wait().is_ok());
  s = h.comms[0]->recv(x, 4, DType::kF32, 1, "activations of stage 1").wait();
  EXPECT_NE(s.message().find("of 4 x f32 from rank 1 met its send 'activations' of 2 x f32"),
            std::string::npos)
      << s.message();
  s = g.comms[0]->send(x, 4, DType::kF32, 0, "to myself").wait();
  EXPECT_NE(s.message().find("with rank 0: expected another rank of the 2"), std::string::npos)
      << s.message();
  EXPECT_FALSE(g.comms[0]->recv(x, 4, DType::kF32, 5, "nobody").wait().is_ok());
}

TEST(InProcess, BadRootsAndGroupsAreErrors) {
  Group g = make_group(1);
  float x = 1.0f;
  const Status s = g.comms[0]->broadcast(&x, 1, DType::kF32, 3, "weights").wait();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("root 3 is not a rank of 1"), std::string::npos) << s.message();
  EXPECT_FALSE(make_in_process_group({}).is_ok());
  EXPECT_FALSE(make_in_process_group({nullptr}).is_ok());
}

}  // namespace
}  // namespace strata::dist
