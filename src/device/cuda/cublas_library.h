// cuBLAS and cuBLASLt, opened (dlopen) when the CUDA backend first needs them (a CUDA device's
// creation, `strata info`) instead of linked. Linked, their initializers ran in every process of
// a CUDA build before main, GPU or not: 0.45 of the 0.63 s that `strata --help` took, as much in
// each test process, and their memory (a 225.6 MiB peak for `strata --help`, 14.9 MiB without).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

#include "strata/core/status.h"

namespace strata::device::cuda {

// The functions the backend calls, by the names the libraries export. cublas_v2.h maps the
// public names onto the exported _v2 ones (cublasCreate is cublasCreate_v2), so a call written
// `lib.cublasCreate(...)` reaches the member of the exported name.
// clang-format off
#define STRATA_CUBLASLT_FUNCTIONS(X) \
  X(cublasLtCreate) \
  X(cublasLtDestroy) \
  X(cublasLtGetVersion) \
  X(cublasLtMatmul) \
  X(cublasLtMatmulAlgoGetHeuristic) \
  X(cublasLtMatmulDescCreate) \
  X(cublasLtMatmulDescDestroy) \
  X(cublasLtMatmulDescSetAttribute) \
  X(cublasLtMatmulPreferenceCreate) \
  X(cublasLtMatmulPreferenceDestroy) \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatrixLayoutCreate) \
  X(cublasLtMatrixLayoutDestroy)
#define STRATA_CUBLAS_FUNCTIONS(X) \
  X(cublasCreate_v2) \
  X(cublasDestroy_v2) \
  X(cublasSetStream_v2) \
  X(cublasSetWorkspace_v2) \
  X(cublasGetStatusName) \
  X(cublasGetStatusString)
// clang-format on

struct CublasLibrary {
#define STRATA_CUBLAS_MEMBER(name) decltype(&::name) name = nullptr;
  STRATA_CUBLASLT_FUNCTIONS(STRATA_CUBLAS_MEMBER)
  STRATA_CUBLAS_FUNCTIONS(STRATA_CUBLAS_MEMBER)
#undef STRATA_CUBLAS_MEMBER
  // cublas_api.h overloads cublasGemmEx in C++ (an inline one takes the compute type as a
  // cudaDataType), so its exported signature is spelled out.
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, const void*,
                                    cudaDataType, int, const void*, void*, cudaDataType, int,
                                    cublasComputeType_t, cublasGemmAlgo_t);
  GemmEx cublasGemmEx = nullptr;

  std::string lt_path, blas_path;  // the files opened
};

// The libraries, opened on the first call (from any thread; later calls return the same):
// each from the path the build found it at, else by its soname through the loader's search
// path. The error names each file tried, or the function a library lacks.
Result<const CublasLibrary*> cublas_library();

}  // namespace strata::device::cuda
