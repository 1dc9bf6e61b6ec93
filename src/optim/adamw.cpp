// Host AdamW: the scalar single-thread path and the per-step argument helper (SIMD: cpu_adam.h).
#include "strata/optim/adamw.h"

#include "strata/core/rng.h"

namespace strata::optim {

void cpu_adamw_step(const device::AdamWArgs& args) { device::adamw_reference(args); }

device::AdamWArgs make_adamw_args(const AdamWHyper& hyper, double lr, std::int64_t step,
                                  float grad_scale) {
  device::AdamWArgs a;
  a.lr = lr;
  a.beta1 = hyper.beta1;
  a.beta2 = hyper.beta2;
  a.eps = hyper.eps;
  a.weight_decay = hyper.weight_decay;
  a.adamw_mode = hyper.adamw_mode;
  a.state_dtype = hyper.state_dtype;
  a.master_dtype = hyper.master_dtype;
  a.master_rounding = hyper.master_rounding;
  a.rounding_seed = splitmix64_at(hyper.seed, static_cast<std::uint64_t>(step));
  a.step = step;
  a.grad_scale = grad_scale;
  return a;
}

}  // namespace strata::optim
