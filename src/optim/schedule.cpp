// Learning-rate schedules: Strata's warmup + cosine, and DeepSpeed's three.
#include "strata/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace strata::optim {

std::string_view schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kConstant:
      return "constant";
    case ScheduleKind::kCosine:
      return "cosine";
    case ScheduleKind::kWarmup:
      return "warmup";
    case ScheduleKind::kWarmupDecay:
      return "warmup_decay";
    case ScheduleKind::kWarmupCosine:
      return "warmup_cosine";
  }
  return "constant";
}

std::string_view warmup_type_name(WarmupType type) {
  return type == WarmupType::kLog ? "log" : "linear";
}

namespace {

// DeepSpeed's warmup fraction at iteration `step` < w (WarmupLR._get_gamma's first branch).
double deepspeed_warmup(WarmupType type, std::int64_t step, std::int64_t w) {
  if (type == WarmupType::kLog) {
    const double inverse_log_warm_up = 1.0 / std::log(static_cast<double>(w));
    return inverse_log_warm_up * std::log(static_cast<double>(step + 1));
  }
  return static_cast<double>(step) / static_cast<double>(w);
}

}  // namespace

double LrSchedule::lr_at(std::int64_t optimizer_step) const {
  if (is_deepspeed_schedule(type)) {
    // DeepSpeed builds its scheduler at iteration -1 and steps it after each optimizer step:
    // optimizer step k runs at iteration k - 1, and the first at the schedule's start
    // (get_lr before the scheduler has started: the min lrs, or WarmupCosineLR's 0).
    const std::int64_t step = optimizer_step - 1;
    if (step < 0) return type == ScheduleKind::kWarmupCosine ? 0.0 : warmup_min_lr;
    const std::int64_t w = std::max<std::int64_t>(2, warmup_steps);
    if (type == ScheduleKind::kWarmupCosine) {  // WarmupCosineLR.get_lr_ratio
      double ratio;
      if (step < w) {
        ratio = deepspeed_warmup(warmup_type, step, w);
        const double ratio_delta = 1. - warmup_min_ratio;
        ratio = warmup_min_ratio + ratio * ratio_delta;
      } else {
        const double real_last_step = static_cast<double>(step - w + 1);
        const double real_total_steps =
            static_cast<double>(std::max<std::int64_t>(1, total_steps - w));
        const double cosine_progress = std::min(1.0, real_last_step / real_total_steps);
        const double ratio_delta = 1. - cos_min_ratio;
        ratio = (1 + std::cos(std::numbers::pi * cosine_progress)) / 2;
        ratio = std::max(0.0, cos_min_ratio + ratio_delta * ratio);
      }
      return base_lr * ratio;
    }
    double gamma = 1.0;  // WarmupLR._get_gamma, WarmupDecayLR._get_gamma
    if (step < w) {
      gamma = deepspeed_warmup(warmup_type, step, w);
    } else if (type == ScheduleKind::kWarmupDecay) {
      gamma = std::max(0.0, static_cast<double>(total_steps - step) /
                                std::max(1.0, static_cast<double>(total_steps - w)));
    }
    const double delta_lr = base_lr - warmup_min_lr;
    return warmup_min_lr + (delta_lr * gamma);
  }
  const std::int64_t step = optimizer_step;
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
