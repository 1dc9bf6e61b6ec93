// Private to train: the groups of a run's layout gathered into whole tensors on world rank 0,
// for the checkpoint's files, from wherever the grid holds them (ZeRO's shards, tensor-parallel
// slices, pipeline stages, the ranks holding an expert).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/dist/process_grid.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/lora.h"
#include "strata/model/param_layout.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

// The tensor of `group` called `name`; null when it has none.
const model::TensorSpec* tensor_named(const model::ParamGroup& group, const std::string& name);

// Each tensor-parallel rank's layout (one layout when the run does not split), adapters
// included, for putting the slices of a group together into its whole tensors.
std::vector<model::ParamLayout> rank_layouts(const model::LlamaConfig& config,
                                             const std::optional<model::LoraConfig>& lora,
                                             int tensor_size);

// Gathers groups, in an order every rank agrees on, into whole tensors on world rank 0. On the
// pipeline stage holding a group: its master weights over the data-parallel ranks of each
// tensor-parallel rank (ZeRO's gather), then, split layers, the tensor-parallel slices of data
// rank 0 to the stage's first rank, which puts each tensor of the group together (`whole`: the
// layout without a split); then, from a later stage, that rank's group to world rank 0 (a gather
// over the pipeline ranks: O(stages x group) there). An expert's group under expert parallelism
// goes the same way over the ranks holding it, then over the first expert group. O(group)
// memory elsewhere.
class GroupGatherer {
 public:
  GroupGatherer(const model::LlamaConfig& config, const std::optional<model::LoraConfig>& lora,
                const model::ParamLayout& layout, const model::ParamLayout& whole,
                zero::ZeroProvider& provider, dist::ProcessGrid& grid,
                const zero::StateSnapshot& from);

  bool split() const { return !slices_.empty(); }
  // The layout the gathered groups have: whole tensors, every group.
  const model::ParamLayout& whole() const { return whole_; }

  // Group `id`'s whole tensors into `dst` (world rank 0; null elsewhere). Every rank calls it.
  Status gather(int id, float* dst);

 private:
  // Group `id`'s whole tensors into `dst` on its stage's first rank (data and tensor rank 0; null
  // elsewhere). Every rank of the stage calls it.
  Status gather_stage(int id, float* dst);
  // Group `id` gathered where it lives (`here` fills its argument on the rank of `line` that
  // holds it, `holds`, and is null on the others), then over `line` (the ranks with `on_line`,
  // the holder its member `owner`) to the line's first rank: world rank 0, or for the experts'
  // hop inside a pipeline stage, the stage's first rank.
  Status from_owner(int id, int owner, bool holds, bool on_line, dist::Communicator& line,
                    const std::string& owner_name, const std::function<Status(float*)>& here,
                    float* dst);

  const model::ParamLayout& layout_;
  const model::ParamLayout& whole_;
  zero::ZeroProvider& provider_;
  dist::ProcessGrid& grid_;
  zero::StateSnapshot from_;
  std::vector<model::ParamLayout> slices_;  // each tensor-parallel rank's; empty: no split
  std::vector<float> mine_, all_;
  std::vector<float> every_;  // every member's group on the line
};

// World rank 0 writes with `write` (which gathers `groups` through the source it is given, in
// that order) while every rank takes part in gathering each of them. If rank 0 stops early (a
// write error: a full disk), it still joins the remaining gathers so no rank is left waiting,
// receiving them into a buffer it then drops (rank 0 of a gather always receives).
Status write_gathered(const std::vector<int>& groups, GroupGatherer& gatherer,
                      dist::ProcessGrid& grid,
                      const std::function<Status(const model::GroupSource&)>& write);

}  // namespace strata::train
