// STRATA_HOST_DEVICE: a function compiled for the host and, where nvcc compiles it, for the GPU
// too, so the CPU backend and the CUDA kernels run the very same operations.
#pragma once

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif
