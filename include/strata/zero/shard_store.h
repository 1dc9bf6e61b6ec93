// This rank's share of the model: every tensor of every parameter group registered in one
// mem::TieredStore where the memory plan (plan.h) puts it, held by rooms named for what they
// hold: the working copies and their prefetcher (working_copies.h), the gradients as they land
// (gradient_landing.h), the optimizer state with its shadow and held copies (optimizer_state.h),
// and transient memory (scratch_space.h). The tiered store owns residency and budgets; the rooms
// say which tier they need a tensor in and when; the shard store makes them and does what spans
// several: a pass's end, loading, restoring working copies from the state, the counters. The
// optimizer schedule (optimizer_schedule.h) updates the state and asks the rooms directly.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/device/host_arrays.h"
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "strata/mem/timeline.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_layout.h"
#include "strata/optim/adamw.h"
#include "strata/optim/cpu_adam.h"
#include "strata/sched/prefetch_scheduler.h"
#include "strata/zero/gradient_landing.h"
#include "strata/zero/optimizer_state.h"
#include "strata/zero/plan.h"
#include "strata/zero/schedule_chooser.h"
#include "strata/zero/scratch_space.h"
#include "strata/zero/shard_group.h"
#include "strata/zero/working_copies.h"

namespace strata::zero {

// What one rank's share is made with: where its tensors live, how the optimizer steps them, and
// how working copies are prefetched.
struct ShardOptions {
  Tier offload_param = Tier::kDevice;      // where compute-dtype working copies live
  Tier offload_optimizer = Tier::kDevice;  // master weights and moments, and where the step runs
  // Off the device: the share of the trained elements offloaded, the rest kept and stepped on
  // the device (PlanOptions::offload_fraction).
  double offload_optimizer_fraction = 1.0;
  DType compute_dtype = DType::kF32;
  std::int64_t accumulation_steps = 1;  // micro-batches per step (1: gradients kept as made)
  bool tree_sums = true;                // summed in the canonical tree (PlanOptions::tree_sums)
  // Off the device only (a device step is the device's own work, ordered on its stream); the
  // plan may fall back (MemoryPlan::overlap says what runs).
  OptimizerOverlap overlap = OptimizerOverlap::kNone;
  GradAccumulation grad_accumulation = GradAccumulation::kAuto;  // see plan.h
  // OptimizerOverlap::kAuto: how the overlapped and the serial schedule are compared, and the
  // clock the step cycles are timed with (nullptr: now_ns; tests set their own).
  ScheduleChooserOptions schedule_chooser;
  std::function<std::int64_t()> clock;
  optim::AdamWHyper adam;
  // Each group's shard's first element in the group's flat vector (ZeroProvider fills it from
  // its Partition); empty: 0 for every group.
  std::vector<std::int64_t> shard_offsets;
  // The host optimizer (offload_optimizer cpu or nvme): threads, SIMD path, pinning.
  optim::CpuAdamOptions cpu_adam;
  // offload_optimizer nvme: elements per streamed sub-group (DeepSpeed's sub_group_size).
  std::int64_t sub_group_size = 1 << 22;
  std::uint64_t host_memory_limit_bytes = 0;  // 0 = no limit
  std::uint64_t activation_bytes = 0;         // the model's workspace, as the plan counts it
  std::uint64_t host_io_bytes = 0;  // the model's pinned host buffer (ParamProvider::host_io)
  // Checkpointed activations (model::ParamProvider::write_activation): how many, each's bytes,
  // and the tier that keeps them between the forward and the backward.
  int num_checkpoints = 0;
  std::uint64_t checkpoint_bytes = 0;
  Tier checkpoint_home = Tier::kDevice;
  bool tied_embeddings = false;       // the model's head reads the embedding's weights
  std::uint64_t swap_free_bytes = 0;  // free space of the swap paths; 0 = not checked
  // Parameter prefetch (offload_param cpu or nvme), DeepSpeed's names in bytes: fetches in flight,
  // parameters resident or arriving on the device, and the reuse distance within which a
  // released group stays resident. See sched::PrefetchOptions.
  std::uint64_t prefetch_bytes = std::uint64_t{256} << 20;
  std::uint64_t max_live_bytes = std::uint64_t{1} << 30;
  std::uint64_t max_reuse_distance = std::uint64_t{1} << 30;
  mem::Timeline* timeline = nullptr;  // transfer and per-group compute spans; optional
  // Asynchronous checkpoints (save_async): the plan keeps the shadow state and a third copy so
  // that hold_state() can set a saved step's state aside for the save's thread
  // (PlanOptions::hold_state).
  bool hold_state = false;
};

// What the memory plan of a share is made from: its options, the device budget (the device's own
// limit), whether swap paths exist and whether the device is host memory. strata estimate makes
// the same plan without a store.
PlanOptions plan_options(const ShardOptions& options, std::uint64_t device_budget_bytes,
                         bool has_swap, bool host_addressable_device);

// One rank's counters since it was made: the shard store's transfers and waits, and the
// optimizer schedule's steps. `since` gives what happened after an earlier reading (peaks stay).
struct RankStats {
  std::uint64_t h2d_bytes = 0;        // host -> device
  std::uint64_t d2h_bytes = 0;        // device -> host
  std::uint64_t nvme_read_bytes = 0;  // NVMe -> host (the streamed optimizer step's included)
  std::uint64_t nvme_write_bytes = 0;
  std::uint64_t host_bytes = 0;   // peak host memory held: the store's and the optimizer's staging
  std::uint64_t nvme_bytes = 0;   // peak swap space held
  double wait_ms = 0;             // compute blocked waiting for parameters
  double stall_ms = 0;            // compute blocked waiting for data or room in a tier
  double optimizer_total_ms = 0;  // every finished optimizer step, start to end
  double optimizer_exposed_ms = 0;  // compute blocked waiting for overlapped updates
  // Of the total, the device's step of the groups it keeps (offload_optimizer_fraction below 1),
  // run in step() itself: all of it exposed.
  double optimizer_device_ms = 0;
  // OptimizerOverlap::kBackward: steps whose update started beside backward, guessing no
  // clipping; of those, redone from the state before the step (they clipped), and rolled back
  // (their gradient was not finite).
  std::uint64_t steps_guessed = 0;
  std::uint64_t steps_redone = 0;
  std::uint64_t steps_rolled_back = 0;
  std::uint64_t gathers_ahead = 0;          // stage 3 all-gathers started by prefetch_params
  std::uint64_t gathers_ahead_refused = 0;  // prefetches that did not fit; acquire gathered

  RankStats& operator+=(const RankStats& o);  // counters add, peaks take the larger
  RankStats since(const RankStats& before) const;
};

class ShardStore {
 public:
  // Registers every tensor of `layout` in a new store as `plan` says. Fails with out_of_memory
  // naming the tensor, its tier and the budget when a home does not fit. `swap` is required when
  // anything lives on nvme; `device`, `swap` and `layout` must outlive the store.
  static Result<std::unique_ptr<ShardStore>> create(const model::ParamLayout& layout,
                                                    device::Device& device, io::SwapSpace* swap,
                                                    const ShardOptions& options,
                                                    const MemoryPlan& plan);
  ~ShardStore();
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  // ---- the rooms ----
  WorkingCopies& params() { return *params_; }
  GradientLanding& grads() { return *grads_; }
  OptimizerState& state() { return *state_; }
  ScratchSpace& scratch() { return *scratch_; }

  // ---- what spans rooms ----
  // A gradient to write on the device (GradientLanding::acquire); the working copies' compute
  // spans are backward ones from here. A frozen group has none: ZeroProvider refuses it.
  Result<void*> acquire_grads(int group, model::GradientWrite write);
  // The end of a micro-batch's backward: the gradients landed (GradientLanding's), then the
  // prefetcher settles and drops what it kept, since the optimizer may rewrite the working
  // copies before the next pass; with every group frozen they stay while there is room.
  Status finish_micro_batch();
  // Sets every group's master weights (and working copy) from `source`; moments are zeroed and
  // gradients dropped. A frozen group's working copy is set alone (WorkingCopies::load_frozen,
  // with `cache` and `frozen_pieces`).
  Status load_master(const model::GroupSource& source, WorkingCopyCache* cache = nullptr,
                     const model::GroupRangeSource& frozen_pieces = nullptr);
  // A group's weights in fp32: its master weights (with `held`, the held state's, from any
  // thread), or a frozen group's working copy widened.
  Status read_master(int group, float* dst, bool held = false);
  // The working copies of `groups` (flags by group) rewritten from the master weights.
  Status restore_working_copies(const std::vector<bool>& groups);
  // The step is over: gradients dropped; with `commit`, the state it wrote is the state.
  void end_step(bool commit);

  // ---- what the optimizer schedule reads ----
  int num_groups() const { return static_cast<int>(groups_.size()); }
  bool frozen(int group) const { return groups_.at(static_cast<std::size_t>(group)).frozen(); }
  // No elements here (another pipeline stage's group): nothing to update.
  bool empty(int group) const { return groups_.at(static_cast<std::size_t>(group)).empty(); }
  bool trains() const;  // some group is not frozen
  // Of the trainable groups the optimizer's tier steps (those the plan keeps on the device are
  // the device's: MemoryPlan::device_steps); with the optimizer on the device, of them all.
  std::int64_t max_group_elems() const;
  const MemoryPlan& plan() const { return plan_; }
  mem::TieredStore& store() { return *store_; }

  // Transfers and waits so far (the store's counters read at the last pass end or step).
  RankStats stats() const;
  void absorb_store_stats();  // adds the store's new transfer counts to stats()
  mem::StoreStats store_stats() const { return store_->stats(); }
  sched::SchedulerStats prefetch_stats() const { return params_->prefetch_stats(); }

 private:
  ShardStore(const model::ParamLayout& layout, device::Device& device, io::SwapSpace* swap,
             const ShardOptions& options, const MemoryPlan& plan);
  Status create_rooms();

  device::Device& device_;
  io::SwapSpace* swap_;
  ShardOptions options_;
  MemoryPlan plan_;
  std::vector<ShardGroup> groups_;
  std::optional<device::HostArrays> host_arrays_;  // host-side accumulation and conversion
  std::unique_ptr<mem::TieredStore> store_;
  std::unique_ptr<WorkingCopies> params_;
  std::unique_ptr<GradientLanding> grads_;
  std::unique_ptr<OptimizerState> state_;
  std::unique_ptr<ScratchSpace> scratch_;
  std::vector<mem::Completion> writebacks_;  // working copies going home as they are loaded
  RankStats stats_;
  mem::StoreStats store_seen_;  // store counters already in stats_
};

}  // namespace strata::zero
