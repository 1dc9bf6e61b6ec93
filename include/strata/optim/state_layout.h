// How one array of optimizer state lies in its buffer (its host copy, its NVMe home and a staging
// slot alike): the elements in the array's storage type, then, for the compact forms that need
// more, a second plane starting at the next 4096-byte boundary: bf16 master weights' Kahan
// compensation (2 bytes an element) or 8-bit moments' block scales (one f32 per 256 elements).
// Every range the streamed step moves starts on a 4096-byte boundary in both planes.
#pragma once

#include <cstdint>

#include "strata/core/dtype.h"
#include "strata/device/ops.h"

namespace strata::optim {

struct StateLayout {
  std::uint64_t elem_bytes = 4;  // the first plane's, an element
  std::uint64_t aux_bytes = 0;   // the second plane's, a unit (0: no second plane)
  std::int64_t aux_elems = 1;    // elements a second-plane unit covers

  bool has_aux() const { return aux_bytes != 0; }
  std::uint64_t plane_bytes(std::int64_t n) const {
    return static_cast<std::uint64_t>(n) * elem_bytes;
  }
  std::uint64_t aux_plane_bytes(std::int64_t n) const {
    return static_cast<std::uint64_t>((n + aux_elems - 1) / aux_elems) * aux_bytes;
  }
  // Where the second plane starts in an array of n elements.
  std::uint64_t aux_offset(std::int64_t n) const;
  // The whole array's bytes.
  std::uint64_t bytes(std::int64_t n) const {
    return has_aux() ? aux_offset(n) + aux_plane_bytes(n) : plane_bytes(n);
  }
  // Element ranges starting on multiples of this start on 4096-byte boundaries in both planes.
  std::int64_t align_elems() const;
  // Bytes per element, the second plane's share included (for plans and reports).
  double bytes_per_elem() const {
    return static_cast<double>(elem_bytes) +
           static_cast<double>(aux_bytes) / static_cast<double>(aux_elems);
  }
  bool operator==(const StateLayout&) const = default;
};

// The master weights' (master_dtype f32 or bf16; Kahan adds the compensation plane).
StateLayout master_layout(DType master_dtype, device::MasterRounding rounding);
// Each moment's (state_dtype f32, bf16, or device::kAdam8StateDType with its scales).
StateLayout moment_layout(DType state_dtype);

// The optimizer state's bytes a trained parameter: the master weights and both moments.
double state_bytes_per_param(DType master_dtype, device::MasterRounding rounding,
                             DType state_dtype);

// Points args' compensation and scale pointers (and their *_in twins when `in` is set) at the
// second planes of buffers laid out for n elements: master at `master`, the moments at
// `exp_avg` and `exp_avg_sq` (nullptr: none of those).
void attach_aux_planes(device::AdamWArgs& args, std::int64_t n, void* master, void* exp_avg,
                       void* exp_avg_sq);
void attach_aux_planes_in(device::AdamWArgs& args, std::int64_t n, const void* master,
                          const void* exp_avg, const void* exp_avg_sq);

}  // namespace strata::optim
