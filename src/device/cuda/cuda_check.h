// CUDA and cuBLAS status checks that name the failing call, file and line, and the sticky error
// a CUDA device keeps for failures in asynchronous work. CUDA builds only.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "strata/core/status.h"

namespace strata::device::cuda {

// ok for cudaSuccess; otherwise internal (out_of_memory for allocation failures) with
// "<call> failed at <file>:<line>: cudaErrorX: <text>".
Status cuda_status(cudaError_t err, const char* call, const char* file, int line);
Status cublas_status(cublasStatus_t status, const char* call, const char* file, int line);

// The first error seen on a device; later ones are dropped (they are usually consequences).
class ErrorState {
 public:
  // Records a failed status; returns status.is_ok().
  bool record(const Status& status);
  Status first() const;

 private:
  mutable std::mutex mu_;
  Status first_;
};

}  // namespace strata::device::cuda

#define STRATA_CUDA_STATUS(call) \
  ::strata::device::cuda::cuda_status((call), #call, __FILE__, __LINE__)
#define STRATA_CUBLAS_STATUS(call) \
  ::strata::device::cuda::cublas_status((call), #call, __FILE__, __LINE__)
#define STRATA_CUDA_RETURN_IF_ERROR(call) STRATA_RETURN_IF_ERROR(STRATA_CUDA_STATUS(call))
#define STRATA_CUBLAS_RETURN_IF_ERROR(call) STRATA_RETURN_IF_ERROR(STRATA_CUBLAS_STATUS(call))
