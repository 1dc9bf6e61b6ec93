// A StepTarget over tensors of a tiered store: each group's state, its shadow copies (where the
// update writes, when there are some) and its gradient, by handle. Pinning, ranged I/O and the
// gradient's host copy are done here; the working copy the update writes and when a gradient is
// final are the subclass's (the optimizer schedule's step over the shard store; a test's own).
#pragma once

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "strata/mem/tiered_store.h"
#include "strata/zero/optimizer_step.h"

namespace strata::zero {

// One group's tensors in the store.
struct StepTensors {
  std::array<mem::Handle, 3> state{};  // master weights, exp_avg, exp_avg_sq
  // Where the update writes the new state: kInvalid each when it writes in place.
  std::array<mem::Handle, 3> out{mem::Handle::kInvalid, mem::Handle::kInvalid,
                                 mem::Handle::kInvalid};
  mem::Handle grad = mem::Handle::kInvalid;
};

class StoreStepTarget : public StepTarget {
 public:
  // `groups[i]` has `tensors[i]`; shadowed exactly when its `out` handles are valid. `store`
  // must outlive the target.
  StoreStepTarget(mem::TieredStore& store, std::vector<StepGroup> groups,
                  std::vector<StepTensors> tensors, DType grad_dtype, DType out_dtype,
                  std::vector<std::size_t> order = {});

  std::span<const StepGroup> groups() const override { return groups_; }
  std::span<const std::size_t> order() const override { return order_; }
  DType grad_dtype() const override { return grad_dtype_; }
  DType out_dtype() const override { return out_dtype_; }

  Result<PinnedState> pin(std::size_t group, Tier tier) override;
  void unpin(std::size_t group, Tier tier, bool written) override;

  Status open_ranges(std::size_t group) override;
  void close_ranges(bool written, bool ok) override;
  io::IoHandle read_range(std::size_t group, optim::StreamedArray array, std::uint64_t offset,
                          void* dst, std::size_t bytes) override;
  io::IoHandle write_range(std::size_t group, optim::StreamedArray array, std::uint64_t offset,
                           const void* src, std::size_t bytes) override;
  Result<const void*> open_gradient(std::size_t group) override;
  void close_gradient(std::size_t group) override;

 protected:
  mem::TieredStore& store() { return store_; }
  const StepTensors& tensors(std::size_t group) const { return tensors_[group]; }

 private:
  // The arrays an update writes: the shadow copies, or the state itself.
  const std::array<mem::Handle, 3>& written(std::size_t group) const {
    return groups_[group].shadowed ? tensors_[group].out : tensors_[group].state;
  }

  mem::TieredStore& store_;
  std::vector<StepGroup> groups_;
  std::vector<StepTensors> tensors_;
  DType grad_dtype_, out_dtype_;
  std::vector<std::size_t> order_;
  // Homes open for ranged I/O, and whether the step writes them.
  std::vector<std::pair<mem::Handle, bool>> ranges_;
  // By group: how the streamed update holds its gradient.
  enum class GradHeld : std::uint8_t { kNone, kHost, kRanges };
  std::vector<GradHeld> grad_held_;
};

}  // namespace strata::zero
