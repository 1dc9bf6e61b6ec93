// Communicator factory: picks MPI when launched by mpirun, else the single-rank communicator.
#include "strata/dist/communicator.h"

#include <cstdlib>

#include "src/dist/mpi_communicator.h"
#include "src/dist/nccl_communicator.h"
#include "strata/build_config.h"
#include "strata/device/device.h"

namespace strata::dist {

bool launched_with_multiple_ranks() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && std::atoi(v) > 1) return true;
  }
  return false;
}

int launched_rank() {
  if (!launched_with_multiple_ranks()) return -1;
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"}) {
    const char* v = std::getenv(var);
    if (v != nullptr) return std::atoi(v);
  }
  return -1;
}

std::string_view comm_backend_name(CommBackend backend) {
  switch (backend) {
    case CommBackend::kAuto:
      return "auto";
    case CommBackend::kSingle:
      return "single";
    case CommBackend::kMpi:
      return "mpi";
    case CommBackend::kNccl:
      return "nccl";
  }
  return "?";
}

Result<std::unique_ptr<Communicator>> create_communicator(const CommOptions& options,
                                                          device::Device& device) {
  CommBackend backend = options.backend;
  if (backend == CommBackend::kAuto) {
    if (!launched_with_multiple_ranks()) {
      backend = CommBackend::kSingle;
    } else {
      backend = device.host_addressable() ? CommBackend::kMpi : CommBackend::kNccl;
    }
  }
  if (backend == CommBackend::kSingle) {
    if (launched_with_multiple_ranks()) {
      return invalid_argument(
          "dist_backend \"single\" but this process was launched with several "
          "ranks; use \"auto\" or \"mpi\"");
    }
    return make_single_rank_communicator(device);
  }
  if (backend == CommBackend::kMpi) {
#if STRATA_HAVE_MPI
    return make_mpi_communicator(options, device);
#else
    return unavailable(
        "dist_backend \"mpi\" requested, but this build has no MPI (install "
        "libopenmpi-dev and rebuild)");
#endif
  }
#if STRATA_HAVE_NCCL
  return make_nccl_communicator(options, device);
#else
  return unavailable(
      "dist_backend \"nccl\" needs a build with CUDA and NCCL; use \"mpi\" with device "
      "\"cpu\"");
#endif
}

}  // namespace strata::dist
