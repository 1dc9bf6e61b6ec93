// `strata info`: what this build and machine offer.
#include <cstdio>
#include <string>

#include "strata/build_config.h"
#include "strata/device/device.h"
#include "strata/sys/process.h"
#include "tools/cli/commands.h"

namespace strata::cli {

Runner add_info_command(CLI::App& app) {
  app.add_subcommand("info", "Show the backends this build and machine offer");
  return [] {
    const sys::CpuTopology t = sys::cpu_topology();
    std::printf(
        "strata %s\nbackends: %s\nio_uring: %s, MPI: %s\nCPU: %d cores, %d threads, %d NUMA "
        "nodes%s\n",
        STRATA_VERSION, device::describe_backends().c_str(),
        STRATA_HAVE_URING ? "built" : "not built", STRATA_HAVE_MPI ? "built" : "not built", t.cores,
        t.pus, t.numa_nodes,
        t.cores < t.machine_cores
            ? (" (bound to " + std::to_string(t.cores) + " of the machine's " +
               std::to_string(t.machine_cores) + " cores)")
                  .c_str()
            : "");
    return kExitOk;
  };
}

}  // namespace strata::cli
