// The CPU backend's elementwise kernels for any x86-64 (SSE2): the path every CPU can run.
#define STRATA_CPU_KERNELS_FILL fill_scalar_cpu_kernels
#define STRATA_CPU_KERNELS_NAME "scalar"
#include "src/device/cpu/cpu_kernels_impl.inc"
