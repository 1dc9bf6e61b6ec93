// Scalar AdamW with torch.optim.AdamW semantics: the reference for every optimized path.
#include <algorithm>
#include <cmath>

#include "strata/core/check.h"
#include "strata/core/dtype.h"
#include "strata/core/rng.h"
#include "strata/device/adam8bit.h"
#include "strata/device/ops.h"

namespace strata::device {

void check_adamw_args(const AdamWArgs& a, const char* who) {
  STRATA_CHECK(a.n >= 0, who, "negative element count", a.n);
  if (a.n == 0) return;
  STRATA_CHECK(
      a.param != nullptr && a.grad != nullptr && a.exp_avg != nullptr && a.exp_avg_sq != nullptr,
      who, "null param, grad or moment pointer");
  const int inputs =
      (a.param_in != nullptr) + (a.exp_avg_in != nullptr) + (a.exp_avg_sq_in != nullptr);
  STRATA_CHECK(inputs == 0 || inputs == 3, who, "out of place needs all three inputs, got", inputs);
  STRATA_CHECK(a.state_dtype == DType::kF32 || a.state_dtype == DType::kBF16 ||
                   a.state_dtype == kAdam8StateDType,
               who, "moments must be f32, bf16 or 8-bit, got", dtype_name(a.state_dtype));
  if (a.state_dtype == kAdam8StateDType) {
    STRATA_CHECK(
        a.exp_avg_scale != nullptr && a.exp_avg_sq_scale != nullptr &&
            (inputs == 0 || (a.exp_avg_scale_in != nullptr && a.exp_avg_sq_scale_in != nullptr)),
        who, "8-bit moments without their block scales");
  }
  STRATA_CHECK(a.master_dtype == DType::kF32 || a.master_dtype == DType::kBF16, who,
               "master weights must be f32 or bf16, got", dtype_name(a.master_dtype));
  if (a.master_dtype == DType::kBF16 && a.master_rounding == MasterRounding::kKahan) {
    STRATA_CHECK(a.param_comp != nullptr && (inputs == 0 || a.param_comp_in != nullptr), who,
                 "Kahan master weights without their compensation");
  }
}

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
  c.beta1 = static_cast<float>(a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.eps = static_cast<float>(a.eps);
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.grad_scale = a.grad_scale;
  c.adamw_mode = a.adamw_mode;
  return c;
}

void adamw_reference(const AdamWArgs& a) {
  const AdamWConstants c = adamw_constants(a);
  const float step_size = c.step_size, bc2_sqrt = c.bc2_sqrt, decay = c.decay;
  const float one_minus_b1 = c.one_minus_beta1, one_minus_b2 = c.one_minus_beta2;
  const float beta1 = c.beta1, beta2 = c.beta2, eps = c.eps, weight_decay = c.weight_decay;
  const bool out_of_place = a.param_in != nullptr;
  const void* param_in = out_of_place ? a.param_in : a.param;
  const DType pd = a.master_dtype;
  const bool kahan = pd == DType::kBF16 && a.master_rounding == MasterRounding::kKahan;
  const void* comp_in = out_of_place ? a.param_comp_in : a.param_comp;
  const void* exp_avg_in = out_of_place ? a.exp_avg_in : a.exp_avg;
  const void* exp_avg_sq_in = out_of_place ? a.exp_avg_sq_in : a.exp_avg_sq;
  const DType sd = a.state_dtype;
  const bool q8 = sd == kAdam8StateDType;
  const float* m_scale_in = out_of_place ? a.exp_avg_scale_in : a.exp_avg_scale;
  const float* v_scale_in = out_of_place ? a.exp_avg_sq_scale_in : a.exp_avg_sq_scale;
  // A block of 8-bit moments at a time: widened whole, quantized whole once stepped.
  float m_in[kAdam8BlockElems], v_in[kAdam8BlockElems];
  float m_new[kAdam8BlockElems], v_new[kAdam8BlockElems];
  for (std::int64_t b0 = 0; b0 < a.n; b0 += kAdam8BlockElems) {
    const std::int64_t len = std::min(kAdam8BlockElems, a.n - b0);
    const std::int64_t block = b0 / kAdam8BlockElems;
    for (std::int64_t j = 0; j < len; ++j) {
      const auto ui = static_cast<std::size_t>(b0 + j);
      if (!q8) {
        m_in[j] = load_as_f32(exp_avg_in, sd, ui);
        v_in[j] = load_as_f32(exp_avg_sq_in, sd, ui);
      }
    }
    if (q8) {
      adam8_dequantize_m(static_cast<const std::uint8_t*>(exp_avg_in) + b0, m_scale_in[block], len,
                         m_in);
      adam8_dequantize_v(static_cast<const std::uint8_t*>(exp_avg_sq_in) + b0, v_scale_in[block],
                         len, v_in);
    }
    for (std::int64_t j = 0; j < len; ++j) {
      const std::int64_t i = b0 + j;
      const auto ui = static_cast<std::size_t>(i);
      float g = load_as_f32(a.grad, a.grad_dtype, ui) * a.grad_scale;
      float p = load_as_f32(param_in, pd, ui);
      if (kahan) p += bf16_to_f32(static_cast<const bf16*>(comp_in)[i]);
      if (a.adamw_mode) {
        p *= decay;
      } else {
        g += weight_decay * p;
      }
      const float m = beta1 * m_in[j] + one_minus_b1 * g;
      const float v = beta2 * v_in[j] + one_minus_b2 * g * g;
      m_new[j] = m;
      v_new[j] = v;
      p -= step_size * m / (std::sqrt(v) / bc2_sqrt + eps);
      if (kahan) {  // the rounded weight and what rounding dropped; the copy is of their sum
        const bf16 hi = f32_to_bf16(p);
        const bf16 lo = f32_to_bf16_toward_zero(p - bf16_to_f32(hi));
        static_cast<bf16*>(a.param)[i] = hi;
        static_cast<bf16*>(a.param_comp)[i] = lo;
        p = bf16_to_f32(hi) + bf16_to_f32(lo);
      } else if (pd == DType::kBF16) {  // stochastic rounding; the copy is of the value stored
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
    if (q8) {
      adam8_quantize_m(m_new, len, static_cast<std::uint8_t*>(a.exp_avg) + b0,
                       a.exp_avg_scale + block);
      adam8_quantize_v(v_new, len, static_cast<std::uint8_t*>(a.exp_avg_sq) + b0,
                       a.exp_avg_sq_scale + block);
    } else {
      for (std::int64_t j = 0; j < len; ++j) {
        if (sd == DType::kBF16) {
          static_cast<bf16*>(a.exp_avg)[b0 + j] = f32_to_bf16(m_new[j]);
          static_cast<bf16*>(a.exp_avg_sq)[b0 + j] = f32_to_bf16(v_new[j]);
        } else {
          static_cast<float*>(a.exp_avg)[b0 + j] = m_new[j];
          static_cast<float*>(a.exp_avg_sq)[b0 + j] = v_new[j];
        }
      }
    }
  }
}

}  // namespace strata::device
