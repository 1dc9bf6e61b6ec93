// Rotary position embedding parameters and their frequencies, shared by the CPU backend and the
// CUDA kernels (which include this header), so both rotate by the same angles.
#pragma once

#include <cmath>
#include <cstdint>

#include "strata/device/host_device.h"

namespace strata::device {

// Hugging Face's rope_scaling: "linear" divides every frequency by `factor`; "llama3" divides
// the low frequencies (wavelength above original_max_position_embeddings / low_freq_factor) by
// `factor`, keeps the high ones (wavelength below original_max / high_freq_factor), and blends
// linearly between.
struct RopeScaling {
  enum Type : std::uint8_t { kNone = 0, kLinear = 1, kLlama3 = 2 };
  Type type = kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192.0;
};

struct RopeParams {
  RopeParams() = default;
  explicit RopeParams(double theta_in, RopeScaling scaling_in = {}, std::int64_t offset = 0)
      : theta(theta_in), scaling(scaling_in), position_offset(offset) {}

  double theta = 10000.0;
  RopeScaling scaling;
  // Position of the first row of a sequence (decoding with a KV cache starts past the prompt).
  std::int64_t position_offset = 0;

  // theta^(-2j / head_dim), scaled; in double.
  STRATA_HOST_DEVICE double inv_freq(std::int64_t j, std::int64_t head_dim) const {
    const double f = pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(head_dim));
    switch (scaling.type) {
      case RopeScaling::kLinear:
        return f / scaling.factor;
      case RopeScaling::kLlama3: {
        const double kPi = 3.14159265358979323846;
        const double wavelen = 2.0 * kPi / f;
        const double old = scaling.original_max_position_embeddings;
        const double low_wavelen = old / scaling.low_freq_factor;
        const double high_wavelen = old / scaling.high_freq_factor;
        if (wavelen > low_wavelen) return f / scaling.factor;
        if (wavelen < high_wavelen) return f;
        const double smooth = (old / wavelen - scaling.low_freq_factor) /
                              (scaling.high_freq_factor - scaling.low_freq_factor);
        return (1.0 - smooth) * f / scaling.factor + smooth * f;
      }
      default:
        return f;
    }
  }
};

}  // namespace strata::device
