// Where a rank's gradients land: each group's gradient, taken from the device as the model
// releases it and kept where the memory plan says (kept as made, or summed over the micro-batches
// in fp32 on the device or in host memory, in the canonical tree of core/summation_tree.h when
// the plan says so: a few fp32 buffers a group, plan.accumulators), with its exact sum of squares
// for the global norm, the same numbers wherever it is summed. The optimizer step reads
// step_grad(group).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/device/host_arrays.h"
#include "strata/mem/tiered_store.h"
#include "strata/model/param_provider.h"
#include "strata/zero/plan.h"
#include "strata/zero/shard_group.h"

namespace strata::zero {

// What an optimizer update started beside backward (a guess) asks of the gradient landing: to
// hear as soon as each group's gradient is final and where the update reads it (host memory).
class FinalGradients {
 public:
  virtual ~FinalGradients() = default;
  virtual void gradient_final(int group) = 0;
};

class GradientLanding {
 public:
  // Registers each trainable group's gradient (and accumulator) where `plan` puts gradients,
  // and the sums of squares' slots. Everything given must outlive it.
  static Result<std::unique_ptr<GradientLanding>> create(
      mem::TieredStore& store, const std::vector<ShardGroup>& groups,
      const device::HostArrays& arrays, device::Device& device, const MemoryPlan& plan,
      DType gradient_dtype, mem::Timeline* timeline);
  ~GradientLanding();

  // The micro-batch of this rank's step (0-based) whose gradients come next: its leaf in the
  // summation tree. Without a call, each finish_micro_batch moves on to the next.
  void set_micro_batch(std::int64_t micro);

  // ---- the model's, with ParamProvider's contract: on the device, zero-filled for kAdd and
  // unfilled for GradientWrite::kWrite (ZeroProvider zeroes the gaps between its tensors), then
  // released ----
  Result<void*> acquire(int group, model::GradientWrite write);
  Status release(int group);
  // Waits for gradient transfers still in flight. With a guess listening (the step's last pass
  // is over), every sum is whole and final now: the ones that never came are zeros, and a sum on
  // the device whose last gradient came in an earlier micro-batch is sent to host memory with its
  // sum of squares now.
  Status finish_micro_batch();
  // Sum of squares of each group's accumulated gradient, by group, its tensor-parallel
  // duplicates left out (another rank counts them), exact (core/dtype.h's chunks); after
  // finish_micro_batch. Sums taken on the device come back in one copy and one wait.
  Result<std::vector<ExactSum>> sums_of_squares();

  // While a guessed update runs, `final` hears of each gradient once final (nullptr: none runs).
  void report_final_to(FinalGradients* final) { final_ = final; }

  // ---- the optimizer step's ----
  // The gradient the step reads: the kept gradient or the fp32 sum, of step_dtype().
  mem::Handle step_grad(int group) const;
  // Of the groups the optimizer's tier steps, or (`device_steps`) of those the device steps
  // (MemoryPlan::device_steps: always fp32 sums).
  DType step_dtype(bool device_steps) const;
  // Every group's sum whole, in the buffer step_grad names: the merges the summation tree still
  // owes (the leaves not come are zeros). finish_micro_batch does this after the planned last
  // micro-batch; the norm and the step make sure of it.
  Status finish_sums();
  // Groups with no gradient this step get zeros (their sums of squares too, where kept).
  Status give_zeros();
  // Sums made on the device go to host memory for a host optimizer, on the copy streams.
  Status send_sums_to_host();
  // After group's update: the gradient is dropped, or with `keep` (a redo may need it) sent
  // home, the transfer into `writebacks`.
  Status spend(int group, bool keep, std::vector<mem::Completion>& writebacks);
  void clear();  // no gradient any more (after a step, or a skipped one)
  bool idle() const { return pending_.empty() && writebacks_.empty(); }

 private:
  struct Group;
  GradientLanding(mem::TieredStore& store, const std::vector<ShardGroup>& groups,
                  const device::HostArrays& arrays, device::Device& device, const MemoryPlan& plan,
                  DType gradient_dtype, mem::Timeline* timeline);
  Status add_tensors();
  Status drain_one();
  // Takes in group's gradient x (dtype; on `tier`, device or host) as leaf `leaf`, or with x null
  // the merges still owed once every leaf came: the tree's operations on the group's fp32 sums.
  Status sum_in(int group, std::int64_t leaf, const void* x, DType dtype, Tier tier);
  // A device accumulator's sum is final for a guessed update: its sum of squares taken now, and
  // the sum sent to host memory while backward goes on.
  Status send_final_sum(int group);
  // Into slot `group` the sum of squares of x [n] (a group's gradient, in dtype), its duplicates
  // left out.
  void device_sum_squares(const void* x, DType dtype, std::size_t group);

  mem::TieredStore& store_;
  const std::vector<ShardGroup>& shapes_;
  const device::HostArrays& arrays_;
  device::Device& device_;
  const MemoryPlan& plan_;
  DType dtype_;  // the gradients' as they land (MemoryPlan::gradient_dtype)
  mem::Timeline* timeline_;
  std::vector<Group> groups_;
  std::int64_t micro_ = 0;  // the micro-batch whose gradients come now
  FinalGradients* final_ = nullptr;
  // Gradient sums of squares, one per group, in store tensors pinned for the store's life: a
  // host copy, and on a device that cannot address host memory device scratch that the sums
  // are written to and copied from.
  ExactSum* norms_host_ = nullptr;
  ExactSum* norm_slots_ = nullptr;                    // where the device writes them
  mem::Handle widened_grad_ = mem::Handle::kInvalid;  // summed on the device: bf16 -> f32
  struct Pending {                                    // a gradient on its way off the device
    int group;
    mem::Completion done;
    std::int64_t micro;  // its micro-batch
  };
  std::deque<Pending> pending_;
  std::vector<mem::Completion> writebacks_;  // accumulators going home
};

}  // namespace strata::zero
