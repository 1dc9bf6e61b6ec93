// The process grid's sub-communicators, split from the world communicator per axis.
#include "strata/dist/process_grid.h"

#include <span>
#include <utility>

#include "strata/core/check.h"
#include "strata/device/device.h"

namespace strata::dist {

std::unique_ptr<ProcessGrid> ProcessGrid::single_rank(device::Device& device) {
  std::unique_ptr<Communicator> comm = make_single_rank_communicator(device);
  auto grid = create(*comm, GridShape{}, device);
  STRATA_CHECK(grid.is_ok(), "a one-rank grid", grid.status().to_string());
  (*grid)->own_world_ = std::move(comm);
  return std::move(*grid);
}

Result<std::unique_ptr<ProcessGrid>> ProcessGrid::create(Communicator& world,
                                                         const GridShape& shape,
                                                         device::Device& device) {
  if (shape.data < 1 || shape.tensor < 1 || shape.pipeline < 1 || shape.expert < 1) {
    return invalid_argument("process grid " + shape.to_string() +
                            ": every axis needs at least one rank");
  }
  if (shape.data % shape.expert != 0) {
    return invalid_argument("process grid " + shape.to_string() + ": expert-parallel size " +
                            std::to_string(shape.expert) +
                            " does not divide the data-parallel size " +
                            std::to_string(shape.data));
  }
  if (shape.size() != world.world_size()) {
    return invalid_argument("process grid " + shape.to_string() + " has " +
                            std::to_string(shape.size()) + " ranks, but the job has " +
                            std::to_string(world.world_size()) +
                            "; data x tensor x pipeline must equal the number of ranks");
  }
  std::unique_ptr<ProcessGrid> grid(new ProcessGrid());
  grid->shape_ = shape;
  grid->coord_ = grid_coord(shape, world.rank());
  grid->world_ = &world;
  const GridCoord& c = grid->coord_;
  // Per axis, in the same order on every rank: its size, the color of this rank's group (the
  // other two coordinates) and its key (the coordinate along the axis).
  // The tensor axis's collectives get a stream of their own: compute waits for each of them,
  // and they must not queue behind ZeRO's prefetched gathers on the data axis. So does the
  // expert group's token exchange (in the model's order, never at once with a tensor one).
  struct Axis {
    const char* name;
    int size, color, key;
    Communicator** slot;
    device::StreamKind stream;
  };
  using device::StreamKind;
  // The expert groups split the data group: its runs of `expert` ranks, and its ranks alike
  // modulo `expert`.
  const int E = shape.expert, line = c.pipeline * shape.tensor + c.tensor;
  const Axis axes[] = {
      {"data", shape.data, c.pipeline * shape.tensor + c.tensor, c.data, &grid->data_,
       StreamKind::kCollective},
      {"tensor", shape.tensor, c.pipeline * shape.data + c.data, c.tensor, &grid->tensor_,
       StreamKind::kTensorCollective},
      {"pipeline", shape.pipeline, c.data * shape.tensor + c.tensor, c.pipeline, &grid->pipeline_,
       StreamKind::kCollective},
      {"expert", E, line * shape.data + c.data / E, c.expert, &grid->expert_,
       StreamKind::kTensorCollective},
      {"expert-data", shape.data / E, line * shape.data + c.expert, c.data / E, &grid->expert_data_,
       StreamKind::kCollective},
  };
  for (std::size_t i = 0; i < std::size(axes); ++i) {
    const Axis& a = axes[i];
    if (a.size == world.world_size()) {
      *a.slot = &world;
      continue;
    }
    if (i > 2 && a.size == shape.data) {  // an expert group that is the whole data group
      *a.slot = grid->data_;
      continue;
    }
    if (a.size == 1) {
      grid->owned_[i] = make_single_rank_communicator(device);
    } else {
      STRATA_ASSIGN_OR_RETURN(
          grid->owned_[i], world.split(a.color, a.key, std::string(a.name) + " groups", a.stream));
    }
    *a.slot = grid->owned_[i].get();
  }
  // A stage sends to the next stage and back to the one before, and an interleaved schedule's
  // last stage to the first: the pipeline group's ring neighbours.
  if (shape.pipeline > 1) {
    const int next = (c.pipeline + 1) % shape.pipeline;
    const int prev = (c.pipeline + shape.pipeline - 1) % shape.pipeline;
    const int peers[] = {prev, next};
    STRATA_RETURN_IF_ERROR(grid->pipeline_->connect(
        std::span<const int>(peers, prev == next ? 1 : 2), "pipeline stage boundaries"));
  }
  return grid;
}

Status ProcessGrid::link_embedding_stages() {
  if (shape_.pipeline <= 1 || embedding_ != nullptr) return Status::ok();
  const int stage = coord_.pipeline, last = shape_.pipeline - 1;
  const bool end = stage == 0 || stage == last;
  // The stages between take part in the split, each alone, and keep nothing.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> link,
                          pipeline_->split(end ? 0 : stage, stage, "embedding groups",
                                           device::StreamKind::kCollective));
  if (!end) return Status::ok();
  const int peer = 1 - link->rank();
  STRATA_RETURN_IF_ERROR(link->connect(std::span<const int>(&peer, 1), "the embedding group"));
  embedding_ = std::move(link);
  return Status::ok();
}

CommStats ProcessGrid::stats() const {
  CommStats sum = world_->stats();
  for (const auto* c : {&owned_[0], &owned_[1], &owned_[2], &owned_[3], &owned_[4], &embedding_}) {
    if (*c != nullptr) sum += (*c)->stats();
  }
  return sum;
}

}  // namespace strata::dist
