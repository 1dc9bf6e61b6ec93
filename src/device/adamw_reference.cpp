// Scalar AdamW with torch.optim.AdamW semantics: the reference for every optimized path.
#include <cmath>

#include "strata/core/dtype.h"
#include "strata/core/rng.h"
#include "strata/device/ops.h"

namespace strata::device {

AdamWConstants adamw_constants(const AdamWArgs& a) {
  // Bias corrections in double, as torch computes them on Python floats before the tensor ops.
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(a.step));
  AdamWConstants c;
  c.step_size = static_cast<float>(static_cast<double>(a.lr) / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.decay = static_cast<float>(1.0 - static_cast<double>(a.lr) * a.weight_decay);
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(a.beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(a.beta2));
  return c;
}

void adamw_reference(const AdamWArgs& a) {
  const AdamWConstants c = adamw_constants(a);
  const float step_size = c.step_size, bc2_sqrt = c.bc2_sqrt, decay = c.decay;
  const float one_minus_b1 = c.one_minus_beta1, one_minus_b2 = c.one_minus_beta2;
  const auto beta1 = static_cast<float>(a.beta1), beta2 = static_cast<float>(a.beta2);
  const auto eps = static_cast<float>(a.eps), weight_decay = static_cast<float>(a.weight_decay);
  const bool out_of_place = a.param_in != nullptr;
  const void* param_in = out_of_place ? a.param_in : a.param;
  const DType pd = a.master_dtype;
  const void* exp_avg_in = out_of_place ? a.exp_avg_in : a.exp_avg;
  const void* exp_avg_sq_in = out_of_place ? a.exp_avg_sq_in : a.exp_avg_sq;
  const DType sd = a.state_dtype;
  const auto store_state = [sd](void* to, std::int64_t i, float x) {
    if (sd == DType::kBF16) {
      static_cast<bf16*>(to)[i] = f32_to_bf16(x);
    } else {
      static_cast<float*>(to)[i] = x;
    }
  };
  for (std::int64_t i = 0; i < a.n; ++i) {
    float g = load_as_f32(a.grad, a.grad_dtype, static_cast<std::size_t>(i)) * a.grad_scale;
    float p = load_as_f32(param_in, pd, static_cast<std::size_t>(i));
    if (a.adamw_mode) {
      p *= decay;
    } else {
      g += weight_decay * p;
    }
    const auto ui = static_cast<std::size_t>(i);
    const float m = beta1 * load_as_f32(exp_avg_in, sd, ui) + one_minus_b1 * g;
    const float v = beta2 * load_as_f32(exp_avg_sq_in, sd, ui) + one_minus_b2 * g * g;
    store_state(a.exp_avg, i, m);
    store_state(a.exp_avg_sq, i, v);
    p -= step_size * m / (std::sqrt(v) / bc2_sqrt + eps);
    if (pd == DType::kBF16) {  // stochastic rounding; the copy is of the value stored
      const auto r = static_cast<std::uint32_t>(
          splitmix64_at(a.rounding_seed, a.element_offset + static_cast<std::uint64_t>(i)));
      const bf16 stored = f32_to_bf16_stochastic(p, r);
      static_cast<bf16*>(a.param)[i] = stored;
      p = bf16_to_f32(stored);
    } else {
      static_cast<float*>(a.param)[i] = p;
    }
    if (a.param_out != nullptr) {
      switch (a.out_dtype) {
        case DType::kF32:
          static_cast<float*>(a.param_out)[i] = p;
          break;
        case DType::kBF16:
          static_cast<bf16*>(a.param_out)[i] = f32_to_bf16(p);
          break;
        case DType::kF16:
          static_cast<f16*>(a.param_out)[i] = f32_to_f16(p);
          break;
        default:
          break;
      }
    }
  }
}

}  // namespace strata::device
