// Error reporting for the CUDA backend: every CUDA and cuBLAS call's status becomes a Status
// that names the call and where it was made.
#include "src/device/cuda/cuda_check.h"

#include <string>

#include "src/device/cuda/cublas_library.h"

namespace strata::device::cuda {

namespace {

std::string where(const char* call, const char* file, int line) {
  return std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": ";
}

}  // namespace

Status cuda_status(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return Status::ok();
  std::string msg =
      where(call, file, line) + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  if (err == cudaErrorMemoryAllocation) return out_of_memory(std::move(msg));
  return internal_error(std::move(msg));
}

Status cublas_status(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::ok();
  // A status came from the library, so it is open.
  const Result<const CublasLibrary*> lib = cublas_library();
  std::string msg = where(call, file, line) +
                    (lib.is_ok() ? std::string((*lib)->cublasGetStatusName(status)) + ": " +
                                       (*lib)->cublasGetStatusString(status)
                                 : "cuBLAS status " + std::to_string(static_cast<int>(status)));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return out_of_memory(std::move(msg));
  return internal_error(std::move(msg));
}

bool ErrorState::record(const Status& status) {
  if (status.is_ok()) return true;
  std::lock_guard lock(mu_);
  if (first_.is_ok()) first_ = status;
  return false;
}

Status ErrorState::first() const {
  std::lock_guard lock(mu_);
  return first_;
}

}  // namespace strata::device::cuda
