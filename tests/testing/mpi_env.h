// Shared setup of the multi-rank test binaries in tests/mpi: one CPU device and one communicator
// for the whole process (MPI under mpirun, else single rank), and a main() in which rank 0 alone
// prints and a failure on any rank fails every rank's exit code.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/sys/environment.h"

namespace strata::testing {

struct MpiEnv {
  std::unique_ptr<device::Device> device;
  std::unique_ptr<dist::Communicator> comm;
};

// Created on first use, kept until exit (MPI is initialized once per process).
inline MpiEnv& mpi_env() {
  static MpiEnv e = [] {
    MpiEnv x;
    x.device = std::move(*device::create_device(device::DeviceOptions{}));
    dist::CommOptions o;
    o.backend =
        sys::read_launch()->multiple_ranks() ? dist::CommBackend::kMpi : dist::CommBackend::kSingle;
    o.timeout = std::chrono::seconds(60);
    auto c = dist::create_communicator(o, *x.device);
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    x.comm = std::move(*c);
    return x;
  }();
  return e;
}

// The body of a tests/mpi binary's main().
inline int run_mpi_tests(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dist::Communicator& comm = *mpi_env().comm;
  if (comm.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  // A failure on any rank fails every rank, so mpirun's exit code reflects it.
  double failed = rc != 0 ? 1.0 : 0.0;
  (void)comm.all_reduce_host(&failed, 1, dist::ReduceOp::kSum, "result");
  return failed > 0 ? 1 : 0;
}

}  // namespace strata::testing
