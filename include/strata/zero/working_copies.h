// The working copies of a rank's share: each group's parameters in the compute dtype (NF4 for a
// QLoRA base), homed where the memory plan puts them (MemoryPlan::home_of) and, when that is off
// the device, fetched ahead by a sched::PrefetchScheduler as its recorded trace says. The model
// acquires and releases them (model/param_provider.h's contract); the optimizer writes new ones
// through open/close; loading fills them from fp32 values, a piece at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/host_arrays.h"
#include "strata/mem/tiered_store.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/sched/prefetch_scheduler.h"
#include "strata/zero/shard_group.h"

namespace strata::zero {

// What the prefetcher asks of the optimizer schedule that rewrites the working copies.
class UpdateGate {
 public:
  virtual ~UpdateGate() = default;
  // Group's working copy may be fetched ahead: no overlapped update is still to write it.
  virtual bool update_done(int group) = 0;
};

// Working copies kept between runs (QLoRA's quantized base, so a second run skips quantizing):
// a group's bytes are read from here when present, and offered here when made.
class WorkingCopyCache {
 public:
  virtual ~WorkingCopyCache() = default;
  // Fills `dst` with the group's `bytes` and returns true, or returns false when not cached.
  virtual Result<bool> read(const model::ParamGroup& group, void* dst, std::uint64_t bytes) = 0;
  // Keeps the group's bytes for later runs.
  virtual Status write(const model::ParamGroup& group, const void* src, std::uint64_t bytes) = 0;
};

struct WorkingCopyOptions {
  Tier home = Tier::kDevice;          // the plan's parameter tier
  Tier trained_home = Tier::kDevice;  // the trained groups' (MemoryPlan::trained_params)
  // By group: trained groups the device steps (MemoryPlan::device_steps), homed there.
  std::vector<bool> device_homed;
  DType compute_dtype = DType::kF32;
  // Under a host budget, a host copy the optimizer wrote on its way to NVMe stays, clean.
  bool host_budget = false;
  // Off the device: the prefetcher's budgets (sched::PrefetchOptions). A frozen group's copy
  // stays on the device between passes while there is room (nothing rewrites it).
  std::uint64_t prefetch_bytes = 0;
  std::uint64_t max_live_bytes = 0;
  std::uint64_t max_reuse_distance = 0;
  mem::Timeline* timeline = nullptr;  // per-group compute spans; optional
};

class WorkingCopies {
 public:
  // Registers a working copy of each group with elements in `store`. `store`, `groups` and
  // `arrays` must outlive it.
  static Result<std::unique_ptr<WorkingCopies>> create(mem::TieredStore& store,
                                                       const std::vector<ShardGroup>& groups,
                                                       const device::HostArrays& arrays,
                                                       const WorkingCopyOptions& options);

  // The optimizer schedule the prefetcher asks before fetching ahead; set before a pass.
  void set_update_gate(UpdateGate* gate) { gate_ = gate; }

  // ---- the model's: acquired on the device for a layer's compute ----
  Result<const void*> acquire(int group);
  void release(int group);
  void prefetch(int group);
  // Device bytes acquire(group) adds: 0 when working copies live on the device.
  std::uint64_t acquire_device_bytes(int group) const;
  // The micro-batch has reached its backward (the compute spans say so).
  void backward_began() { backward_ = true; }
  // The end of a pass: the prefetcher settles and drops what it kept (the optimizer may rewrite
  // the working copies before the next pass).
  void end_pass();

  // ---- written anew: by the optimizer, loading, or a restore ----
  // A copy of group's working copy on `tier` to write (the home when it lives there); close
  // makes it the working copy, sending it home on the copy streams (`writebacks` gets the
  // transfer) unless `tier` is the home. `keep_host_copy`: under a host budget a host copy sent
  // to NVMe stays, clean, for the next forward.
  Result<void*> open(int group, Tier tier);
  void abandon(int group, Tier tier);  // unpins what open opened
  Status close(int group, Tier tier, std::vector<mem::Completion>& writebacks,
               bool keep_host_copy = false);
  // The working copy made from the group's fp32 values (NF4 tensors quantized), through a host
  // copy.
  Status write(int group, const float* values, std::vector<mem::Completion>& writebacks);
  // A frozen group's working copy from `cache` when there, else from `pieces` (a piece at a
  // time) or `source` (whole), offered to `cache` when made.
  Status load_frozen(int group, const model::GroupSource& source, WorkingCopyCache* cache,
                     const model::GroupRangeSource& pieces,
                     std::vector<mem::Completion>& writebacks);
  // The working copy widened to fp32 (NF4 tensors decoded): a frozen group's weights.
  Status read(int group, float* dst);

  double wait_ms() const { return wait_ms_; }  // compute blocked in acquire
  sched::SchedulerStats prefetch_stats() const;

 private:
  WorkingCopies(mem::TieredStore& store, const std::vector<ShardGroup>& groups,
                const device::HostArrays& arrays, const WorkingCopyOptions& options);
  // Elements [begin, begin + count) of a group's fp32 values, valid until the next call.
  using Fp32Pieces = std::function<Result<const float*>(std::int64_t begin, std::int64_t count)>;
  // The working copy's bytes into `out` from `values` asked at most `piece_elems` at a time
  // (an NF4 tensor whole).
  Status fill(int group, const Fp32Pieces& values, std::int64_t piece_elems, void* out);
  const ShardGroup& group(int g) const { return groups_.at(static_cast<std::size_t>(g)); }
  mem::Handle handle(int g) const { return work_.at(static_cast<std::size_t>(g)); }
  // The group's working copy is homed off the device: the prefetcher serves it.
  bool fetched(int g) const { return store_.spec(handle(g)).home != Tier::kDevice; }

  mem::TieredStore& store_;
  const std::vector<ShardGroup>& groups_;
  const device::HostArrays& arrays_;
  WorkingCopyOptions options_;
  std::vector<mem::Handle> work_;                    // by group; kInvalid for an empty one
  std::vector<std::int64_t> span_begin_ns_;          // by group: its compute span's start, or 0
  std::unique_ptr<sched::PrefetchScheduler> sched_;  // off the device
  UpdateGate* gate_ = nullptr;
  bool backward_ = false;
  double wait_ms_ = 0;
};

}  // namespace strata::zero
