// Warmup + cosine learning-rate schedule.
#include "strata/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace strata::optim {

std::string_view schedule_kind_name(ScheduleKind kind) {
  return kind == ScheduleKind::kConstant ? "constant" : "cosine";
}

double LrSchedule::lr_at(std::int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  if (type == ScheduleKind::kConstant) return base_lr;
  const std::int64_t decay_steps = std::max<std::int64_t>(1, total_steps - warmup_steps - 1);
  const double progress = std::clamp(
      static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace strata::optim
