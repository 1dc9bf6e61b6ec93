// The environment variables Strata reads: the knobs, and the launcher's rank variables.
#include "strata/sys/environment.h"

#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace strata::sys {
namespace {

constexpr std::array<KnobInfo, 6> kKnobs = {{
    {Knob::kSimd, "STRATA_SIMD",
     "SIMD path of the CPU kernels and the CPU Adam: auto (default), scalar, avx2, avx512"},
    {Knob::kCpuGemm, "STRATA_CPU_GEMM",
     "CPU backend GEMM library: auto (default), onednn, openblas"},
    {Knob::kOpProfile, "STRATA_OP_PROFILE", "1: time every device op (benchmarks)"},
    {Knob::kStrictHostMemory, "STRATA_STRICT_HOST_MEMORY",
     "1: a CPU-backend device copy from or to unpinned host memory is fatal (tests)"},
    {Knob::kCudaSync, "STRATA_CUDA_SYNC",
     "1: synchronize after every CUDA op, so an error names the op that caused it"},
    {Knob::kAttention, "STRATA_ATTENTION",
     "CUDA attention kernel over the config's attention: auto, flash2, simple"},
}};

const char* process_getenv(const char* name) {
  return std::getenv(name);  // NOLINT(concurrency-mt-unsafe): nothing writes it while threads run
}

}  // namespace

std::span<const KnobInfo> knobs() { return kKnobs; }

const char* knob_name(Knob knob) {
  for (const KnobInfo& k : kKnobs) {
    if (k.knob == knob) return k.name;
  }
  return "?";
}

std::string knob(Knob k, Getenv getenv) {
  if (getenv == nullptr) getenv = process_getenv;
  const char* v = getenv(knob_name(k));
  return v != nullptr ? std::string(v) : std::string();
}

bool knob_on(Knob k, Getenv getenv) { return knob(k, getenv) == "1"; }

Result<Launch> read_launch(Getenv getenv) {
  if (getenv == nullptr) getenv = process_getenv;
  const auto parse = [](const char* name, const char* text, int min) -> Result<int> {
    int v = 0;
    const char* end = text + std::strlen(text);
    const auto [ptr, ec] = std::from_chars(text, end, v);
    if (ec != std::errc() || ptr != end || text == end || v < min) {
      return invalid_argument("environment variable " + std::string(name) + "=\"" + text +
                              "\" is not an integer >= " + std::to_string(min));
    }
    return v;
  };
  // {rank, size} pairs, most trusted first; a launcher sets both of one pair.
  const auto read_pair = [&](const std::array<std::pair<const char*, const char*>, 4>& vars,
                             int* rank, int* size, std::string* source) -> Status {
    for (const auto& [rank_var, size_var] : vars) {
      const char* r = getenv(rank_var);
      if (r == nullptr) continue;
      STRATA_ASSIGN_OR_RETURN(*rank, parse(rank_var, r, 0));
      *size = 0;
      if (const char* n = size_var != nullptr ? getenv(size_var) : nullptr) {
        STRATA_ASSIGN_OR_RETURN(*size, parse(size_var, n, 1));
        if (*rank >= *size) {
          return invalid_argument(std::string(rank_var) + "=" + r + " is not below " + size_var +
                                  "=" + n);
        }
      }
      if (source != nullptr) *source = rank_var;
      return Status::ok();
    }
    return Status::ok();
  };
  Launch l;
  static constexpr std::array<std::pair<const char*, const char*>, 4> kWorld = {{
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
      {"PMI_RANK", "PMI_SIZE"},
      {"PMIX_RANK", "PMIX_SIZE"},
      {"SLURM_PROCID", "SLURM_NTASKS"},
  }};
  STRATA_RETURN_IF_ERROR(read_pair(kWorld, &l.rank, &l.world_size, nullptr));
  if (l.world_size == 0) l.world_size = 1;  // a rank without a size: a launcher of one
  static constexpr std::array<std::pair<const char*, const char*>, 4> kLocal = {{
      {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"SLURM_LOCALID", nullptr},
  }};
  STRATA_RETURN_IF_ERROR(read_pair(kLocal, &l.local_rank, &l.local_size, &l.source));
  return l;
}

}  // namespace strata::sys
