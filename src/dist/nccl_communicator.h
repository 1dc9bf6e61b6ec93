// The NCCL communicator (private): built when STRATA_HAVE_NCCL; several ranks also need MPI.
#pragma once

#include <memory>

#include "strata/dist/communicator.h"

namespace strata::dist {

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const CommOptions& options,
                                                             device::Device& device);

}  // namespace strata::dist
