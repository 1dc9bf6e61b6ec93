// A collective whose peers do not join in time fails its wait with a message naming the rank and
// the operation, while the communication thread keeps it in flight: when the peers join late it
// still completes, the communicator stays usable, and shutdown (MPI_Finalize) stays clean.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"

namespace strata::dist {
namespace {

struct Env {
  std::unique_ptr<device::Device> device;
  std::unique_ptr<Communicator> comm;
};

Env& env() {
  static Env e = [] {
    Env x;
    x.device = std::move(*device::create_device(device::DeviceOptions{}));
    CommOptions o;
    o.backend = launched_with_multiple_ranks() ? "mpi" : "single";
    o.timeout = std::chrono::seconds(60);
    auto c = create_communicator(o, *x.device);
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    x.comm = std::move(*c);
    return x;
  }();
  return e;
}

TEST(Timeout, LatePeersFailTheWaitButTheCollectiveStillCompletes) {
  Communicator& c = *env().comm;
  if (c.world_size() < 2) GTEST_SKIP() << "one rank: nothing to wait for";
  CommOptions o;
  o.backend = "mpi";
  o.timeout = std::chrono::seconds(1);
  auto made = create_communicator(o, *env().device);
  ASSERT_TRUE(made.is_ok()) << made.status().message();
  std::unique_ptr<Communicator> quick = std::move(*made);
  float values[3] = {1.0f, 2.0f, static_cast<float>(c.rank())};

  // Rank 0 reduces alone: the others are held back on the other communicator until it gives up.
  if (c.rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    const Status s =
        quick->all_reduce(values, values, 3, DType::kF32, ReduceOp::kSum, "late peers").wait();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.message();
    EXPECT_NE(s.message().find("rank 0: all_reduce 'late peers' did not complete in time; a peer "
                               "rank may have died or be stuck"),
              std::string::npos)
        << s.message();
    EXPECT_GE(seconds, 0.9);
    EXPECT_LT(seconds, 10.0);
  }
  ASSERT_TRUE(c.barrier("rank 0 gave up").is_ok());
  // The late peers join rank 0's reduction, still in flight on its communication thread.
  if (c.rank() != 0) {
    ASSERT_TRUE(quick->all_reduce(values, values, 3, DType::kF32, ReduceOp::kSum, "late peers")
                    .wait()
                    .is_ok());
  }
  EXPECT_TRUE(quick->barrier("after the late peers").is_ok());
  // Destroying the communicator waits (briefly) for rank 0's reduction to finish, so its buffer
  // is final afterwards; were it left in flight, MPI_Finalize would be skipped and mpirun fail.
  quick.reset();
  const int w = c.world_size();
  EXPECT_EQ(values[0], 1.0f * static_cast<float>(w));
  EXPECT_EQ(values[1], 2.0f * static_cast<float>(w));
  EXPECT_EQ(values[2], static_cast<float>(w * (w - 1) / 2));
}

}  // namespace
}  // namespace strata::dist

// Rank 0 reports; the others stay quiet unless something fails.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  strata::dist::env();
  if (strata::dist::env().comm->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  // A failure on any rank fails every rank, so mpirun's exit code reflects it.
  double failed = rc != 0 ? 1.0 : 0.0;
  (void)strata::dist::env().comm->all_reduce_host(&failed, 1, strata::dist::ReduceOp::kSum,
                                                  "result");
  return failed > 0 ? 1 : 0;
}
