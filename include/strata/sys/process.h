// Readings about this process and machine: resident memory (from /proc) and CPU topology (hwloc).
#pragma once

#include <cstdint>

#include "strata/core/status.h"

namespace strata::sys {

struct ProcessMemory {
  std::uint64_t rss_bytes = 0;       // VmRSS
  std::uint64_t peak_rss_bytes = 0;  // VmHWM: the high-water mark since start
};

Result<ProcessMemory> read_process_memory();

struct CpuTopology {
  // Physical cores and hardware threads the calling thread is bound to (mpirun --bind-to,
  // taskset): all of the machine's when it is not bound.
  int cores = 1;
  int pus = 1;
  int numa_nodes = 1;
  int machine_cores = 1;  // physical cores of the whole machine
};

CpuTopology cpu_topology();

}  // namespace strata::sys
