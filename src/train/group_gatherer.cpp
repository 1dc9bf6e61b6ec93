// The groups of a run's layout gathered whole on world rank 0 (group_gatherer.h).
#include "src/train/group_gatherer.h"

#include <algorithm>
#include <cstring>

namespace strata::train {

const model::TensorSpec* tensor_named(const model::ParamGroup& group, const std::string& name) {
  for (const auto& t : group.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::vector<model::ParamLayout> rank_layouts(const model::LlamaConfig& config,
                                             const std::optional<model::LoraConfig>& lora,
                                             int tensor_size) {
  std::vector<model::ParamLayout> layouts;
  for (int t = 0; t < tensor_size; ++t) {
    layouts.push_back(model::ParamLayout::build(config, lora, false, {tensor_size, t}));
  }
  return layouts;
}

GroupGatherer::GroupGatherer(const model::LlamaConfig& config,
                             const std::optional<model::LoraConfig>& lora,
                             const model::ParamLayout& layout, const model::ParamLayout& whole,
                             zero::ZeroProvider& provider, dist::ProcessGrid& grid,
                             const zero::StateSnapshot& from)
    : layout_(layout), whole_(whole), provider_(provider), grid_(grid), from_(from) {
  if (grid.shape().tensor > 1) slices_ = rank_layouts(config, lora, grid.shape().tensor);
}

Status GroupGatherer::gather(int id, float* dst) {
  const dist::GridCoord at = grid_.coord();
  std::function<Status(float*)> on_stage = [&](float* into) { return gather_stage(id, into); };
  if (grid_.shape().expert > 1 && layout_.expert_of(id) >= 0) {
    // An expert's group (whole on every tensor-parallel rank, the first's copy counting): over
    // the expert-data ranks holding it to the first of them, a data-parallel rank below the
    // expert-parallel size, then over the stage's first expert group to its first rank.
    if (at.tensor != 0) return Status::ok();
    on_stage = [&](float* into) {
      const int owner = layout_.expert_owner(id);
      return from_owner(
          id, owner, at.expert == owner, at.data < grid_.shape().expert, grid_.expert(),
          "expert-parallel rank",
          [&](float* held) { return provider_.gather_master(id, held, from_); }, into);
    };
  }
  if (grid_.shape().pipeline == 1) return on_stage(dst);
  const int owner = layout_.stage_of(id);
  return from_owner(id, owner, at.pipeline == owner, at.data == 0 && at.tensor == 0,
                    grid_.pipeline(), "pipeline stage", on_stage, dst);
}

Status GroupGatherer::from_owner(int id, int owner, bool holds, bool on_line,
                                 dist::Communicator& line, const std::string& owner_name,
                                 const std::function<Status(float*)>& here, float* dst) {
  const auto n = static_cast<std::size_t>(whole_.group(id).num_elems);
  // Its own (a hop inside a stage runs inside the pipeline's hop, whose `here` it is).
  std::vector<float> held;
  Status s;
  if (holds) {
    float* into = nullptr;
    if (on_line) into = owner == 0 ? dst : (held.assign(n, 0.0f), held.data());
    s = here(into);
  }
  if (owner == 0 || !on_line) return s;
  if (!holds) held.assign(n, 0.0f);
  const auto members = static_cast<std::size_t>(line.world_size());
  every_.assign(dst != nullptr ? n * members : 0, 0.0f);
  Status t = line.gather_host(held.data(), dst != nullptr ? every_.data() : nullptr,
                              static_cast<std::int64_t>(n), DType::kF32, 0,
                              "checkpoint: group " + whole_.group(id).name + " from " + owner_name +
                                  " " + std::to_string(owner));
  if (s.is_ok()) s = t;
  if (s.is_ok() && dst != nullptr) {
    std::memcpy(dst, every_.data() + static_cast<std::size_t>(owner) * n, n * sizeof(float));
  }
  return s;
}

Status GroupGatherer::gather_stage(int id, float* dst) {
  if (!split()) return provider_.gather_master(id, dst, from_);  // dst: on rank 0 only
  mine_.assign(static_cast<std::size_t>(layout_.group(id).num_elems), 0.0f);
  Status s = provider_.gather_master(id, mine_.data(), from_);
  if (grid_.coord().data != 0) return s;
  // The slices' groups may differ in padding (each rank's duplicates last): the largest.
  std::int64_t count = 0;
  for (const auto& l : slices_) count = std::max(count, l.group(id).num_elems);
  mine_.resize(static_cast<std::size_t>(count), 0.0f);
  if (dst != nullptr) all_.assign(static_cast<std::size_t>(count) * slices_.size(), 0.0f);
  Status t = grid_.tensor().gather_host(mine_.data(), dst != nullptr ? all_.data() : nullptr, count,
                                        DType::kF32, 0, "checkpoint: tensor-parallel slices");
  if (s.is_ok()) s = t;
  if (!s.is_ok() || dst == nullptr) return s;
  const model::ParamGroup& g = whole_.group(id);
  for (const auto& tensor : g.tensors) {
    for (std::size_t r = 0; r < slices_.size(); ++r) {
      const model::ParamGroup& sliced = slices_[r].group(id);
      const model::TensorSpec* piece = tensor_named(sliced, tensor.name);
      if (piece == nullptr) return internal_error("no slice of " + tensor.name);
      if (!sliced.counts(*piece)) continue;  // another rank's copy holds the same values
      const float* from = all_.data() + static_cast<std::int64_t>(r) * count;
      piece->for_each_run(
          0, piece->num_elems, [&](std::int64_t first, std::int64_t full_first, std::int64_t n) {
            std::memcpy(dst + tensor.offset_elems + full_first, from + piece->offset_elems + first,
                        static_cast<std::size_t>(n) * sizeof(float));
          });
    }
  }
  return Status::ok();
}

Status write_gathered(const std::vector<int>& groups, GroupGatherer& gatherer,
                      dist::ProcessGrid& grid,
                      const std::function<Status(const model::GroupSource&)>& write) {
  std::size_t gathered = 0;
  Status s;
  const bool root = grid.world().rank() == 0;
  if (root) {
    s = write([&](const model::ParamGroup& g, float* dst) {
      STRATA_CHECK(gathered < groups.size() && groups[gathered] == g.id,
                   "a group gathered out of the agreed order", g.name, gathered);
      ++gathered;
      return gatherer.gather(g.id, dst);
    });
  }
  std::vector<float> dropped;
  for (; gathered < groups.size(); ++gathered) {
    const int id = groups[gathered];
    if (root) dropped.assign(static_cast<std::size_t>(gatherer.whole().group(id).num_elems), 0.0f);
    Status gs = gatherer.gather(id, root ? dropped.data() : nullptr);
    if (s.is_ok() && !gs.is_ok()) s = gs;
  }
  return s;
}

}  // namespace strata::train
