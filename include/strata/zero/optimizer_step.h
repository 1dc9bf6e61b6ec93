// The optimizer step behind one interface, with one implementation per tier the plan can put the
// optimizer in: the device's AdamW op on device-resident state, CPU Adam (SIMD) on state pinned
// in host memory, and CPU Adam streaming the state in sub-groups straight from its NVMe homes.
// Each runs AdamW over every group's tensors in the tiered store and hands each group's new
// working copy back to its caller as soon as it is written.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/mem/tiered_store.h"
#include "strata/optim/cpu_adam.h"
#include "strata/optim/state_layout.h"
#include "strata/tensor/tensor.h"

namespace strata::zero {

// One group's tensors, as the store holds them.
struct StepGroup {
  std::string name;
  std::int64_t num_elems = 0;
  int id = 0;                                  // the group's id in the layout
  std::uint64_t element_offset = 0;            // its first element's place in the whole group
  mem::Handle master = mem::Handle::kInvalid;  // of the optimizer's master dtype
  mem::Handle exp_avg = mem::Handle::kInvalid;
  mem::Handle exp_avg_sq = mem::Handle::kInvalid;
  mem::Handle grad = mem::Handle::kInvalid;  // the gradient the step reads (grad_dtype)
  // Where the updated state goes (the plan's shadow state, same tier and size); kInvalid: in
  // place. Written elsewhere, the state read stays intact until the caller switches over.
  mem::Handle master_out = mem::Handle::kInvalid;
  mem::Handle exp_avg_out = mem::Handle::kInvalid;
  mem::Handle exp_avg_sq_out = mem::Handle::kInvalid;
};

struct StepIo {
  mem::TieredStore& store;
  std::span<const StepGroup> groups;
  DType grad_dtype = DType::kF32;
  DType out_dtype = DType::kF32;  // the working copies'
  // The group's new working copy on `tier`, for the step to write; then done with it (it goes
  // home on the copy streams while the next group is updated).
  std::function<Result<void*>(std::size_t group, Tier tier)> open_output;
  // After the group's update, its gradient unpinned: also decides what becomes of the gradient.
  std::function<Status(std::size_t group, Tier tier)> close_output;
  // The order to update the groups in (indices into `groups`); empty: as listed.
  std::span<const std::size_t> order;
  // Optional (a step that starts before backward ends): whether the group's gradient is final;
  // `wait`: blocks until it is. An error stops the step.
  std::function<Result<bool>(std::size_t group, bool wait)> ready;
};

class OptimizerStep {
 public:
  virtual ~OptimizerStep() = default;
  // AdamW over every group (hyper-parameters, step and gradient scale from `base`). A step that
  // fails before writing leaves every state tensor's data as it was.
  virtual Status run(const StepIo& io, const device::AdamWArgs& base) = 0;
  // NVMe bytes the last run read and wrote itself (0 off NVMe).
  // The last step's NVMe bytes (the store counts them too, as ranged I/O; this is the step's own
  // account, for tests).
  virtual std::uint64_t bytes_read() const { return 0; }
  virtual std::uint64_t bytes_written() const { return 0; }
};

struct OptimizerStepOptions {
  optim::CpuAdamOptions cpu_adam;         // host and NVMe: threads, SIMD path, pinning
  std::int64_t sub_group_size = 1 << 22;  // NVMe: elements per streamed sub-group
  std::int64_t max_group_elems = 0;       // NVMe: the largest group
  bool stream_grads = false;              // NVMe: the gradients live on NVMe too
  optim::StateLayout master_layout{};     // NVMe: how the state lies in its homes
  optim::StateLayout moment_layout{};
};

// The step for the optimizer's tier. For kNvme it streams through `store`'s range staging
// (StoreOptions::range_io_bytes, at least optimizer_staging_bytes(options)); the store must
// outlive the step.
Result<std::unique_ptr<OptimizerStep>> make_optimizer_step(Tier tier, device::Device& device,
                                                           mem::TieredStore& store,
                                                           const OptimizerStepOptions& options);

}  // namespace strata::zero
