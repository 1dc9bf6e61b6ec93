// Learning-rate schedules and gradient clipping helpers.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace strata::optim {

enum class ScheduleKind : std::uint8_t { kConstant, kCosine };
inline constexpr std::array<ScheduleKind, 2> kScheduleKinds = {ScheduleKind::kConstant,
                                                               ScheduleKind::kCosine};
std::string_view schedule_kind_name(ScheduleKind kind);  // "constant", "cosine"

struct LrSchedule {
  ScheduleKind type = ScheduleKind::kConstant;
  double base_lr = 1e-3;
  std::int64_t warmup_steps = 0;
  double min_lr = 0.0;
  std::int64_t total_steps = 1;

  // Learning rate for optimizer step `step` (0-based). Warmup ramps linearly from
  // base_lr / warmup_steps at step 0 to base_lr at step warmup_steps - 1; cosine then decays
  // from base_lr to min_lr at step total_steps - 1.
  double lr_at(std::int64_t step) const;
};

// Scale to apply to gradients so their global L2 norm is at most max_norm (1 if clipping is off
// or not needed).
inline double clip_scale(double grad_norm, double max_norm) {
  if (max_norm <= 0 || grad_norm <= max_norm) return 1.0;
  return max_norm / (grad_norm + 1e-6);
}

}  // namespace strata::optim
