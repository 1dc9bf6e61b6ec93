// Private to the communicators: the one arithmetic of a reduction over ranks.
#pragma once

#include <cstdint>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/dist/communicator.h"

namespace strata::dist {

// out[i] = op over r of inputs[r][i]: the ranks' values widened to f32 and summed in the
// canonical tree over the ranks (core/summation_tree.h: pairs of ranks, then pairs of pairs),
// each sum starting from +0, rounded to `dtype` once at the end; an average then divides by the
// rank count (f32) or multiplies by its inverse (16-bit floats), as the MPI communicator's
// averager does. The same bits for a group of ranks as one rank's micro-batches summed in that
// tree. `out` may be one of the inputs.
void reduce_in_tree_order(const std::vector<const void*>& inputs, std::int64_t count, DType dtype,
                          ReduceOp op, void* out);
// The sum alone, in f32, not rounded to dtype (reduce_scatter_wide's).
void sum_in_tree_order(const std::vector<const void*>& inputs, std::int64_t count, DType dtype,
                       float* out);

}  // namespace strata::dist
