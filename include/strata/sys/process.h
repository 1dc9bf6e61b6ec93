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
  int cores = 1;  // physical cores
  int pus = 1;    // hardware threads
  int numa_nodes = 1;
};

CpuTopology cpu_topology();

}  // namespace strata::sys
