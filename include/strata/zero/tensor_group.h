// The model's tensor-parallel group (model::TensorGroup) over the process grid's tensor
// communicator: each collective waits for the compute stream's work, runs, and is waited for.
#pragma once

#include <memory>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/model/tensor_group.h"

namespace strata::zero {

// A TensorGroup over a communicator, and with fewer kv heads than ranks the communicators of
// each kv head's replicas, whose traffic it counts (the grid counts the rest).
class CommTensorGroup : public model::TensorGroup {
 public:
  // The kv-replica communicator's counters (zero without one).
  virtual dist::CommStats replica_stats() const = 0;
};

// `comm` and `device` must outlive it. With fewer `kv_heads` than ranks it splits off the
// communicators of each kv head's replicas: collective over `comm`.
Result<std::unique_ptr<CommTensorGroup>> make_tensor_group(dist::Communicator& comm,
                                                           device::Device& device,
                                                           std::int64_t kv_heads);

}  // namespace strata::zero
