// The model's tensor-parallel group (model::TensorGroup) over the process grid's tensor
// communicator: each collective waits for the compute stream's work, runs, and is waited for.
#pragma once

#include <memory>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/model/tensor_group.h"

namespace strata::zero {

// `comm` and `device` must outlive it. With fewer `kv_heads` than ranks it splits off the
// communicators of each kv head's replicas: collective over `comm`.
Result<std::unique_ptr<model::TensorGroup>> make_tensor_group(dist::Communicator& comm,
                                                              device::Device& device,
                                                              std::int64_t kv_heads);

}  // namespace strata::zero
