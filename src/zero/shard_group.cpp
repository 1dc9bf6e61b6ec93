// The shard store's group table and tensor registration.
#include "strata/zero/shard_group.h"

namespace strata::zero {

std::vector<ShardGroup> shard_groups(const model::ParamLayout& layout, DType compute_dtype) {
  std::vector<ShardGroup> groups;
  groups.reserve(layout.groups().size());
  for (const auto& spec : layout.groups()) {
    ShardGroup g;
    g.spec = &spec;
    g.n = spec.num_elems;
    g.dup_begin = spec.duplicate_begin < 0 ? spec.num_elems : spec.duplicate_begin;
    g.work_bytes = model::working_bytes(spec, compute_dtype);
    groups.push_back(g);
  }
  return groups;
}

Status wait_all(mem::TieredStore& store, std::vector<mem::Completion>& transfers) {
  Status first;
  for (const mem::Completion& c : transfers) {
    Status s = store.wait(c);
    if (!s.is_ok() && first.is_ok()) first = s;
  }
  transfers.clear();
  return first;
}

Result<mem::Handle> add_tensor(mem::TieredStore& store, const std::string& name,
                               std::uint64_t bytes, Tier home, bool transient) {
  mem::TensorSpec spec;
  spec.name = name;
  spec.size_bytes = bytes;
  spec.home = home;
  spec.transient = transient;
  spec.home_initialized = false;  // its room writes it (loading, or the first gradient)
  return store.add(spec);
}

}  // namespace strata::zero
