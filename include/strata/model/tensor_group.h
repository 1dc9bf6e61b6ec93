// The tensor-parallel group a split model runs over (ParamLayout::build's TensorParallel): the
// collectives Megatron's split layers need, on device buffers. The model knows nothing of how
// they travel; the trainer hands it an implementation over the grid's tensor communicator.
#pragma once

#include <cstdint>
#include <string_view>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::model {

class TensorGroup {
 public:
  virtual ~TensorGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // Each runs after the work issued on the device's compute stream and is complete when it
  // returns; an error names the operation (`what`).
  // buffer[i] = the sum over the group's ranks of their buffer[i].
  virtual Status all_reduce_sum(void* buffer, std::int64_t count, DType dtype,
                                std::string_view what) = 0;
  // recv[r * count + i] = rank r's send[i]. send may be recv's own slot (recv + rank * count).
  virtual Status all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                            std::string_view what) = 0;
  // recv[i] = the sum over the group's ranks of their send[rank * count + i] (send holds
  // size * count; sequence parallelism's reduce-scatter).
  virtual Status reduce_scatter_sum(const void* send, void* recv, std::int64_t count, DType dtype,
                                    std::string_view what) = 0;
  // With fewer kv heads than ranks, each kv head is whole on kv_replicas() consecutive ranks
  // (size / kv heads); otherwise 1.
  virtual int kv_replicas() const = 0;
  // buffer[i] = the sum over the ranks holding this rank's kv head of their buffer[i].
  virtual Status kv_replica_sum(void* buffer, std::int64_t count, DType dtype,
                                std::string_view what) = 0;
};

}  // namespace strata::model
