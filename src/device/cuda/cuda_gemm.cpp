// cuBLASLt GEMMs with row-major semantics. cuBLAS is column-major, and a row-major matrix is
// the column-major view of its transpose, so C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T: operands swapped, each keeping its own transpose flag.
#include "src/device/cuda/cuda_gemm.h"

#include <bit>

#include "src/device/cuda/cublas_library.h"
#include "src/device/cuda/cuda_check.h"

namespace strata::device::cuda {
namespace {

cudaDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:  // fp16 tensor cores, fp32 accumulation (CUBLAS_COMPUTE_32F)
      return CUDA_R_16F;
    case DType::kF32:
      return CUDA_R_32F;
    default:
      break;
  }
  STRATA_CHECK(false, "CUDA gemm supports f32, bf16 and f16, got", dtype_name(dtype));
  return CUDA_R_32F;
}

// Largest power of two (up to 256) dividing the address: cuBLASLt assumes 256 unless told.
int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (a == 0) return 256;
  return static_cast<int>(std::min<std::uintptr_t>(std::uintptr_t{1} << std::countr_zero(a), 256));
}

}  // namespace

Result<std::unique_ptr<CudaGemm>> CudaGemm::create(void* workspace, std::size_t workspace_bytes,
                                                   bool allow_tf32) {
  STRATA_ASSIGN_OR_RETURN(const CublasLibrary* lib, cublas_library());
  std::unique_ptr<CudaGemm> g(new CudaGemm(*lib, workspace, workspace_bytes, allow_tf32));
  STRATA_CUBLAS_RETURN_IF_ERROR(lib->cublasLtCreate(&g->lt_));
  STRATA_CUBLAS_RETURN_IF_ERROR(lib->cublasCreate(&g->blas_));
  // The fallback must not allocate its own workspace outside the device budget.
  STRATA_CUBLAS_RETURN_IF_ERROR(lib->cublasSetWorkspace(g->blas_, workspace, workspace_bytes));
  return g;
}

CudaGemm::~CudaGemm() {
  for (auto& [key, plan] : plans_) destroy(plan);
  if (blas_ != nullptr) lib_.cublasDestroy(blas_);
  if (lt_ != nullptr) lib_.cublasLtDestroy(lt_);
}

void CudaGemm::destroy(Plan& p) const {
  if (p.a != nullptr) lib_.cublasLtMatrixLayoutDestroy(p.a);
  if (p.b != nullptr) lib_.cublasLtMatrixLayoutDestroy(p.b);
  if (p.c != nullptr) lib_.cublasLtMatrixLayoutDestroy(p.c);
  if (p.desc != nullptr) lib_.cublasLtMatmulDescDestroy(p.desc);
  p = Plan{};
}

Result<CudaGemm::Plan> CudaGemm::make_plan(const GemmArgs& g, int align_a, int align_b,
                                           int align_c) {
  const cudaDataType_t dt = data_type(g.dtype);
  const cublasComputeType_t compute =
      g.dtype == DType::kF32 && allow_tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  Plan p;
  Status s = [&]() -> Status {
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulDescCreate(&p.desc, compute, CUDA_R_32F));
    // cuBLAS's first operand is our B, its second our A.
    const cublasOperation_t op_first = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
    // Column-major views of the stored row-major matrices: rows = stored columns.
    const auto u = [](std::int64_t x) { return static_cast<std::uint64_t>(x); };
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatrixLayoutCreate(
        &p.a, dt, u(g.trans_b ? g.k : g.n), u(g.trans_b ? g.n : g.k), g.ldb));
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatrixLayoutCreate(
        &p.b, dt, u(g.trans_a ? g.m : g.k), u(g.trans_a ? g.k : g.m), g.lda));
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatrixLayoutCreate(&p.c, dt, u(g.n), u(g.m), g.ldc));

    cublasLtMatmulPreference_t pref = nullptr;
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulPreferenceCreate(&pref));
    const std::uint64_t ws = workspace_bytes_;
    const auto a_first = static_cast<std::uint32_t>(align_b);  // cuBLAS's A is our B
    const auto a_second = static_cast<std::uint32_t>(align_a);
    const auto a_c = static_cast<std::uint32_t>(align_c);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    Status hs = [&]() -> Status {
      STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a_first, sizeof(a_first)));
      STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &a_second, sizeof(a_second)));
      STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &a_c, sizeof(a_c)));
      STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &a_c, sizeof(a_c)));
      // "Not supported" here only means no cuBLASLt kernel fits this layout: use the fallback.
      const cublasStatus_t st = lib_.cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.c, p.c,
                                                                    pref, 1, &result, &found);
      if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) {
        return STRATA_CUBLAS_STATUS(st);
      }
      return Status::ok();
    }();
    lib_.cublasLtMatmulPreferenceDestroy(pref);
    STRATA_RETURN_IF_ERROR(hs);
    p.use_lt = found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (p.use_lt) p.algo = result.algo;
    return Status::ok();
  }();
  if (!s.is_ok()) {
    destroy(p);
    return s;
  }
  return p;
}

Status CudaGemm::run_fallback(const GemmArgs& g, cudaStream_t stream) {
  const cudaDataType_t dt = data_type(g.dtype);
  const cublasComputeType_t compute =
      g.dtype == DType::kF32 && allow_tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const auto i = [](std::int64_t x) { return static_cast<int>(x); };
  if (stream != blas_stream_) {
    // cublasSetStream resets the handle's workspace to cuBLAS's own pool (allocated outside the
    // device budget), so the budgeted workspace is set again after it.
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasSetStream(blas_, stream));
    STRATA_CUBLAS_RETURN_IF_ERROR(lib_.cublasSetWorkspace(blas_, workspace_, workspace_bytes_));
    blas_stream_ = stream;
  }
  return STRATA_CUBLAS_STATUS(lib_.cublasGemmEx(
      blas_, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, i(g.n),
      i(g.m), i(g.k), &g.alpha, g.b, dt, i(g.ldb), g.a, dt, i(g.lda), &g.beta, g.c, dt, i(g.ldc),
      compute, CUBLAS_GEMM_DEFAULT));
}

Status CudaGemm::run(const GemmArgs& g, cudaStream_t stream) {
  const int align_a = alignment_of(g.a), align_b = alignment_of(g.b), align_c = alignment_of(g.c);
  const Key key{static_cast<int>(g.dtype),
                g.trans_a,
                g.trans_b,
                g.m,
                g.n,
                g.k,
                g.lda,
                g.ldb,
                g.ldc,
                g.beta == 0.0f,
                align_a,
                align_b,
                align_c};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    if (plans_.size() >= kMaxPlans) {  // a model uses a few dozen shapes; this is a safety net
      for (auto& [k, plan] : plans_) destroy(plan);
      plans_.clear();
    }
    STRATA_ASSIGN_OR_RETURN(Plan p, make_plan(g, align_a, align_b, align_c));
    it = plans_.emplace(key, p).first;
  }
  const Plan& p = it->second;
  if (!p.use_lt) return run_fallback(g, stream);
  return STRATA_CUBLAS_STATUS(lib_.cublasLtMatmul(lt_, p.desc, &g.alpha, g.b, p.a, g.a, p.b,
                                                  &g.beta, g.c, p.c, g.c, p.c, &p.algo, workspace_,
                                                  workspace_bytes_, stream));
}

}  // namespace strata::device::cuda
