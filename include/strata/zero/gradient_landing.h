// Where a rank's gradients land: each group's gradient, taken from the device as the model
// releases it and kept where the memory plan says (kept as made, or summed over the micro-batches
// in an fp32 accumulator on the device or in host memory), with its sum of squares for the global
// norm, the same numbers wherever it is summed. The optimizer step reads step_grad(group).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/device/host_arrays.h"
#include "strata/mem/tiered_store.h"
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
      DType compute_dtype, mem::Timeline* timeline);
  ~GradientLanding();

  // ---- the model's, with ParamProvider's contract: zeroed on the device, then released ----
  Result<void*> acquire(int group);
  Status release(int group);
  // Waits for gradient transfers still in flight. With a guess listening, every gradient is
  // final now: the ones that never came are zeros, and a sum on the device whose last gradient
  // came in an earlier micro-batch is sent to host memory with its sum of squares now.
  Status finish_micro_batch();
  // Sum of squares of each group's accumulated gradient, by group, less its tensor-parallel
  // duplicates' (another rank counts them); after finish_micro_batch. Sums taken on the device
  // come back in one copy and one wait.
  Result<std::vector<double>> sums_of_squares();

  // While a guessed update runs, `final` hears of each gradient once final (nullptr: none runs).
  void report_final_to(FinalGradients* final) { final_ = final; }

  // ---- the optimizer step's ----
  // The gradient the step reads: the kept gradient or the fp32 accumulator, of step_dtype().
  mem::Handle step_grad(int group) const;
  DType step_dtype() const;
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
                  DType compute_dtype, mem::Timeline* timeline);
  Status add_tensors();
  Status drain_one();
  // A device accumulator's sum is final for a guessed update: its sum of squares taken now, and
  // the sum sent to host memory while backward goes on.
  Status send_final_sum(int group);
  // Into slot `group` the sum of squares of x [n] (a group's gradient, in dtype), and into slot
  // groups + group that of its duplicates.
  void device_sum_squares(const void* x, DType dtype, std::size_t group);

  mem::TieredStore& store_;
  const std::vector<ShardGroup>& shapes_;
  const device::HostArrays& arrays_;
  device::Device& device_;
  const MemoryPlan& plan_;
  DType dtype_;  // the model's gradients'
  mem::Timeline* timeline_;
  std::vector<Group> groups_;
  FinalGradients* final_ = nullptr;
  // Gradient sums of squares, one double per group and one per group's duplicates, in store
  // tensors pinned for the store's life: a host copy, and on a device that cannot address host
  // memory device scratch that the sums are written to and copied from.
  double* norms_host_ = nullptr;
  double* norm_slots_ = nullptr;                      // where the device writes them
  mem::Handle widened_grad_ = mem::Handle::kInvalid;  // summed on the device: bf16 -> f32
  struct Pending {                                    // a gradient on its way off the device
    int group;
    mem::Completion done;
  };
  std::deque<Pending> pending_;
  std::vector<mem::Completion> writebacks_;  // accumulators going home
};

}  // namespace strata::zero
