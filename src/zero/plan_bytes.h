// Private to the memory plan: the bytes each tier holds under a plan, by kind, with the buffers
// in flight, the store's caches and ZeRO's collective buffers at their peaks.
#pragma once

#include <cstdint>
#include <vector>

#include "strata/zero/partition.h"
#include "strata/zero/plan.h"

namespace strata::zero::detail {

// Working copies count over every group (each in its home: MemoryPlan::home_of); gradients and
// optimizer state over the trainable (not frozen) ones only: the totals over those whose state is
// in the plan's optimizer tier, `on_device` over those the device steps (device_steps).
struct Sizes {
  std::uint64_t grad_work_io = 0, f32 = 0, f32_io = 0;  // trainable groups
  std::uint64_t moment = 0, moment_io = 0;        // one moment of the trainable groups, state dtype
  std::uint64_t master = 0, master_io = 0;        // their master weights, master dtype
  std::uint64_t max_work_io = 0;                  // every group
  std::uint64_t max_grad_io = 0, max_f32_io = 0;  // every trainable group
  // Of the offloaded ones: what lands in host memory and passes through it for the step.
  std::uint64_t max_grad_io_off = 0, max_f32_io_off = 0;
  std::int64_t max_elems = 0;             // trainable groups
  std::vector<std::uint64_t> elems;       // each group's
  std::vector<std::uint64_t> work_bytes;  // each group's working copy's
  std::vector<bool> frozen;               // each group's
  std::vector<std::uint64_t> trained;     // each trainable group's (offloaded ones)
  struct OnDevice {
    std::uint64_t f32 = 0, moment = 0, master = 0;  // as above, of the device-stepped groups
    std::uint64_t elems = 0;
  } on_device;
  bool any_trainable() const { return !trained.empty() || on_device.elems != 0; }
};

// Counts every tier's bytes by kind into `plan`, whose placements are set.
void count_bytes(const Sizes& z, const PlanOptions& o, MemoryPlan& plan);

// The tiers' peaks: each tier's bytes, ZeRO's buffers, and the store's caches up to the budgets.
void count_peaks(const Partition& partition, const PlanOptions& o, MemoryPlan& plan);

}  // namespace strata::zero::detail
