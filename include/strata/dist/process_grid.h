// The process grid: the ranks arranged as data x tensor x pipeline groups, each axis with its own
// communicator (MPI sub-communicators, NCCL splits). Megatron's order: the ranks of one tensor
// group are adjacent, then data, then pipeline, so a tensor group stays inside a node. ZeRO shards
// over the data axis; tensor and pipeline sizes come from the config (or its "auto" planner).
// Expert parallelism divides the data axis (Megatron's expert-data-parallel layout): each run of
// `expert` consecutive data ranks shares a layer's experts out among themselves (the expert
// group, between which tokens travel), and the data ranks holding the same experts form the
// expert-data group (over which those experts' gradients are reduced).
#pragma once

#include <memory>
#include <string>

#include "strata/core/status.h"
#include "strata/dist/communicator.h"

namespace strata::device {
class Device;
}

namespace strata::dist {

struct GridShape {
  int data = 1;      // data-parallel ranks (ZeRO shards over these)
  int tensor = 1;    // tensor-parallel ranks (each layer's matrices split over these)
  int pipeline = 1;  // pipeline stages
  int expert = 1;    // data ranks that share out each MoE layer's experts; divides data
  int size() const { return data * tensor * pipeline; }
  // "data 2 x tensor 2 x pipeline 1", and ", experts over 2" where expert > 1
  std::string to_string() const;
};

struct GridCoord {
  int data = 0, tensor = 0, pipeline = 0;
  int expert = 0;  // place in the expert group: data % shape.expert
};

// world rank = tensor + shape.tensor * (data + shape.data * pipeline), and back.
int grid_rank(const GridShape& shape, const GridCoord& coord);
GridCoord grid_coord(const GridShape& shape, int rank);

class ProcessGrid {
 public:
  // Splits `world`, whose size must be shape.size(), into the three axes' communicators. An axis
  // spanning every rank is `world` itself and an axis of one rank a single-rank communicator, so
  // a data-parallel grid adds no communicator and makes no collective. Otherwise collective over
  // `world` (every rank calls it with the same shape). `world` and `device` must outlive it.
  static Result<std::unique_ptr<ProcessGrid>> create(Communicator& world, const GridShape& shape,
                                                     device::Device& device);
  // One rank alone, with a single-rank communicator of its own (generation, probes, tests).
  static std::unique_ptr<ProcessGrid> single_rank(device::Device& device);

  const GridShape& shape() const { return shape_; }
  const GridCoord& coord() const { return coord_; }  // this rank's place
  Communicator& world() { return *world_; }
  Communicator& data() { return *data_; }
  Communicator& tensor() { return *tensor_; }
  Communicator& pipeline() { return *pipeline_; }
  // The expert group (shape.expert data ranks, in data order; one rank without expert
  // parallelism) and the expert-data group (the data / expert data ranks holding the same
  // experts; the data group without expert parallelism).
  Communicator& expert() { return *expert_; }
  Communicator& expert_data() { return *expert_data_; }
  // Megatron's embedding group: the first and the last pipeline stage of this rank's data and
  // tensor coordinates, ranks 0 and 1 of a communicator of their own (a tied embedding's copy
  // and gradients cross it, apart from the stage boundaries' traffic). Made by
  // link_embedding_stages, collective over the pipeline group; null before, on the other stages
  // and without a pipeline.
  Status link_embedding_stages();
  Communicator* embedding() { return embedding_.get(); }
  // The bytes and collectives of every communicator of the grid (the world's and each axis's
  // own), summed.
  CommStats stats() const;

 private:
  ProcessGrid() = default;
  GridShape shape_;
  GridCoord coord_;
  Communicator* world_ = nullptr;
  Communicator* data_ = nullptr;
  Communicator* tensor_ = nullptr;
  Communicator* pipeline_ = nullptr;
  Communicator* expert_ = nullptr;
  Communicator* expert_data_ = nullptr;
  // The groups that are none of world, the data group or one rank.
  std::unique_ptr<Communicator> owned_[5];
  std::unique_ptr<Communicator> own_world_;  // single_rank's
  std::unique_ptr<Communicator> embedding_;
};

}  // namespace strata::dist
