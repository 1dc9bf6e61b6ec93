// The process grid under mpirun (ctest runs this with 1, 2, 3 and 4 ranks): for every shape of
// the world size, each axis's communicator (MPI_Comm_split) holds exactly the ranks Megatron's
// order puts in its group, and its collectives reach only them.
#include <gtest/gtest.h>

#include <vector>

#include "strata/dist/process_grid.h"
#include "tests/testing/mpi_env.h"

namespace strata::dist {
namespace {

TEST(MpiProcessGrid, EveryShapeGroupsTheRightRanks) {
  auto& env = ::strata::testing::mpi_env();
  Communicator& world = *env.comm;
  const int w = world.world_size();
  for (int d = 1; d <= w; ++d) {
    for (int t = 1; t <= w; ++t) {
      if (w % (d * t) != 0) continue;
      const GridShape shape{d, t, w / (d * t)};
      SCOPED_TRACE(shape.to_string());
      auto made = ProcessGrid::create(world, shape, *env.device);
      ASSERT_TRUE(made.is_ok()) << made.status().to_string();
      ProcessGrid& grid = **made;
      const GridCoord c = grid.coord();
      ASSERT_EQ(grid_rank(shape, c), world.rank());
      Communicator* axes[] = {&grid.data(), &grid.tensor(), &grid.pipeline()};
      const int sizes[] = {shape.data, shape.tensor, shape.pipeline};
      const int coords[] = {c.data, c.tensor, c.pipeline};
      for (int axis = 0; axis < 3; ++axis) {
        Communicator& comm = *axes[axis];
        ASSERT_EQ(comm.world_size(), sizes[axis]);
        EXPECT_EQ(comm.rank(), coords[axis]);
        // The sum of the members' world ranks, from their coordinates.
        double want = 0;
        for (int k = 0; k < sizes[axis]; ++k) {
          GridCoord m = c;
          (axis == 0 ? m.data : axis == 1 ? m.tensor : m.pipeline) = k;
          want += grid_rank(shape, m);
        }
        double got = world.rank();
        ASSERT_TRUE(comm.all_reduce_host(&got, 1, ReduceOp::kSum, "member ranks").is_ok());
        EXPECT_EQ(got, want) << "axis " << axis;
      }
    }
  }
}

}  // namespace
}  // namespace strata::dist

int main(int argc, char** argv) { return strata::testing::run_mpi_tests(argc, argv); }
