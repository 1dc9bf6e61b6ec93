// AdamW for optimizer state that stays on the GPU; bit-identical to device::adamw_reference
// (this file is compiled with -fmad=false, and every expression keeps the reference's order).
// The master weights are f32, or bf16 kept by Kahan compensation or stochastic rounding; the
// moments f32, bf16, or block-wise 8-bit.
#include "common.cuh"
#include "strata/core/rng.h"

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
  p -= s.step_size * m / (sqrtf(v) / s.bc2_sqrt + s.eps);
}

// ---- master weights: strata/core/dtype.h's conversions, bit for bit ----

__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t b) {
  return __uint_as_float(static_cast<unsigned>(b) << 16);
}
// f32_to_bf16: to nearest, ties to even; a NaN keeps its top bits, quieted.
__device__ __forceinline__ std::uint16_t float_to_bf16_bits(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

template <MasterForm F>
__device__ __forceinline__ float load_master(const MasterWeights& w, std::int64_t i) {
  if constexpr (F == MasterForm::kF32) {
    return static_cast<const float*>(w.param)[i];
  } else {
    const float hi = bf16_bits_to_float(static_cast<const std::uint16_t*>(w.param)[i]);
    if constexpr (F == MasterForm::kKahan) {
      return __fadd_rn(hi, bf16_bits_to_float(w.comp[i]));  // the pair's f32 sum
    } else {
      return hi;
    }
  }
}

// Stores the updated weight p as its form keeps it; returns the value stored (the copy's).
template <MasterForm F>
__device__ __forceinline__ float store_master(const MasterWeights& w, std::int64_t i, float p) {
  if constexpr (F == MasterForm::kF32) {
    static_cast<float*>(w.param)[i] = p;
    return p;
  } else if constexpr (F == MasterForm::kKahan) {
    // Rounded to nearest, and what that dropped rounded toward zero.
    const std::uint16_t hi = float_to_bf16_bits(p);
    const float hf = bf16_bits_to_float(hi);
    const auto lo = static_cast<std::uint16_t>(__float_as_uint(__fsub_rn(p, hf)) >> 16);
    static_cast<std::uint16_t*>(w.param)[i] = hi;
    w.comp[i] = lo;
    return __fadd_rn(hf, bf16_bits_to_float(lo));
  } else {
    // Stochastic: up with the probability of the dropped fraction, from element i's own bits.
    const auto r =
        static_cast<unsigned>(splitmix64_at(w.seed, w.first + static_cast<std::uint64_t>(i)));
    const unsigned u = __float_as_uint(p);
    const std::uint16_t stored = (u & 0x7f800000u) == 0x7f800000u
                                     ? float_to_bf16_bits(p)
                                     : static_cast<std::uint16_t>((u + (r & 0xffffu)) >> 16);
    static_cast<std::uint16_t*>(w.param)[i] = stored;
    return bf16_bits_to_float(stored);
  }
}

// kVec: param, exp_avg and exp_avg_sq move as float4 (their pointers are 16-byte aligned; f32
// master weights and moments only). S: the moments' storage type (float, or bf16 widened and
// rounded back).
template <typename G, typename O, typename S, MasterForm F, bool kVec>
__global__ void adamw_kernel(MasterWeights w, const G* __restrict__ grad, S* __restrict__ exp_avg,
                             S* __restrict__ exp_avg_sq, std::int64_t n, AdamWScalars s,
                             O* __restrict__ param_out) {
  static_assert(!kVec || F == MasterForm::kF32);
  constexpr int kN = kVec ? 4 : 1;
  const std::int64_t groups = (n + kN - 1) / kN;
  for (std::int64_t gi = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       gi < groups; gi += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i0 = gi * kN;
    if constexpr (kVec) {
      float* param = static_cast<float*>(w.param);
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
      float p = load_master<F>(w, i), m = to_float(exp_avg[i]), v = to_float(exp_avg_sq[i]);
      adamw_element(load_grad(grad, i), p, m, v, s);
      p = store_master<F>(w, i, p);
      exp_avg[i] = from_float<S>(m);
      exp_avg_sq[i] = from_float<S>(v);
      if (param_out != nullptr) param_out[i] = from_float<O>(p);
    }
  }
}

// ---- 8-bit moments ----

// The number of thresholds below u: a branch-free binary search of kProbes steps over 2^kProbes
// thresholds (the last +infinity) in shared memory.
template <int kProbes>
__device__ __forceinline__ int nearest(const float* threshold, float u) {
  int idx = 0;
#pragma unroll
  for (int step = 1 << (kProbes - 1); step >= 1; step /= 2) {
    idx += threshold[idx + step - 1] < u ? step : 0;
  }
  return idx;
}

// device::adam8_reciprocal: 1 / a, or 0 below f32's normal range (the block stored as zeros).
__device__ __forceinline__ float reciprocal(float a) {
  return a >= 1.17549435e-38f ? __fdiv_rn(1.0f, a) : 0.0f;
}

constexpr int kAdam8Threads = 256;
constexpr int kAdam8Block = kAdam8BlockElems;
static_assert(kAdam8Block % 32 == 0 && kAdam8Threads % kAdam8Block == 0,
              "an 8-bit block is whole warps, and a CUDA block whole 8-bit blocks");
static_assert(kAdam8Threads == 256, "the tables are loaded an entry a thread");

// One CUDA block of 256 threads per 256 elements, a thread an element: whole 8-bit blocks. The
// largest magnitudes come from segment_max (max is exact in any order: the reference's
// sequential maximum).
template <typename G, typename O, MasterForm F>
__global__ void __launch_bounds__(kAdam8Threads)
    adamw8_kernel(MasterWeights w, const G* __restrict__ grad, std::uint8_t* __restrict__ m_codes,
                  float* __restrict__ m_scales, std::uint8_t* __restrict__ v_codes,
                  float* __restrict__ v_scales, std::int64_t n, AdamWScalars s, Adam8Tables t,
                  O* __restrict__ param_out) {
  __shared__ float m_magnitude[128], m_threshold[128], v_value[256], v_threshold[256];
  __shared__ float red[32];
  const int tid = static_cast<int>(threadIdx.x);
  v_value[tid] = t.v_value[tid];
  v_threshold[tid] = t.v_threshold[tid];
  if (tid < 128) {
    m_magnitude[tid] = t.m_magnitude[tid];
    m_threshold[tid] = t.m_threshold[tid];
  }
  __syncthreads();
  constexpr int kWarps = kAdam8Block / 32;
  const std::int64_t tiles = (n + kAdam8Threads - 1) / kAdam8Threads;
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t i = tile * kAdam8Threads + tid;
    const std::int64_t b = i / kAdam8Block;  // the element's 8-bit block
    const bool live = i < n;
    float p = 0.0f, m = 0.0f, v = 0.0f, root = 0.0f;
    if (live) {
      p = load_master<F>(w, i);
      const unsigned cm = m_codes[i], cv = v_codes[i];
      m = __fmul_rn(m_magnitude[cm & 0x7fu], m_scales[b]);
      if (cm > 0x80u) m = -m;  // (-c) * scale == -(c * scale); 0x80 is 0
      const float sv = __fmul_rn(v_value[cv], v_scales[b]);
      v = __fmul_rn(sv, sv);
      adamw_element(load_grad(grad, i), p, m, v, s);
      root = __fsqrt_rn(v);
    }
    // Every thread has read its block's scales before any is rewritten below.
    const float am = segment_max<kWarps>(fabsf(m), red);
    const float av = segment_max<kWarps>(root, red);
    const float rm = reciprocal(am), rv = reciprocal(av);
    if (live) {
      int km = 0, kv = 0;
      if (rm != 0.0f) {
        const float y = __fmul_rn(m, rm);
        km = nearest<7>(m_threshold, fabsf(y));
        if (km != 0 && signbit(y)) km |= 0x80;
      }
      if (rv != 0.0f) {
        const float y = __fmul_rn(root, rv);
        kv = nearest<8>(v_threshold, y);
        if (kv == 0 && y > 0.0f) kv = 1;  // a non-zero root stays non-zero
      }
      m_codes[i] = static_cast<std::uint8_t>(km);
      v_codes[i] = static_cast<std::uint8_t>(kv);
      p = store_master<F>(w, i, p);
      if (param_out != nullptr) param_out[i] = from_float<O>(p);
    }
    if (live && i % kAdam8Block == 0) {  // the block's first element
      m_scales[b] = rm == 0.0f ? 0.0f : am;
      v_scales[b] = rv == 0.0f ? 0.0f : av;
    }
  }
}

// Calls fn(std::integral_constant<MasterForm, F>{}) for w's form.
template <typename Fn>
int dispatch_master(const MasterWeights& w, Fn&& fn) {
  switch (w.form) {
    case MasterForm::kF32:
      return fn(std::integral_constant<MasterForm, MasterForm::kF32>{});
    case MasterForm::kKahan:
      return fn(std::integral_constant<MasterForm, MasterForm::kKahan>{});
    case MasterForm::kStochastic:
      return fn(std::integral_constant<MasterForm, MasterForm::kStochastic>{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

// Calls fn(Tag<G>{}, Tag<O>{}, std::integral_constant<MasterForm, F>{}) for the step's gradient,
// copy and master weight types.
template <typename Fn>
int dispatch_step(Elem grad_dtype, Elem out_dtype, const MasterWeights& w, Fn&& fn) {
  return dispatch_float(grad_dtype, [&](auto gtag) {
    return dispatch_float(out_dtype, [&](auto otag) {
      return dispatch_master(w, [&](auto ftag) { return fn(gtag, otag, ftag); });
    });
  });
}

}  // namespace

int adamw(const LaunchContext& ctx, const MasterWeights& w, const void* grad, Elem grad_dtype,
          void* exp_avg, void* exp_avg_sq, Elem state_dtype, std::int64_t n, const AdamWScalars& s,
          void* param_out, Elem out_dtype) {
  if (n <= 0) return 0;
  if (state_dtype != Elem::kF32 && state_dtype != Elem::kBF16) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  constexpr int kThreads = 256;
  const bool f32_state = state_dtype == Elem::kF32;
  const bool vec = f32_state && aligned16(w.param) && aligned16(exp_avg) && aligned16(exp_avg_sq);
  return dispatch_step(grad_dtype, out_dtype, w, [&](auto gtag, auto otag, auto ftag) {
    using G = typename decltype(gtag)::type;
    using O = typename decltype(otag)::type;
    constexpr MasterForm F = decltype(ftag)::value;
    const G* g = static_cast<const G*>(grad);
    O* o = static_cast<O*>(param_out);
    auto* mf = static_cast<float*>(exp_avg);
    auto* vf = static_cast<float*>(exp_avg_sq);
    if (!f32_state) {
      adamw_kernel<G, O, bf16_t, F, false><<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
          w, g, static_cast<bf16_t*>(exp_avg), static_cast<bf16_t*>(exp_avg_sq), n, s, o);
      return launch_check();
    }
    if constexpr (F == MasterForm::kF32) {
      if (vec) {
        adamw_kernel<G, O, float, F, true>
            <<<grid_for((n + 3) / 4, kThreads), kThreads, 0, stream_of(ctx)>>>(w, g, mf, vf, n, s,
                                                                               o);
        return launch_check();
      }
    }
    adamw_kernel<G, O, float, F, false>
        <<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(w, g, mf, vf, n, s, o);
    return launch_check();
  });
}

int adamw8(const LaunchContext& ctx, const MasterWeights& w, const void* grad, Elem grad_dtype,
           std::uint8_t* exp_avg, float* exp_avg_scale, std::uint8_t* exp_avg_sq,
           float* exp_avg_sq_scale, std::int64_t n, const AdamWScalars& s, const Adam8Tables& t,
           void* param_out, Elem out_dtype) {
  if (n <= 0) return 0;
  return dispatch_step(grad_dtype, out_dtype, w, [&](auto gtag, auto otag, auto ftag) {
    using G = typename decltype(gtag)::type;
    using O = typename decltype(otag)::type;
    adamw8_kernel<G, O, decltype(ftag)::value>
        <<<grid_for(n, kAdam8Threads), kAdam8Threads, 0, stream_of(ctx)>>>(
            w, static_cast<const G*>(grad), exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, n,
            s, t, static_cast<O*>(param_out));
    return launch_check();
  });
}

}  // namespace strata::kernels
