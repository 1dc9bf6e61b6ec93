// One AdamW step's scalars, formed once on the host by device::adamw_constants (ops.h) and read
// by every implementation: the reference, CPU Adam's kernels and the CUDA kernel, so they agree
// bit for bit. Plain C++17 (the CUDA kernels include it); a trivial type.
#pragma once

namespace strata::device {

struct AdamWConstants {
  float step_size;  // lr / bias_correction1, formed in double and rounded to f32 once
  float bc2_sqrt;   // sqrt(bias_correction2)
  float decay;      // 1 - lr * weight_decay (adamw_mode)
  float one_minus_beta1, one_minus_beta2;
  float beta1, beta2, eps, weight_decay;
  float grad_scale;  // the gradient's multiplier (unscaling, clipping)
  bool adamw_mode;   // false: Adam with L2 added to the gradient
};

}  // namespace strata::device
