// The model's tensor-parallel group (model::TensorGroup) over the process grid's tensor
// communicator: each collective waits for the compute stream's work, runs, and is waited for.
#pragma once

#include <memory>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/model/tensor_group.h"

namespace strata::zero {

// `comm` and `device` must outlive it.
std::unique_ptr<model::TensorGroup> make_tensor_group(dist::Communicator& comm,
                                                      device::Device& device);

}  // namespace strata::zero
