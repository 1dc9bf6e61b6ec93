// Communicator factory: picks MPI when launched by mpirun, else the single-rank communicator.
#include "strata/dist/communicator.h"

#include "src/dist/mpi_communicator.h"
#include "src/dist/nccl_communicator.h"
#include "strata/build_config.h"
#include "strata/core/check.h"
#include "strata/device/device.h"
#include "strata/sys/environment.h"

namespace strata::dist {

CommHandle CommHandle::done(Status status) {
  struct Done final : State {
    Status s;
    Status wait() override { return s; }
  };
  if (status.is_ok()) return {};
  auto d = std::make_shared<Done>();
  d->s = std::move(status);
  return CommHandle(d);
}

// The peer of a point-to-point call: another rank of the communicator.
CommHandle Communicator::reduce_scatter_wide(const void*, float*, std::int64_t, DType,
                                             std::string_view what) {
  return CommHandle::done(failed_precondition(
      "reduce_scatter_wide '" + std::string(what) + "': the " + name() +
      " communicator cannot sum 16-bit gradients into f32 (deterministic_reduction's bf16 and "
      "fp16 path needs MPI on the CPU backend)"));
}

Status check_peer(const Communicator& comm, const char* op, int peer, std::string_view what) {
  if (peer >= 0 && peer < comm.world_size() && peer != comm.rank()) return Status::ok();
  return invalid_argument("rank " + std::to_string(comm.rank()) + ": " + op + " '" +
                          std::string(what) + "' with rank " + std::to_string(peer) +
                          ": expected another rank of the " + std::to_string(comm.world_size()));
}

Status check_all_to_all(const Communicator& comm, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> recv_counts, std::string_view what) {
  const auto world = static_cast<std::size_t>(comm.world_size());
  const std::string call =
      "rank " + std::to_string(comm.rank()) + ": all_to_all_v '" + std::string(what) + "'";
  for (const auto& [counts, name] :
       {std::pair{send_counts, "send_counts"}, std::pair{recv_counts, "recv_counts"}}) {
    if (counts.size() != world) {
      return invalid_argument(call + ": " + name + " holds " + std::to_string(counts.size()) +
                              " counts; expected one for each of the " + std::to_string(world) +
                              " ranks");
    }
    for (std::size_t r = 0; r < world; ++r) {
      if (counts[r] < 0) {
        return invalid_argument(call + ": " + name + "[" + std::to_string(r) + "] is " +
                                std::to_string(counts[r]) + "; expected 0 or more");
      }
    }
  }
  return Status::ok();
}

Result<std::unique_ptr<Communicator>> create_communicator(const CommOptions& options,
                                                          device::Device& device) {
  STRATA_ASSIGN_OR_RETURN(const sys::Launch launch, sys::read_launch());
  detail::set_check_rank(launch.rank);  // a failed STRATA_CHECK names this process's rank
  CommBackend backend = options.backend;
  if (backend == CommBackend::kAuto) {
    if (!launch.multiple_ranks()) {
      backend = CommBackend::kSingle;
    } else {
      backend = device.host_addressable() ? CommBackend::kMpi : CommBackend::kNccl;
    }
  }
  if (backend == CommBackend::kSingle) {
    if (launch.multiple_ranks()) {
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
