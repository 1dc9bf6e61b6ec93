// The communicators' shared reduction arithmetic.
#include "src/dist/rank_order.h"

#include <cstddef>

#include "strata/core/summation_tree.h"

namespace strata::dist {
namespace {

template <typename T, typename Widen>
void tree_sums(const std::vector<const void*>& inputs, std::size_t n, Widen widen, float* out) {
  const auto ranks = static_cast<std::int64_t>(inputs.size());
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = canonical_sum(ranks, [&](std::int64_t r) {
      return widen(static_cast<const T*>(inputs[static_cast<std::size_t>(r)])[i]);
    });
  }
}

}  // namespace

void sum_in_tree_order(const std::vector<const void*>& inputs, std::int64_t count, DType dtype,
                       float* out) {
  const auto n = static_cast<std::size_t>(count);
  switch (dtype) {
    case DType::kBF16:
      tree_sums<bf16>(
          inputs, n, [](bf16 x) { return bf16_to_f32(x); }, out);
      break;
    case DType::kF16:
      tree_sums<f16>(
          inputs, n, [](f16 x) { return f16_to_f32(x); }, out);
      break;
    default:
      tree_sums<float>(
          inputs, n, [](float x) { return x; }, out);
      break;
  }
}

void reduce_in_tree_order(const std::vector<const void*>& inputs, std::int64_t count, DType dtype,
                          ReduceOp op, void* out) {
  const auto n = static_cast<std::size_t>(count);
  std::vector<float> acc(n);
  sum_in_tree_order(inputs, count, dtype, acc.data());
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
