// The MPI communicator (private): built when STRATA_HAVE_MPI.
#pragma once

#include <memory>

#include "strata/dist/communicator.h"

namespace strata::dist {

Result<std::unique_ptr<Communicator>> make_mpi_communicator(const CommOptions& options,
                                                            device::Device& device);
// An MPI communicator used only for its host-memory helpers (the NCCL communicator's control
// path); its device collectives must not be called.
Result<std::unique_ptr<Communicator>> make_mpi_host_communicator(const CommOptions& options,
                                                                 device::Device& device);

}  // namespace strata::dist
