// fp16's loss scaling, with DeepSpeed's semantics and key names: the loss gradient is multiplied
// by scale() so that small gradients survive fp16, and the optimizer divides it out again. A
// dynamic scaler (loss_scale 0) starts at 2^initial_scale_power; a step whose gradients overflow
// (a norm that is not finite, on any rank) is skipped and, once `hysteresis` overflows have
// used up the delay, halves the scale (never below min_loss_scale); after loss_scale_window
// steps without an overflow the scale doubles (and the hysteresis is restored). A static scaler
// (loss_scale > 0) keeps its scale; its overflows skip the step as well.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/status.h"

namespace strata::optim {

struct LossScalerConfig {
  double loss_scale = 0;  // 0: dynamic; else this fixed scale
  int initial_scale_power = 16;
  std::int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  // DeepSpeed's consecutive_hysteresis: every clean step restores the hysteresis, not only a
  // growth of the scale.
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
};

class LossScaler {
 public:
  // What a checkpoint keeps (trainer_state.json's "loss_scaler"), DeepSpeed's fields.
  struct State {
    double scale = 1;
    std::int64_t iteration = 0;       // steps seen (cur_iter)
    std::int64_t last_overflow = -1;  // the step of the last overflow (last_overflow_iter)
    int hysteresis_left = 1;          // overflows still tolerated before a cut (cur_hysteresis)
  };

  explicit LossScaler(const LossScalerConfig& config);

  bool dynamic() const { return config_.loss_scale == 0; }
  double scale() const { return state_.scale; }
  // The outcome of one step. An overflow that would take a dynamic scale below min_loss_scale
  // is an error: the gradients overflow even unscaled (DeepSpeed stops the run there too).
  Status update(bool overflow);

  const State& state() const { return state_; }
  // A saved state; refused (naming the field) when it cannot be this scaler's.
  Status restore(const State& state);

 private:
  LossScalerConfig config_;
  State state_;
};

}  // namespace strata::optim
