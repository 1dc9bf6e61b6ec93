// Host-side AdamW over fp32 master weights and moments (offload_optimizer: cpu|nvme).
#pragma once

#include "strata/device/ops.h"

namespace strata::optim {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw_mode = true;
  // The moments' storage (the config's optimizer.state_dtype): f32, or bf16 (half the bytes in
  // every tier and across the drive; each step widens them, computes in f32 and rounds back).
  DType state_dtype = DType::kF32;
  // The master weights' storage (optimizer.master_dtype): f32, or bf16 with stochastic rounding
  // (device::AdamWArgs), its random bits seeded from `seed`, the step and the group.
  DType master_dtype = DType::kF32;
  device::MasterRounding master_rounding = device::MasterRounding::kStochastic;  // bf16 only
  std::uint64_t seed = 0;
};

// One AdamW step on host memory with torch.optim.AdamW semantics (see device::AdamWArgs). This is
// the scalar path, one thread: it delegates to the same reference the CPU backend's device op
// uses. The offload engine runs optim::CpuAdam (cpu_adam.h) instead, SIMD and multi-threaded and
// bit-identical to this.
void cpu_adamw_step(const device::AdamWArgs& args);

// Fills the per-step fields of AdamWArgs from the hyperparameters.
device::AdamWArgs make_adamw_args(const AdamWHyper& hyper, double lr, std::int64_t step,
                                  float grad_scale);

}  // namespace strata::optim
