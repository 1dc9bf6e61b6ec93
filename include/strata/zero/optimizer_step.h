// The optimizer step behind one interface, with one implementation per tier the plan can put the
// optimizer in: the device's AdamW op on device-resident state, CPU Adam (SIMD) on state pinned
// in host memory, and CPU Adam streaming the state in sub-groups straight from its NVMe homes.
// Each runs AdamW over every group of a StepTarget (the shard store's optimizer state, in its
// tiered store) and closes each group's new working copy as soon as it is written.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/mem/tiered_store.h"
#include "strata/optim/cpu_adam.h"
#include "strata/optim/state_layout.h"
#include "strata/optim/streamed_adam.h"
#include "strata/tensor/tensor.h"

namespace strata::zero {

// One group as the step sees it.
struct StepGroup {
  std::string name;
  std::int64_t num_elems = 0;
  int id = 0;                        // the group's id in the layout
  std::uint64_t element_offset = 0;  // its first element's place in the whole group
  // The update writes the state elsewhere (the plan's shadow state, same tier and size): the
  // state read stays intact until the target's owner switches over. Else it writes in place.
  bool shadowed = false;
};

// One group's arrays pinned in a tier for an update in place: the state read (master weights,
// exp_avg, exp_avg_sq), where the new state goes (the same arrays unless shadowed), the gradient.
struct PinnedState {
  std::array<void*, 3> in{};
  std::array<void*, 3> out{};
  const void* grad = nullptr;
};

// What an optimizer step updates, and everything it asks of whoever holds it: the groups, their
// state and gradients (pinned whole, or opened for ranged I/O when streamed from NVMe), the
// working copy each update writes, and when each gradient is final. Indices are into groups().
class StepTarget {
 public:
  virtual ~StepTarget() = default;
  virtual std::span<const StepGroup> groups() const = 0;
  // The order to update the groups in; empty: as listed.
  virtual std::span<const std::size_t> order() const = 0;
  virtual DType grad_dtype() const = 0;
  virtual DType out_dtype() const = 0;  // the working copies'
  // Whether group's gradient is final (`wait`: blocks until it is). An error stops the step.
  virtual Result<bool> gradient_ready(std::size_t group, bool wait) = 0;

  // ---- in place (on the device, or in host memory) ----
  // Every array of the group pinned on `tier`, or (an error) none.
  virtual Result<PinnedState> pin(std::size_t group, Tier tier) = 0;
  // Lets them go; `written`: the update wrote the new state.
  virtual void unpin(std::size_t group, Tier tier, bool written) = 0;

  // ---- streamed (NVMe): ranges of the homes, through the owner's range staging ----
  // The group's state opened for ranged reads and writes; close_ranges closes every group's
  // (`written`: the step wrote them; `ok`: it ended well).
  virtual Status open_ranges(std::size_t group) = 0;
  virtual void close_ranges(bool written, bool ok) = 0;
  virtual io::IoHandle read_range(std::size_t group, optim::StreamedArray array,
                                  std::uint64_t offset, void* dst, std::size_t bytes) = 0;
  virtual io::IoHandle write_range(std::size_t group, optim::StreamedArray array,
                                   std::uint64_t offset, const void* src, std::size_t bytes) = 0;
  // The gradient of a streamed update: its host copy, or null when it has none (read then as a
  // range, kGrad, with the state); close_gradient lets it go.
  virtual Result<const void*> open_gradient(std::size_t group) = 0;
  virtual void close_gradient(std::size_t group) = 0;

  // ---- the new working copy ----
  // On `tier`, for the update to write; closed after the update (its state and gradient let
  // go), it goes home while the next group is updated.
  virtual Result<void*> open_output(std::size_t group, Tier tier) = 0;
  virtual Status close_output(std::size_t group, Tier tier) = 0;
};

class OptimizerStep {
 public:
  virtual ~OptimizerStep() = default;
  // AdamW over every group (hyper-parameters, step and gradient scale from `base`). A step that
  // fails before writing leaves every state tensor's data as it was.
  virtual Status run(StepTarget& target, const device::AdamWArgs& base) = 0;
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

// The step for the optimizer's tier. For kNvme it streams through `staging` (a tiered store's
// range staging: StoreOptions::range_io_bytes, at least optimizer_staging_bytes(options)), which
// must outlive the step.
Result<std::unique_ptr<OptimizerStep>> make_optimizer_step(Tier tier, device::Device& device,
                                                           std::span<std::byte> staging,
                                                           const OptimizerStepOptions& options);

}  // namespace strata::zero
