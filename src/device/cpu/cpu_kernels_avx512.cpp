// The CPU backend's elementwise kernels for AVX-512 F/BW/VL; flags in src/CMakeLists.txt, entered
// only after CPUID says so (cpu_kernels.cpp).
#define STRATA_CPU_KERNELS_FILL fill_avx512_cpu_kernels
#define STRATA_CPU_KERNELS_NAME "avx512"
#include "src/device/cpu/cpu_kernels_impl.inc"
