// /proc/self/status and hwloc readings.
#include "strata/sys/process.h"

#include <hwloc.h>

#include <fstream>
#include <sstream>
#include <string>

namespace strata::sys {

Result<ProcessMemory> read_process_memory() {
  std::ifstream in("/proc/self/status");
  if (!in) return unavailable("cannot read /proc/self/status");
  ProcessMemory m;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string key;
    std::uint64_t kib = 0;
    ss >> key >> kib;
    if (key == "VmRSS:") m.rss_bytes = kib * 1024;
    if (key == "VmHWM:") m.peak_rss_bytes = kib * 1024;
  }
  return m;
}

CpuTopology cpu_topology() {
  CpuTopology t;
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return t;
  if (hwloc_topology_load(topo) == 0) {
    const int cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    const int pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
    const int numa = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    if (cores > 0) t.machine_cores = t.cores = cores;
    if (pus > 0) t.pus = pus;
    if (numa > 0) t.numa_nodes = numa;
    // Under mpirun (--bind-to core, its default for two ranks or fewer) or taskset, the process
    // may run on fewer cores than the machine has: count those the calling thread is bound to,
    // which is what the threads it starts inherit.
    hwloc_bitmap_t bound = hwloc_bitmap_alloc();
    if (bound != nullptr && hwloc_get_cpubind(topo, bound, HWLOC_CPUBIND_THREAD) == 0 &&
        !hwloc_bitmap_iszero(bound)) {
      const int bound_cores = hwloc_get_nbobjs_inside_cpuset_by_type(topo, bound, HWLOC_OBJ_CORE);
      const int bound_pus = hwloc_get_nbobjs_inside_cpuset_by_type(topo, bound, HWLOC_OBJ_PU);
      if (bound_cores > 0) t.cores = bound_cores;
      if (bound_pus > 0) t.pus = bound_pus;
    }
    hwloc_bitmap_free(bound);
  }
  hwloc_topology_destroy(topo);
  return t;
}

}  // namespace strata::sys
