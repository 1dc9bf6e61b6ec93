// The expert-parallel group an MoE model runs over (a layer's experts shared out over its
// ranks): the exchanges the token dispatch needs. The model knows nothing of how they travel; the
// trainer hands it an implementation over the grid's expert communicator.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::model {

class ExpertGroup {
 public:
  virtual ~ExpertGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // Each is complete when it returns; an error names the operation (`what`).
  // recv[r * count + i] = rank r's send[i], in host memory.
  virtual Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                                 std::string_view what) = 0;
  // send_counts[r] elements of send to each rank r and recv_counts[r] from each into recv, both
  // packed in rank order (device buffers; after the work issued on the compute stream).
  virtual Status all_to_all_v(const void* send, std::span<const std::int64_t> send_counts,
                              void* recv, std::span<const std::int64_t> recv_counts, DType dtype,
                              std::string_view what) = 0;
};

}  // namespace strata::model
