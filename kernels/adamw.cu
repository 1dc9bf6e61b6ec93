// AdamW for optimizer state that stays on the GPU; bit-identical to device::adamw_reference
// (this file is compiled with -fmad=false, and every expression keeps the reference's order).
#include "common.cuh"

namespace strata::kernels {
namespace {

template <typename G>
__device__ __forceinline__ float load_grad(const G* g, std::int64_t i) {
  return to_float(g[i]);
}

// One element, written exactly as adamw_reference writes it: float operations in the same
// order, IEEE division and square root (nvcc's defaults), no contraction into FMA.
__device__ __forceinline__ void adamw_element(float g, float& p, float& m, float& v,
                                              const AdamWScalars& s) {
  g = g * s.grad_scale;
  if (s.adamw_mode) {
    p *= s.decay;
  } else {
    g += s.weight_decay * p;
  }
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  p -= s.lr_step_size * m / (sqrtf(v) / s.bc2_sqrt + s.eps);
}

// kVec: param, exp_avg and exp_avg_sq move as float4 (their pointers are 16-byte aligned; f32
// moments only). S: the moments' storage type (float, or bf16 widened and rounded back).
template <typename G, typename O, typename S, bool kVec>
__global__ void adamw_kernel(float* __restrict__ param, const G* __restrict__ grad,
                             S* __restrict__ exp_avg, S* __restrict__ exp_avg_sq, std::int64_t n,
                             AdamWScalars s, O* __restrict__ param_out) {
  constexpr int kN = kVec ? 4 : 1;
  const std::int64_t groups = (n + kN - 1) / kN;
  for (std::int64_t gi = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       gi < groups; gi += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i0 = gi * kN;
    if constexpr (kVec) {
      if (i0 + kN <= n) {
        float4 p = *reinterpret_cast<const float4*>(param + i0);
        float4 m = *reinterpret_cast<const float4*>(exp_avg + i0);
        float4 v = *reinterpret_cast<const float4*>(exp_avg_sq + i0);
        adamw_element(load_grad(grad, i0 + 0), p.x, m.x, v.x, s);
        adamw_element(load_grad(grad, i0 + 1), p.y, m.y, v.y, s);
        adamw_element(load_grad(grad, i0 + 2), p.z, m.z, v.z, s);
        adamw_element(load_grad(grad, i0 + 3), p.w, m.w, v.w, s);
        *reinterpret_cast<float4*>(param + i0) = p;
        *reinterpret_cast<float4*>(exp_avg + i0) = m;
        *reinterpret_cast<float4*>(exp_avg_sq + i0) = v;
        if (param_out != nullptr) {
          param_out[i0 + 0] = from_float<O>(p.x);
          param_out[i0 + 1] = from_float<O>(p.y);
          param_out[i0 + 2] = from_float<O>(p.z);
          param_out[i0 + 3] = from_float<O>(p.w);
        }
        continue;
      }
    }
    for (std::int64_t i = i0; i < n && i < i0 + kN; ++i) {
      float p = param[i], m = to_float(exp_avg[i]), v = to_float(exp_avg_sq[i]);
      adamw_element(load_grad(grad, i), p, m, v, s);
      param[i] = p;
      exp_avg[i] = from_float<S>(m);
      exp_avg_sq[i] = from_float<S>(v);
      if (param_out != nullptr) param_out[i] = from_float<O>(p);
    }
  }
}

}  // namespace

int adamw(const LaunchContext& ctx, float* param, const void* grad, Elem grad_dtype, void* exp_avg,
          void* exp_avg_sq, Elem state_dtype, std::int64_t n, const AdamWScalars& s,
          void* param_out, Elem out_dtype) {
  if (n <= 0) return 0;
  if (state_dtype != Elem::kF32 && state_dtype != Elem::kBF16) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  constexpr int kThreads = 256;
  const bool f32_state = state_dtype == Elem::kF32;
  const bool vec = f32_state && aligned16(param) && aligned16(exp_avg) && aligned16(exp_avg_sq);
  return dispatch_float(grad_dtype, [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    return dispatch_float(out_dtype, [&](auto otag) {
      using O = typename decltype(otag)::type;
      const G* g = static_cast<const G*>(grad);
      O* o = static_cast<O*>(param_out);
      auto* mf = static_cast<float*>(exp_avg);
      auto* vf = static_cast<float*>(exp_avg_sq);
      if (!f32_state) {
        adamw_kernel<G, O, bf16_t, false><<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
            param, g, static_cast<bf16_t*>(exp_avg), static_cast<bf16_t*>(exp_avg_sq), n, s, o);
      } else if (vec) {
        adamw_kernel<G, O, float, true>
            <<<grid_for((n + 3) / 4, kThreads), kThreads, 0, stream_of(ctx)>>>(param, g, mf, vf, n,
                                                                               s, o);
      } else {
        adamw_kernel<G, O, float, false>
            <<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(param, g, mf, vf, n, s, o);
      }
      return launch_check();
    });
  });
}

}  // namespace strata::kernels
