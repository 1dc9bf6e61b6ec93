// `strata info`: what this build and machine offer.
#include <cstdio>
#include <fstream>
#include <string>

#include "strata/build_config.h"
#include "strata/device/device.h"
#include "strata/sys/cpu_features.h"
#include "strata/sys/process.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

// The CPU backend's compute: its SIMD path, what the CPU has beyond it, and its GEMM library.
std::string cpu_compute() {
  device::DeviceOptions o;
  o.kind = device::DeviceKind::kCpu;
  o.memory_limit_bytes = std::uint64_t{1} << 20;
  auto d = device::create_device(o);
  const std::string name = d.is_ok() ? (*d)->name() : "cpu (" + d.status().message() + ")";
  std::string gemm = "OpenBLAS";
  if (name.find("+onednn-bf16") != std::string::npos) {
    gemm = "oneDNN for bf16, OpenBLAS for fp32";
  } else if (name.find("+onednn-f32") != std::string::npos) {
    gemm = "oneDNN for fp32, OpenBLAS for bf16";
  } else if (name.find("+onednn") != std::string::npos) {
    gemm = "oneDNN";
  }
  return name + " (SIMD path " + std::string(sys::simd_path_name(sys::widest_simd_path())) +
         ", native bf16 conversion: " + (sys::cpu_supports_avx512_bf16() ? "yes" : "no") +
         ", AMX bf16: " + (sys::cpu_supports_amx_bf16() ? "yes" : "no") + "; GEMMs: " + gemm +
         "; STRATA_SIMD and STRATA_CPU_GEMM choose otherwise)";
}

// Transparent huge pages as the kernel offers them ("always [madvise] never": the mode in
// brackets); Strata's pinned buffers ask for them with madvise.
std::string huge_pages() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  if (!std::getline(f, modes)) return "unknown (no /sys/kernel/mm/transparent_hugepage)";
  const auto open = modes.find('['), close = modes.find(']');
  const std::string mode = open != std::string::npos && close != std::string::npos
                               ? modes.substr(open + 1, close - open - 1)
                               : modes;
  if (mode == "never") {
    return "transparent huge pages off (\"never\"): pinned buffers and swap I/O use 4 KiB pages";
  }
  return "transparent huge pages \"" + mode + "\": Strata's pinned buffers get 2 MiB pages";
}

}  // namespace

Runner add_info_command(CLI::App& app) {
  app.add_subcommand("info", "Show the backends this build and machine offer");
  return [] {
    const sys::CpuTopology t = sys::cpu_topology();
    std::printf(
        "strata %s\nbackends: %s\nio_uring: %s, MPI: %s\nCPU: %d cores, %d threads, %d NUMA "
        "nodes%s\ncpu backend: %s\nhuge pages: %s\n",
        STRATA_VERSION, device::describe_backends().c_str(),
        STRATA_HAVE_URING ? "built" : "not built", STRATA_HAVE_MPI ? "built" : "not built", t.cores,
        t.pus, t.numa_nodes,
        t.cores < t.machine_cores
            ? (" (bound to " + std::to_string(t.cores) + " of the machine's " +
               std::to_string(t.machine_cores) + " cores)")
                  .c_str()
            : "",
        cpu_compute().c_str(), huge_pages().c_str());
    return kExitOk;
  };
}

}  // namespace strata::cli
