// Portable scalar CpuAdam kernels: the same statements as device::adamw_reference, per tile.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "src/optim/cpu_adam_kernels.h"
#include "strata/core/dtype.h"
#include "strata/core/rng.h"
#include "strata/device/adam8bit.h"

namespace strata::optim::detail {
namespace {

template <int G>
float load_grad(const void* grad, std::int64_t i) {
  if constexpr (G == kGradF32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == kGradBF16) {
    return bf16_to_f32(static_cast<const bf16*>(grad)[i]);
  } else {
    return f16_to_f32(static_cast<const f16*>(grad)[i]);
  }
}

template <int O>
void store_out(void* out, std::int64_t i, float p) {
  if constexpr (O == kOutF32) {
    static_cast<float*>(out)[i] = p;
  } else if constexpr (O == kOutBF16) {
    static_cast<bf16*>(out)[i] = f32_to_bf16(p);
  } else if constexpr (O == kOutF16) {
    static_cast<f16*>(out)[i] = f32_to_f16(p);
  }
}

// Keep every operation and its order identical to device::adamw_reference.
template <int G, int O, bool kAdamW>
void adam_tile(const AdamConstants& constants, const AdamTile& tile) {
  // Local copies: stores through the tile's pointers cannot change them, so they stay in
  // registers instead of being reloaded after every store.
  const AdamConstants c = constants;
  const AdamTile t = tile;
  for (std::int64_t i = 0; i < t.n; ++i) {
    float g = load_grad<G>(t.grad, i) * c.grad_scale;
    float p = t.param_in[i];
    if constexpr (kAdamW) {
      p *= c.decay;
    } else {
      g += c.weight_decay * p;
    }
    const float m = c.beta1 * t.exp_avg_in[i] + c.one_minus_beta1 * g;
    const float v = c.beta2 * t.exp_avg_sq_in[i] + c.one_minus_beta2 * g * g;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    p -= c.step_size * m / (std::sqrt(v) / c.bc2_sqrt + c.eps);
    t.param[i] = p;
    store_out<O>(t.param_out, i, p);
  }
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Same bytes as adam_tile, trivial combine; half-precision outputs keep the high 16 bits.
template <int G, int O>
void roofline_tile(const AdamTile& tile) {
  const AdamTile t = tile;  // as in adam_tile
  for (std::int64_t i = 0; i < t.n; ++i) {
    float g;
    if constexpr (G == kGradF32) {
      g = static_cast<const float*>(t.grad)[i];
    } else {
      g = bf16_to_f32(static_cast<const bf16*>(t.grad)[i]);
    }
    const float p = t.param_in[i] + g;
    t.param[i] = p;
    t.exp_avg[i] = t.exp_avg_in[i] + g;
    t.exp_avg_sq[i] = t.exp_avg_sq_in[i] + g;
    if constexpr (O == kOutF32) {
      static_cast<float*>(t.param_out)[i] = p;
    } else if constexpr (O != kOutNone) {
      static_cast<std::uint16_t*>(t.param_out)[i] = static_cast<std::uint16_t>(bits_of(p) >> 16);
    }
  }
}

template <int G>
bool all_finite(const void* grad, std::int64_t n) {
  if constexpr (G == kGradF32) {
    const auto* g = static_cast<const float*>(grad);
    std::uint32_t bad = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      bad |= static_cast<std::uint32_t>((bits_of(g[i]) & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
  } else {
    const std::uint16_t exp_mask = G == kGradBF16 ? 0x7f80u : 0x7c00u;
    const auto* g = static_cast<const std::uint16_t*>(grad);
    std::uint32_t bad = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      bad |= static_cast<std::uint32_t>((g[i] & exp_mask) == exp_mask);
    }
    return bad == 0;
  }
}

// ---- 8-bit moments ----

// The scalar reference's own quantizers (device/adam8bit.h): the search tables they use are the
// ones `s` points at.
void quant8_block(const Quant8Search& s, const float* x, std::int64_t n, std::uint8_t* codes,
                  float* scale) {
  if (s.second) {
    device::adam8_quantize_v(x, n, codes, scale);
  } else {
    device::adam8_quantize_m(x, n, codes, scale);
  }
}

void dequant8_block(const float* /*value*/, const std::uint8_t* codes, float scale, std::int64_t n,
                    bool square, float* out) {
  if (square) {
    device::adam8_dequantize_v(codes, scale, n, out);
  } else {
    device::adam8_dequantize_m(codes, scale, n, out);
  }
}

// Scalar stores are always regular, never prefetched: one kernel serves every variant.
struct Scalar {
  template <int G, int O, bool kAdamW, bool kNT, bool kPF>
  static constexpr AdamKernel adam = &adam_tile<G, O, kAdamW>;
  // bf16 moments: widened into f32 scratch by the caller.
  template <int G, int O, bool kAdamW>
  static constexpr AdamKernel adam_bf16_moments = nullptr;
  template <int G, int O, bool kAdamW, int kMaster>
  static constexpr Adam8Kernel adam8 = nullptr;
  template <int G, int O, bool kNT, bool kPF>
  static constexpr RooflineKernel roofline = &roofline_tile<G, O>;
  template <int G>
  static constexpr FiniteKernel all_finite = &detail::all_finite<G>;
  static constexpr Quant8Kernel quant8 = &quant8_block;
  static constexpr Dequant8Kernel dequant8 = &dequant8_block;
  static constexpr RoundStochasticKernel round_stochastic = &round_stochastic_scalar;
};

}  // namespace

void round_stochastic_scalar(float* p, std::int64_t n, std::uint64_t seed, std::uint64_t first,
                             std::uint16_t* dst) {
  for (std::int64_t j = 0; j < n; ++j) {
    const auto r =
        static_cast<std::uint32_t>(splitmix64_at(seed, first + static_cast<std::uint64_t>(j)));
    const bf16 stored = f32_to_bf16_stochastic(p[j], r);
    dst[j] = stored.bits;
    p[j] = bf16_to_f32(stored);
  }
}

void fill_scalar_kernels(KernelSet* set) { fill_kernel_table<Scalar>(set, "scalar"); }

}  // namespace strata::optim::detail
