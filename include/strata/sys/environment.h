// Every environment variable Strata reads, in one place: the knobs (STRATA_*, listed in
// knobs() and in README) and what the launcher (mpirun, srun, torchrun) says of this process.
// Each read goes to the environment as it is at the call: nothing in Strata writes it while
// threads run. `getenv` is injectable for tests (nullptr: the process's).
#pragma once

#include <span>
#include <string>

#include "strata/core/status.h"

namespace strata::sys {

using Getenv = const char* (*)(const char*);

enum class Knob {
  kSimd,              // STRATA_SIMD: the CPU's SIMD path (auto, scalar, avx2, avx512)
  kCpuGemm,           // STRATA_CPU_GEMM: the CPU backend's GEMM library (auto, onednn, openblas)
  kOpProfile,         // STRATA_OP_PROFILE=1: time every device op
  kStrictHostMemory,  // STRATA_STRICT_HOST_MEMORY=1: a device copy from unpinned memory is fatal
  kCudaSync,          // STRATA_CUDA_SYNC=1: synchronize after every CUDA op
  kAttention,         // STRATA_ATTENTION: the CUDA attention kernel, over the config's
};

struct KnobInfo {
  Knob knob;
  const char* name;  // "STRATA_SIMD"
  const char* what;  // one line for README and --help
};
std::span<const KnobInfo> knobs();
const char* knob_name(Knob knob);

// The knob's value; empty when it is unset or empty.
std::string knob(Knob knob, Getenv getenv = nullptr);
// The knob is "1".
bool knob_on(Knob knob, Getenv getenv = nullptr);

// What the launcher set for this process. Without a launcher: one rank of one.
struct Launch {
  int world_size = 1;
  int rank = 0;
  int local_rank = 0;  // the rank on this node
  int local_size = 1;  // ranks on this node; 0 when the launcher does not say (Slurm)
  std::string source;  // the variable the local rank came from; empty when none was set
  bool multiple_ranks() const { return world_size > 1; }
};
// Open MPI's OMPI_COMM_WORLD_*, MPICH/PMI's PMI_*, PMIx's PMIX_*, Slurm's SLURM_PROCID/NTASKS; and
// for the node, OMPI_COMM_WORLD_LOCAL_*, MPICH's MPI_LOCALRANKID/NRANKS, torchrun's LOCAL_RANK/
// LOCAL_WORLD_SIZE, Slurm's SLURM_LOCALID (each in that order of trust). A variable that is not
// an integer in range is invalid_argument naming it.
Result<Launch> read_launch(Getenv getenv = nullptr);

}  // namespace strata::sys
