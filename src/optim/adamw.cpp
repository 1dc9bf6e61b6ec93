// Host AdamW: the scalar path (SIMD paths come with the CPU Adam work).
#include "strata/optim/adamw.h"

namespace strata::optim {

void cpu_adamw_step(const device::AdamWArgs& args) { device::adamw_reference(args); }

device::AdamWArgs make_adamw_args(const AdamWHyper& hyper, double lr, std::int64_t step,
                                  float grad_scale) {
  device::AdamWArgs a;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(hyper.beta1);
  a.beta2 = static_cast<float>(hyper.beta2);
  a.eps = static_cast<float>(hyper.eps);
  a.weight_decay = static_cast<float>(hyper.weight_decay);
  a.adamw_mode = hyper.adamw_mode;
  a.step = step;
  a.grad_scale = grad_scale;
  return a;
}

}  // namespace strata::optim
