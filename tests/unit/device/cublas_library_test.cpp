// cuBLAS and cuBLASLt opened at run time (src/device/cuda/cublas_library.h): every function the
// backend calls is found, and the version the library reports is the one of the headers built
// against. No GPU needed: opening the libraries and asking their versions does not touch one.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include "src/device/cuda/cublas_library.h"

namespace strata::device::cuda {
namespace {

TEST(CublasLibraryTest, OpensWithEveryFunctionTheBackendCalls) {
  const Result<const CublasLibrary*> opened = cublas_library();
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  const CublasLibrary& lib = **opened;
#define STRATA_EXPECT_FOUND(name) EXPECT_NE(lib.name, nullptr) << #name;
  STRATA_CUBLASLT_FUNCTIONS(STRATA_EXPECT_FOUND)
  STRATA_CUBLAS_FUNCTIONS(STRATA_EXPECT_FOUND)
  STRATA_EXPECT_FOUND(cublasGemmEx)
#undef STRATA_EXPECT_FOUND
  EXPECT_NE(lib.lt_path.find("libcublasLt.so"), std::string::npos) << lib.lt_path;
  EXPECT_NE(lib.blas_path.find("libcublas.so"), std::string::npos) << lib.blas_path;
  // The same major version as the headers (a minor one may be newer at run time).
  EXPECT_EQ(lib.cublasLtGetVersion() / 10000, std::size_t{CUBLAS_VER_MAJOR});
  EXPECT_STREQ(lib.cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  // Opened once: a second call returns the same table.
  const Result<const CublasLibrary*> again = cublas_library();
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*again, *opened);
}

}  // namespace
}  // namespace strata::device::cuda

#endif  // STRATA_HAVE_CUDA
