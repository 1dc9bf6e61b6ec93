// Private to the communicators: the one arithmetic of a reduction folded in rank order.
#pragma once

#include <cstdint>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/dist/communicator.h"

namespace strata::dist {

// out[i] = op over r of inputs[r][i], folded in rank order in f32, each add rounded to `dtype`
// (exact for f32; for 16-bit floats MPI's own sum op here: convert, add in f32, round), then an
// average divides by the rank count (f32) or multiplies by its inverse (16-bit floats), as the MPI
// communicator's averager does. `out` may be one of the inputs.
void reduce_in_rank_order(const std::vector<const void*>& inputs, std::int64_t count, DType dtype,
                          ReduceOp op, void* out);

}  // namespace strata::dist
