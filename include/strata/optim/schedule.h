// Learning-rate schedules and gradient clipping helpers.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace strata::optim {

// Strata's own ("constant", "cosine": an optional linear warmup, then the lr or a cosine to
// min_lr) and DeepSpeed's three, computed as DeepSpeed's lr_schedules.py computes them:
// "warmup" (WarmupLR), "warmup_decay" (WarmupDecayLR), "warmup_cosine" (WarmupCosineLR).
enum class ScheduleKind : std::uint8_t { kConstant, kCosine, kWarmup, kWarmupDecay, kWarmupCosine };
inline constexpr std::array<ScheduleKind, 5> kScheduleKinds = {
    ScheduleKind::kConstant, ScheduleKind::kCosine, ScheduleKind::kWarmup,
    ScheduleKind::kWarmupDecay, ScheduleKind::kWarmupCosine};
std::string_view schedule_kind_name(ScheduleKind kind);
// DeepSpeed's schedules, whose warmup has a shape (warmup_type) and whose keys are DeepSpeed's.
inline bool is_deepspeed_schedule(ScheduleKind kind) {
  return kind == ScheduleKind::kWarmup || kind == ScheduleKind::kWarmupDecay ||
         kind == ScheduleKind::kWarmupCosine;
}

// DeepSpeed's warmup shapes: the lr rises with log(step + 1) / log(warmup_steps) ("log", its
// default) or step / warmup_steps ("linear").
enum class WarmupType : std::uint8_t { kLog, kLinear };
std::string_view warmup_type_name(WarmupType type);  // "log", "linear"

struct LrSchedule {
  ScheduleKind type = ScheduleKind::kConstant;
  double base_lr = 1e-3;  // the optimizer's lr: DeepSpeed's warmup_max_lr, WarmupCosineLR's lr
  std::int64_t warmup_steps = 0;
  double min_lr = 0.0;  // cosine's floor
  std::int64_t total_steps = 1;
  // DeepSpeed's schedules only: the warmup's shape, WarmupLR's and WarmupDecayLR's
  // warmup_min_lr, and WarmupCosineLR's warmup_min_ratio and cos_min_ratio (of base_lr).
  WarmupType warmup_type = WarmupType::kLog;
  double warmup_min_lr = 0.0;
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;

  // Learning rate for optimizer step `step` (0-based).
  // constant, cosine: warmup ramps linearly from base_lr / warmup_steps at step 0 to base_lr at
  // step warmup_steps - 1; cosine then decays from base_lr to min_lr at step total_steps - 1.
  // warmup, warmup_decay, warmup_cosine: DeepSpeed's formulas in its operations and order (so the
  // same doubles), at the iteration DeepSpeed's engine has reached when it runs optimizer step
  // `step` (step - 1: the scheduler starts at -1 and advances after each step),
  // warmup_steps raised to 2 as DeepSpeed raises warmup_num_steps.
  double lr_at(std::int64_t step) const;
};

// Scale to apply to gradients so their global L2 norm is at most max_norm (1 if clipping is off
// or not needed).
inline double clip_scale(double grad_norm, double max_norm) {
  if (max_norm <= 0 || grad_norm <= max_norm) return 1.0;
  return max_norm / (grad_norm + 1e-6);
}

}  // namespace strata::optim
