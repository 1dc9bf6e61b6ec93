// AdamW for optimizer state kept on the CPU device: the scalar reference, split over threads.
#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "src/device/cpu/cpu_ops_internal.h"
#include "strata/device/adam8bit.h"

namespace strata::device::cpu {

// Each element's update is independent (8-bit moments: each 256-element block's), so running
// adamw_reference on disjoint runs of whole blocks gives bitwise the reference's result
// (optimizer placement must never change the numbers).
void cpu_adamw(const CpuContext& ctx, const AdamWArgs& a) {
  STRATA_CHECK(a.step >= 1, "adamw step is 1-based", a.step);
  check_adamw_args(a, "adamw:");
  const std::size_t grad_size = dtype_size(a.grad_dtype);
  const std::size_t out_size = dtype_size(a.out_dtype);
  const std::size_t state_size = dtype_size(a.state_dtype);
  const std::size_t master_size = dtype_size(a.master_dtype);
  const auto at = [](auto* p, std::int64_t i, std::size_t size) {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(p)>>,
                                    const std::byte, std::byte>;
    return p == nullptr ? nullptr : reinterpret_cast<Byte*>(p) + static_cast<std::size_t>(i) * size;
  };
  const auto scale_at = [](auto* p, std::int64_t i) {
    return p == nullptr ? p : p + i / kAdam8BlockElems;
  };
  constexpr std::int64_t kBlock = kAdam8BlockElems;
  const std::int64_t blocks = (a.n + kBlock - 1) / kBlock;
  ctx.parallel_for(blocks, 64, [&](std::int64_t b0, std::int64_t b1) {
    const std::int64_t i0 = b0 * kBlock;
    const std::int64_t i1 = std::min(a.n, b1 * kBlock);
    AdamWArgs part = a;
    part.param = at(a.param, i0, master_size);
    part.param_comp = at(a.param_comp, i0, 2);
    part.element_offset = a.element_offset + static_cast<std::uint64_t>(i0);
    part.grad = static_cast<const std::byte*>(a.grad) + static_cast<std::size_t>(i0) * grad_size;
    part.exp_avg = at(a.exp_avg, i0, state_size);
    part.exp_avg_sq = at(a.exp_avg_sq, i0, state_size);
    part.exp_avg_scale = scale_at(a.exp_avg_scale, i0);
    part.exp_avg_sq_scale = scale_at(a.exp_avg_sq_scale, i0);
    if (a.param_in != nullptr) {
      part.param_in = at(a.param_in, i0, master_size);
      part.param_comp_in = at(a.param_comp_in, i0, 2);
      part.exp_avg_in = at(a.exp_avg_in, i0, state_size);
      part.exp_avg_sq_in = at(a.exp_avg_sq_in, i0, state_size);
      part.exp_avg_scale_in = scale_at(a.exp_avg_scale_in, i0);
      part.exp_avg_sq_scale_in = scale_at(a.exp_avg_sq_scale_in, i0);
    }
    part.n = i1 - i0;
    if (a.param_out != nullptr) {
      part.param_out =
          static_cast<std::byte*>(a.param_out) + static_cast<std::size_t>(i0) * out_size;
    }
    adamw_reference(part);
  });
}

}  // namespace strata::device::cpu
