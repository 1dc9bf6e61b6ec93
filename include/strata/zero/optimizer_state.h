// The optimizer state of a rank's share: each trainable group's master weights and Adam moments,
// homed in the optimizer's tier in the dtypes and layouts the state options say (fp32, bf16,
// bf16 with Kahan compensation, 8-bit blocks), with the plan's shadow copy (what the next step
// writes, switched to when it commits) and held copy (what an asynchronous save reads while
// training goes on). It converts the stored state to and from fp32 for loading, saving and
// resuming, and gives the optimizer step its tensors.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/host_arrays.h"
#include "strata/mem/tiered_store.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/optim/adamw.h"
#include "strata/optim/state_layout.h"
#include "strata/zero/gradient_landing.h"
#include "strata/zero/plan.h"
#include "strata/zero/shard_group.h"
#include "strata/zero/step_target.h"
#include "strata/zero/working_copies.h"

namespace strata::zero {

class OptimizerState {
 public:
  // Registers the state of each trainable group in `store` where `plan` puts the optimizer;
  // `shard_offsets[g]`: group g's first element in its whole group (empty: 0). Everything given
  // must outlive it.
  static Result<std::unique_ptr<OptimizerState>> create(mem::TieredStore& store,
                                                        const std::vector<ShardGroup>& groups,
                                                        const device::HostArrays& arrays,
                                                        const optim::AdamWHyper& adam,
                                                        const MemoryPlan& plan,
                                                        std::vector<std::int64_t> shard_offsets);
  ~OptimizerState();

  // ---- in and out (no step running) ----
  // A trainable group's master weights from `source` (rounded as stored), its moments zeroed,
  // and its working copy made from the weights as stored, as every step's is.
  Status load(int group, const model::GroupSource& source, WorkingCopies& copies,
              std::vector<mem::Completion>& writebacks);
  // The group's working copy rewritten from its master weights.
  Status restore_working_copy(int group, WorkingCopies& copies,
                              std::vector<mem::Completion>& writebacks);
  // With `held`: the state hold() holds, from any thread while training goes on. A group with
  // no state (frozen, or another stage's) reads zero moments.
  Status read_master(int group, float* dst, bool held = false);
  Status read_moments(int group, float* exp_avg, float* exp_avg_sq, bool held = false);
  Status write_moments(int group, const float* exp_avg, const float* exp_avg_sq);

  // ---- the state an asynchronous save reads ----
  // Holds the state as the last step left it (no step running), copy on write with nothing
  // copied: the next step writes the shadow copy as always, and when it commits the held copy
  // (now the shadow) swaps places with the third copy, so later steps alternate between the
  // other two and never wait. Needs the plan's held copy. One hold at a time.
  void hold();
  void release();  // from any thread

  // ---- the optimizer step's ----
  // Each trainable group as the step sees it, its tensors (the gradient `grads` gives the step;
  // the shadow copies as outputs with the plan's shadow state), and its group id.
  struct StepGroups {
    std::vector<StepGroup> groups;
    std::vector<StepTensors> tensors;
    std::vector<int> ids;
  };
  // With the optimizer off the device: the groups its tier steps, or (`device_steps`) those the
  // device steps (MemoryPlan::device_steps). On the device: every group, either way.
  StepGroups step_groups(const GradientLanding& grads, bool device_steps) const;
  // The step is over and wrote the state: with the shadow state, what it wrote becomes the state.
  void commit();

 private:
  struct Group;
  OptimizerState(mem::TieredStore& store, const std::vector<ShardGroup>& groups,
                 const device::HostArrays& arrays, const optim::AdamWHyper& adam,
                 const MemoryPlan& plan, std::vector<std::int64_t> shard_offsets);
  Status add_tensors();
  // The group's master weights, exp_avg and exp_avg_sq handles: the current state's, or with
  // `held` the held one's.
  std::array<mem::Handle, 3> handles(int group, bool held) const;
  // The master weights in host memory as fp32: themselves, or bf16 ones widened into scratch
  // (valid until the next call).
  const float* widened_master(int group, const void* master);
  // Stored state <-> f32, as the layouts say (exact widening; narrowing rounds to nearest, Kahan
  // keeping what it dropped, 8-bit moments quantized by block).
  void master_to_f32(const void* stored, float* dst, std::int64_t n) const;
  void master_from_f32(const float* src, void* stored, std::int64_t n) const;
  void moment_to_f32(const void* stored, bool second, float* dst, std::int64_t n) const;
  void moment_from_f32(const float* src, bool second, void* stored, std::int64_t n) const;

  mem::TieredStore& store_;
  const std::vector<ShardGroup>& shapes_;
  const device::HostArrays& arrays_;
  optim::AdamWHyper adam_;
  const MemoryPlan& plan_;
  std::vector<std::int64_t> shard_offsets_;
  optim::StateLayout master_layout_;
  optim::StateLayout moment_layout_;
  std::vector<Group> groups_;
  std::vector<float> wide_master_;  // widened_master's scratch
  // The held state: whether a save holds one, and whether a step's commit has since set it
  // aside (the spare handles). Guards those and the handle swaps of a commit.
  mutable std::mutex held_mu_;
  bool held_ = false;
  bool held_is_spare_ = false;
};

}  // namespace strata::zero
