// ZeRO partitioning: each flat parameter group is padded and split evenly across ranks; groups
// smaller than the persistence threshold stay whole on every rank. Under expert parallelism the
// experts' groups (and their adapters') are split over the expert-data ranks, the ranks holding
// the same experts, and every other group over the data-parallel ranks.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "strata/device/adam8bit.h"
#include "strata/model/param_layout.h"

namespace strata::zero {

// The ranks a group is split over: this rank's place among them, and their number.
struct ShardAxis {
  int rank = 0;
  int world = 1;
};

struct GroupPartition {
  int group = 0;
  // Split over the expert-data ranks (an expert's group under expert parallelism), not the
  // data-parallel ones; `world` of them.
  bool experts = false;
  int world = 1;
  std::int64_t full_elems = 0;    // the group's elements in the full layout
  std::int64_t padded_elems = 0;  // full_elems rounded up to world * kShardAlignElems
  std::int64_t shard_elems = 0;   // padded_elems / world
  std::int64_t shard_offset = 0;  // rank * shard_elems (this rank's place on its axis)
  // Below param_persistence_threshold, or quantized (QLoRA's NF4 base): whole on every rank.
  bool replicated = false;
  // Elements this rank's engine holds: shard_elems, or full_elems when replicated.
  std::int64_t local_elems() const { return replicated ? full_elems : shard_elems; }
};

// Shards start on multiples of this many elements (1 KiB in f32), so SIMD and O_DIRECT paths see
// aligned data on every rank, and each rank's 8-bit moment blocks (device::kAdam8BlockElems,
// counted from its shard's start) are the blocks of the whole group whatever the rank count.
inline constexpr std::int64_t kShardAlignElems = 256;
static_assert(kShardAlignElems % device::kAdam8BlockElems == 0);

class Partition {
 public:
  // persistence_threshold: groups with fewer elements stay whole (DeepSpeed's
  // param_persistence_threshold). A world of 1 makes every group "replicated" (no collectives).
  // `experts`: the expert-data axis of an expert split (full.expert_split()); without one the
  // experts' groups are split over `data` as every other.
  Partition(const model::ParamLayout& full, ShardAxis data, std::int64_t persistence_threshold,
            std::optional<ShardAxis> experts = std::nullopt);

  // The data-parallel axis.
  int rank() const { return data_.rank; }
  int world() const { return data_.world; }
  const GroupPartition& group(int id) const { return groups_.at(static_cast<std::size_t>(id)); }
  const std::vector<GroupPartition>& groups() const { return groups_; }
  // The layout of what this rank's engine holds: same group ids and names, local sizes.
  const model::ParamLayout& local_layout() const { return local_; }
  // Parameter elements (padded) of partitioned groups: the volume each all-gather moves.
  std::int64_t partitioned_elems() const;

 private:
  ShardAxis data_;
  std::vector<GroupPartition> groups_;
  model::ParamLayout local_;
};

}  // namespace strata::zero
