// Partition: padding and shard offsets per group.
#include "strata/zero/partition.h"

#include <algorithm>

namespace strata::zero {

Partition::Partition(const model::ParamLayout& full, ShardAxis data,
                     std::int64_t persistence_threshold, std::optional<ShardAxis> experts)
    : data_(data) {
  std::vector<model::ParamGroup> local_groups;
  for (const auto& g : full.groups()) {
    GroupPartition p;
    p.group = g.id;
    p.experts = experts.has_value() && full.expert_of(g.id) >= 0;
    const ShardAxis axis = p.experts ? *experts : data;
    p.world = axis.world;
    p.full_elems = g.num_elems;
    const std::int64_t unit = static_cast<std::int64_t>(axis.world) * kShardAlignElems;
    p.padded_elems = (g.num_elems + unit - 1) / unit * unit;
    p.shard_elems = p.padded_elems / axis.world;
    p.shard_offset = static_cast<std::int64_t>(axis.rank) * p.shard_elems;
    // A quantized base (QLoRA) is read whole by every rank: its bytes are not elements to cut.
    p.replicated = axis.world == 1 || g.num_elems < persistence_threshold || g.quantized();
    groups_.push_back(p);
    model::ParamGroup lg;
    lg.name = g.name;
    lg.num_elems = p.local_elems();
    lg.frozen = g.frozen;
    lg.expert_layer = g.expert_layer;
    // The duplicates (tensor parallelism's, counted by another rank) that this shard holds, in
    // its own elements.
    const std::int64_t dup = g.duplicate_begin < 0 ? g.num_elems : g.duplicate_begin;
    lg.duplicate_begin =
        p.replicated ? dup : std::clamp(dup - p.shard_offset, std::int64_t{0}, p.shard_elems);
    if (!p.replicated && dup >= g.num_elems) lg.duplicate_begin = p.shard_elems;
    if (g.quantized()) lg.tensors = g.tensors;  // its working bytes follow its tensors
    local_groups.push_back(std::move(lg));
  }
  local_ = model::ParamLayout::from_groups(std::move(local_groups));
}

std::int64_t Partition::partitioned_elems() const {
  std::int64_t n = 0;
  for (const auto& g : groups_) {
    if (!g.replicated) n += g.padded_elems;
  }
  return n;
}

}  // namespace strata::zero
