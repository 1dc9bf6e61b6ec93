// The process grid over in-process ranks (threads): every shape of 4 ranks (and of 1), each
// axis's communicator (and the expert groups') holding exactly the ranks Megatron's order puts in
// its group, in coordinate order; coordinates and ranks round-trip; a shape that does not match is
// an error.
#include "strata/dist/process_grid.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "strata/device/device.h"
#include "tests/testing/in_process_ranks.h"
namespace strata::dist {
namespace {

using GridGroup = ::strata::testing::InProcessRanks;

GridGroup make_grid_group(int world, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  return ::strata::testing::make_in_process_ranks(world, timeout);
}

// The world ranks in this rank's group along one axis (data, tensor, pipeline, expert,
// expert-data), in order along it.
std::vector<int> members(const GridShape& s, const GridCoord& c, int axis) {
  std::vector<int> out;
  if (axis >= 3) {  // the expert groups: data ranks of one run of s.expert, or alike modulo it
    const int first = axis == 3 ? c.data - c.expert : c.expert;
    const int n = axis == 3 ? s.expert : s.data / s.expert;
    for (int k = 0; k < n; ++k) {
      GridCoord m = c;
      m.data = axis == 3 ? first + k : first + k * s.expert;
      out.push_back(grid_rank(s, m));
    }
    return out;
  }
  const int n = axis == 0 ? s.data : axis == 1 ? s.tensor : s.pipeline;
  for (int k = 0; k < n; ++k) {
    GridCoord m = c;
    (axis == 0 ? m.data : axis == 1 ? m.tensor : m.pipeline) = k;
    out.push_back(grid_rank(s, m));
  }
  return out;
}

// Every rank all-gathers its world rank over each axis: the result lists the axis's members.
void check_grid(GridGroup& g, const GridShape& shape) {
  SCOPED_TRACE(shape.to_string());
  g.run([&](int rank) {
    Communicator& world = *g.comms[static_cast<std::size_t>(rank)];
    auto made = ProcessGrid::create(world, shape, *g.devices[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    ProcessGrid& grid = **made;
    const GridCoord c = grid.coord();
    EXPECT_EQ(grid_rank(shape, c), rank);
    Communicator* axes[] = {&grid.data(), &grid.tensor(), &grid.pipeline(), &grid.expert(),
                            &grid.expert_data()};
    const int coords[] = {c.data, c.tensor, c.pipeline, c.expert, c.data / shape.expert};
    for (int axis = 0; axis < 5; ++axis) {
      Communicator& comm = *axes[axis];
      const std::vector<int> want = members(shape, c, axis);
      ASSERT_EQ(comm.world_size(), static_cast<int>(want.size())) << "axis " << axis;
      EXPECT_EQ(comm.rank(), coords[axis]) << "axis " << axis;
      const std::uint64_t mine = static_cast<std::uint64_t>(rank);
      std::vector<std::uint64_t> got(want.size());
      ASSERT_TRUE(comm.all_gather_host(&mine, got.data(), 1, "who").is_ok());
      for (std::size_t k = 0; k < want.size(); ++k) {
        EXPECT_EQ(got[k], static_cast<std::uint64_t>(want[k])) << "axis " << axis << " slot " << k;
      }
    }
    // An axis over every rank is the world communicator itself: no split, no new collective.
    if (shape.data == shape.size()) {
      EXPECT_EQ(&grid.data(), &world);
    }
  });
}

TEST(ProcessGrid, EveryShapeOfFourRanksGroupsTheRightRanks) {
  const GridShape shapes[] = {{4, 1, 1}, {1, 4, 1}, {1, 1, 4}, {2, 2, 1}, {2, 1, 2}, {1, 2, 2}};
  for (const GridShape& shape : shapes) {
    GridGroup g = make_grid_group(4);
    check_grid(g, shape);
  }
  GridGroup one = make_grid_group(1);
  check_grid(one, GridShape{});
}

// Experts over 2 or 4 of 4 data ranks, and over 2 data ranks beside tensor or pipeline pairs:
// each expert group is a run of data ranks, each expert-data group the data ranks alike modulo
// the expert size; one that is the whole data group is the data communicator itself.
TEST(ProcessGrid, ExpertGroupsSplitTheDataGroup) {
  const GridShape shapes[] = {{4, 1, 1, 2}, {4, 1, 1, 4}, {2, 2, 1, 2}, {2, 1, 2, 2}};
  for (const GridShape& shape : shapes) {
    GridGroup g = make_grid_group(4);
    check_grid(g, shape);
  }
  GridGroup g = make_grid_group(4);
  g.run([&](int rank) {
    Communicator& world = *g.comms[static_cast<std::size_t>(rank)];
    auto all = ProcessGrid::create(world, GridShape{4, 1, 1, 4},
                                   *g.devices[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(all.is_ok());
    EXPECT_EQ(&(*all)->expert(), &(*all)->data());
    EXPECT_EQ((*all)->expert_data().world_size(), 1);
  });
  GridGroup two = make_grid_group(2);
  two.run([&](int rank) {
    auto none = ProcessGrid::create(*two.comms[static_cast<std::size_t>(rank)], GridShape{2, 1, 1},
                                    *two.devices[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(none.is_ok());
    EXPECT_EQ(&(*none)->expert_data(), &(*none)->data());
    EXPECT_EQ((*none)->expert().world_size(), 1);
  });
}

// The grid's byte counts sum every axis's collectives: a 2 x 2 grid's data and tensor
// all-reduces (each over its own split communicator) and the world's.
TEST(ProcessGrid, StatsCountEveryAxis) {
  GridGroup g = make_grid_group(4);
  g.run([&](int rank) {
    device::Device& device = *g.devices[static_cast<std::size_t>(rank)];
    auto made =
        ProcessGrid::create(*g.comms[static_cast<std::size_t>(rank)], GridShape{2, 2, 1}, device);
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    ProcessGrid& grid = **made;
    const std::uint64_t before = grid.stats().all_reduce_bytes;
    auto buf = device.allocate(64 * sizeof(float), "stats test");
    ASSERT_TRUE(buf.is_ok());
    void* p = buf->data();
    device.fill_zero(p, 64 * sizeof(float), device.stream(device::StreamKind::kCompute));
    device.stream(device::StreamKind::kCompute).synchronize();
    ASSERT_TRUE(grid.data().all_reduce(p, p, 16, DType::kF32, ReduceOp::kSum, "d").wait().is_ok());
    ASSERT_TRUE(
        grid.tensor().all_reduce(p, p, 32, DType::kF32, ReduceOp::kSum, "t").wait().is_ok());
    ASSERT_TRUE(grid.world().all_reduce(p, p, 64, DType::kF32, ReduceOp::kSum, "w").wait().is_ok());
    EXPECT_EQ(grid.stats().all_reduce_bytes - before, (16 + 32 + 64) * sizeof(float));
  });
}

TEST(ProcessGrid, RanksAndCoordinatesRoundTrip) {
  const GridShape s{3, 2, 4};
  for (int r = 0; r < s.size(); ++r) EXPECT_EQ(grid_rank(s, grid_coord(s, r)), r);
  // Tensor ranks adjacent, then data, then pipeline.
  const GridCoord c = grid_coord(s, 7);
  EXPECT_EQ(c.tensor, 1);
  EXPECT_EQ(c.data, 0);
  EXPECT_EQ(c.pipeline, 1);
}

TEST(ProcessGrid, AShapeThatDoesNotMatchTheJobIsAnError) {
  GridGroup g = make_grid_group(1);
  auto bad = ProcessGrid::create(*g.comms[0], GridShape{2, 1, 1}, *g.devices[0]);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("data 2 x tensor 1 x pipeline 1 has 2 ranks, but the job "
                                        "has 1"),
            std::string::npos)
      << bad.status().message();
  auto zero = ProcessGrid::create(*g.comms[0], GridShape{1, 0, 1}, *g.devices[0]);
  EXPECT_FALSE(zero.is_ok());
  GridGroup three = make_grid_group(3);
  auto odd = ProcessGrid::create(*three.comms[0], GridShape{3, 1, 1, 2}, *three.devices[0]);
  ASSERT_FALSE(odd.is_ok());
  EXPECT_NE(odd.status().message().find("expert-parallel size 2 does not divide the "
                                        "data-parallel size 3"),
            std::string::npos)
      << odd.status().message();
}

// One rank alone owns its communicator: every axis is it, and a collective is the identity.
TEST(ProcessGrid, ASingleRankGridOwnsItsCommunicator) {
  GridGroup g = make_grid_group(1);
  std::unique_ptr<ProcessGrid> grid = ProcessGrid::single_rank(*g.devices[0]);
  ASSERT_NE(grid, nullptr);
  EXPECT_EQ(grid->shape().size(), 1);
  EXPECT_EQ(&grid->data(), &grid->world());
  EXPECT_EQ(&grid->tensor(), &grid->world());
  EXPECT_EQ(grid->world().world_size(), 1);
  double x = 3.5;
  ASSERT_TRUE(grid->data().all_reduce_host(&x, 1, ReduceOp::kSum, "test").is_ok());
  EXPECT_EQ(x, 3.5);
}

}  // namespace
}  // namespace strata::dist
