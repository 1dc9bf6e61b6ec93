// Row-major GEMMs on cuBLASLt (bf16 or fp32 storage, fp32 accumulation), with a small cache of
// matmul descriptors and heuristic picks keyed by shape. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "src/device/cuda/cublas_library.h"
#include "strata/core/status.h"
#include "strata/device/ops.h"

namespace strata::device::cuda {

class CudaGemm {
 public:
  // workspace: device memory the caller owns (from the device arena) for cuBLAS's use; both
  // cuBLASLt and the cuBLAS fallback use it, only on the stream passed to run().
  static Result<std::unique_ptr<CudaGemm>> create(void* workspace, std::size_t workspace_bytes,
                                                  bool allow_tf32);
  ~CudaGemm();
  CudaGemm(const CudaGemm&) = delete;
  CudaGemm& operator=(const CudaGemm&) = delete;

  // Enqueues C = alpha op(A) op(B) + beta C on `stream` (k > 0, m > 0, n > 0).
  Status run(const GemmArgs& g, cudaStream_t stream);

 private:
  // Shape, layout, pointer alignment class (cuBLASLt's heuristic depends on it) and whether C
  // is read.
  using Key = std::tuple<int, bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, std::int64_t, bool, int, int, int>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool use_lt = false;  // false: no cuBLASLt algorithm fits; use cublasGemmEx
  };
  static constexpr std::size_t kMaxPlans = 256;

  CudaGemm(const CublasLibrary& lib, void* workspace, std::size_t workspace_bytes, bool allow_tf32)
      : lib_(lib),
        workspace_(workspace),
        workspace_bytes_(workspace_bytes),
        allow_tf32_(allow_tf32) {}
  Result<Plan> make_plan(const GemmArgs& g, int align_a, int align_b, int align_c);
  Status run_fallback(const GemmArgs& g, cudaStream_t stream);
  void destroy(Plan& p) const;

  const CublasLibrary& lib_;  // opened with the device
  void* workspace_;
  std::size_t workspace_bytes_;
  bool allow_tf32_;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cudaStream_t blas_stream_ = nullptr;  // the stream blas_ is set to (its workspace with it)
  std::map<Key, Plan> plans_;
};

}  // namespace strata::device::cuda
