// One parameter group of a rank's share as the shard store's rooms (working copies, gradient
// landing, optimizer state) size it, and how each room registers its tensors in the rank's
// tiered store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/mem/tiered_store.h"
#include "strata/model/param_layout.h"

namespace strata::zero {

struct ShardGroup {
  const model::ParamGroup* spec = nullptr;
  std::int64_t n = 0;
  // Elements [dup_begin, n): tensor-parallel duplicates, left out of the norm this rank counts.
  std::int64_t dup_begin = 0;
  std::size_t work_bytes = 0;  // model::working_bytes: n * compute dtype size unless quantized

  const std::string& name() const { return spec->name; }
  bool frozen() const { return spec->frozen; }  // a working copy only
  // Another pipeline stage's group: no elements here, and no tensors.
  bool empty() const { return n == 0; }
  bool trains() const { return !frozen() && !empty(); }  // a gradient and optimizer state
};

// Every group of `layout` (which must outlive the result), in the compute dtype.
std::vector<ShardGroup> shard_groups(const model::ParamLayout& layout, DType compute_dtype);

// Waits for every transfer in `transfers` and clears it; the first error, if any.
Status wait_all(mem::TieredStore& store, std::vector<mem::Completion>& transfers);

// A tensor homed on `home` (transient: none) whose data its room writes before anyone reads it.
Result<mem::Handle> add_tensor(mem::TieredStore& store, const std::string& name,
                               std::uint64_t bytes, Tier home, bool transient = false);

}  // namespace strata::zero
