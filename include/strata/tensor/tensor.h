// Tensor descriptors: shape, dtype and the memory tier a copy lives in. No math here.
#pragma once

#include <cstdint>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/dtype.h"

namespace strata {

enum class Tier : std::uint8_t { kDevice, kHost, kNvme };
inline constexpr int kNumTiers = 3;
std::string_view tier_name(Tier tier);  // "device", "host", "nvme"

inline std::int64_t num_elems_of(const std::vector<std::int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}
std::string shape_string(const std::vector<std::int64_t>& shape);  // "[4, 8]"

struct TensorDesc {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kF32;
  std::int64_t num_elems() const { return num_elems_of(shape); }
  std::size_t size_bytes() const {
    return static_cast<std::size_t>(num_elems()) * dtype_size(dtype);
  }
};

}  // namespace strata
