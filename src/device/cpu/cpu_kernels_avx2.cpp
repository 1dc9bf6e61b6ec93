// The CPU backend's elementwise kernels for AVX2; flags in src/CMakeLists.txt, entered only
// after CPUID says so (cpu_kernels.cpp).
#define STRATA_CPU_KERNELS_FILL fill_avx2_cpu_kernels
#define STRATA_CPU_KERNELS_NAME "avx2"
#include "src/device/cpu/cpu_kernels_impl.inc"
