// The communicators' shared reduction arithmetic.
#include "src/dist/rank_order.h"

#include <algorithm>
#include <cstddef>

#include "strata/core/summation_tree.h"

namespace strata::dist {
namespace {

// Elements summed at a time: the tree's few buffers of them stay in cache, and each step of the
// tree is a plain loop over them.
constexpr std::size_t kBlock = 4096;

}  // namespace

void sum_in_tree_order(const std::vector<const void*>& inputs, std::int64_t count, DType dtype,
                       float* out) {
  const auto n = static_cast<std::size_t>(count);
  const auto ranks = static_cast<std::int64_t>(inputs.size());
  // The tree's operations are the same for every block of elements: taken once.
  SummationTree tree(ranks, /*canonical=*/true);
  std::vector<std::vector<SummationTree::Op>> ops;
  for (std::int64_t r = 0; r < ranks; ++r) ops.push_back(tree.arrive(r));
  const int result = tree.result();
  std::vector<float> buf(static_cast<std::size_t>(SummationTree::buffers_needed(ranks, true)) *
                         kBlock);
  std::vector<float> wide(kBlock);
  const std::size_t esize = dtype_size(dtype);
  for (std::size_t i0 = 0; i0 < n; i0 += kBlock) {
    const std::size_t m = std::min(kBlock, n - i0);
    for (std::size_t r = 0; r < inputs.size(); ++r) {
      convert(static_cast<const std::byte*>(inputs[r]) + i0 * esize, dtype, wide.data(),
              DType::kF32, m);
      for (const SummationTree::Op& o : ops[r]) {
        float* into = buf.data() + static_cast<std::size_t>(o.into) * kBlock;
        switch (o.kind) {
          case SummationTree::Op::Kind::kStore:
            for (std::size_t i = 0; i < m; ++i) into[i] = 0.0f + wide[i];
            break;
          case SummationTree::Op::Kind::kAdd:
            for (std::size_t i = 0; i < m; ++i) into[i] = into[i] + wide[i];
            break;
          case SummationTree::Op::Kind::kMerge: {
            const float* from = buf.data() + static_cast<std::size_t>(o.from) * kBlock;
            for (std::size_t i = 0; i < m; ++i) into[i] = into[i] + from[i];
            break;
          }
        }
      }
    }
    std::copy_n(buf.data() + static_cast<std::size_t>(result) * kBlock, m, out + i0);
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
