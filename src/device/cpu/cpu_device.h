// The CPU backend: device memory is host memory under a hard byte budget, the compute stream runs
// ops on the calling thread, and the copy streams are ordered worker queues.
#pragma once

#include <memory>

#include "src/device/cpu/onednn_gemm.h"
#include "strata/device/device.h"
#include "strata/sys/cpu_features.h"

namespace strata::device {

Result<std::unique_ptr<Device>> make_cpu_device(const DeviceOptions& options);

// The CPU op table (GEMMs on the libraries `gemm` names, oneTBB-parallel elementwise ops).
// `num_threads` 0 = all cores.
std::unique_ptr<Ops> make_cpu_ops(int num_threads, sys::SimdPath simd, cpu::CpuGemmChoice gemm);

namespace cpu {
// `inner` with every op timed into strata/device/op_profile.h's tally (profiled_ops.cpp).
std::unique_ptr<Ops> profiled_ops(std::unique_ptr<Ops> inner);
}  // namespace cpu

}  // namespace strata::device
