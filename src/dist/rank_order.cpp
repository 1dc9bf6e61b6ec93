// The communicators' shared reduction arithmetic.
#include "src/dist/rank_order.h"

#include <cstddef>

namespace strata::dist {

void reduce_in_rank_order(const std::vector<const void*>& inputs, std::int64_t count, DType dtype,
                          ReduceOp op, void* out) {
  const auto n = static_cast<std::size_t>(count);
  std::vector<float> acc(n), next(n);
  std::vector<std::byte> rounded(n * dtype_size(dtype));
  const auto round_to_dtype = [&] {  // acc = acc as the dtype holds it
    if (dtype == DType::kF32) return;
    convert(acc.data(), DType::kF32, rounded.data(), dtype, n);
    convert(rounded.data(), dtype, acc.data(), DType::kF32, n);
  };
  convert(inputs[0], dtype, acc.data(), DType::kF32, n);
  for (std::size_t r = 1; r < inputs.size(); ++r) {
    convert(inputs[r], dtype, next.data(), DType::kF32, n);
    for (std::size_t i = 0; i < n; ++i) acc[i] = acc[i] + next[i];
    round_to_dtype();
  }
  const auto world = static_cast<float>(inputs.size());
  if (op == ReduceOp::kAvg && inputs.size() > 1) {
    if (dtype == DType::kF32) {
      for (float& x : acc) x = x / world;
    } else {
      const float inv = 1.0f / world;
      for (float& x : acc) x = x * inv;
    }
  }
  convert(acc.data(), DType::kF32, out, dtype, n);
}

}  // namespace strata::dist
