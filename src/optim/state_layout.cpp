// Optimizer state layouts (strata/optim/state_layout.h).
#include "strata/optim/state_layout.h"

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "strata/device/adam8bit.h"
#include "strata/io/swap.h"

namespace strata::optim {
namespace {

std::uint64_t align_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

// The fewest elements whose `bytes` per `elems` fill a multiple of 4096 bytes.
std::int64_t elems_for_alignment(std::uint64_t bytes, std::int64_t elems) {
  std::int64_t n = elems;
  while ((static_cast<std::uint64_t>(n / elems) * bytes) % io::kIoAlignBytes != 0) n *= 2;
  return n;
}

}  // namespace

std::uint64_t StateLayout::aux_offset(std::int64_t n) const {
  return align_up(plane_bytes(n), io::kIoAlignBytes);
}

std::int64_t StateLayout::align_elems() const {
  std::int64_t a = elems_for_alignment(elem_bytes, 1);
  if (has_aux()) a = std::max(a, elems_for_alignment(aux_bytes, aux_elems));
  return a;
}

StateLayout master_layout(DType master_dtype, device::MasterRounding rounding) {
  StateLayout l;
  l.elem_bytes = dtype_size(master_dtype);
  if (master_dtype == DType::kBF16 && rounding == device::MasterRounding::kKahan) {
    l.aux_bytes = sizeof(bf16);
  }
  return l;
}

StateLayout moment_layout(DType state_dtype) {
  StateLayout l;
  l.elem_bytes = dtype_size(state_dtype);
  if (state_dtype == device::kAdam8StateDType) {
    l.aux_bytes = sizeof(float);
    l.aux_elems = device::kAdam8BlockElems;
  }
  return l;
}

double state_bytes_per_param(DType master_dtype, device::MasterRounding rounding,
                             DType state_dtype) {
  return master_layout(master_dtype, rounding).bytes_per_elem() +
         2 * moment_layout(state_dtype).bytes_per_elem();
}

namespace {

template <typename Ptr>
Ptr aux_at(Ptr base, const StateLayout& l, std::int64_t n) {
  if (base == nullptr || !l.has_aux()) return nullptr;
  using Byte =
      std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const std::byte, std::byte>;
  return static_cast<Ptr>(static_cast<Byte*>(base) + l.aux_offset(n));
}

}  // namespace

void attach_aux_planes(device::AdamWArgs& a, std::int64_t n, void* master, void* exp_avg,
                       void* exp_avg_sq) {
  const StateLayout ml = master_layout(a.master_dtype, a.master_rounding);
  const StateLayout sl = moment_layout(a.state_dtype);
  a.param_comp = aux_at(master, ml, n);
  a.exp_avg_scale = static_cast<float*>(aux_at(exp_avg, sl, n));
  a.exp_avg_sq_scale = static_cast<float*>(aux_at(exp_avg_sq, sl, n));
}

void attach_aux_planes_in(device::AdamWArgs& a, std::int64_t n, const void* master,
                          const void* exp_avg, const void* exp_avg_sq) {
  const StateLayout ml = master_layout(a.master_dtype, a.master_rounding);
  const StateLayout sl = moment_layout(a.state_dtype);
  a.param_comp_in = aux_at(master, ml, n);
  a.exp_avg_scale_in = static_cast<const float*>(aux_at(exp_avg, sl, n));
  a.exp_avg_sq_scale_in = static_cast<const float*>(aux_at(exp_avg_sq, sl, n));
}

}  // namespace strata::optim
