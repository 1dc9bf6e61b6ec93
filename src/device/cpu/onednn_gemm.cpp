// GEMMs through oneDNN's matmul primitive (onednn_gemm.h).
#include "src/device/cpu/onednn_gemm.h"

#include <cblas.h>

#include <cctype>
#include <cstdlib>
#include <string>

#include "strata/build_config.h"
#include "strata/core/check.h"
#include "strata/sys/cpu_features.h"
#include "strata/sys/environment.h"

#if STRATA_HAVE_ONEDNN
#include <omp.h>

#include <bit>
#include <compare>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace strata::device::cpu {

std::string CpuGemmChoice::name_suffix() const {
  if (f32 == GemmLibrary::kOneDnn && bf16 == GemmLibrary::kOneDnn) return "+onednn";
  if (bf16 == GemmLibrary::kOneDnn) return "+onednn-bf16";
  if (f32 == GemmLibrary::kOneDnn) return "+onednn-f32";
  return "";
}

namespace {

// OpenBLAS's kernels with AVX-512 (openblas_get_corename), for the fp32 rule.
bool openblas_kernel_has_avx512() {
  std::string core = openblas_get_corename();
  for (char& ch : core) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return core == "skylakex" || core == "cooperlake" || core == "sapphirerapids";
}

}  // namespace

Result<CpuGemmChoice> resolve_cpu_gemm() {
  // Read at each device's creation.
  const std::string env = sys::knob(sys::Knob::kCpuGemm);
  const std::string choice = env.empty() ? "auto" : env;
  const bool bf16_units = sys::cpu_supports_avx512_bf16() || sys::cpu_supports_amx_bf16();
  constexpr auto kOneDnn = GemmLibrary::kOneDnn;
  CpuGemmChoice c;
  if (choice == "openblas") return c;
  if (choice == "auto") {
    if (STRATA_HAVE_ONEDNN && bf16_units) c.bf16 = kOneDnn;
    if (STRATA_HAVE_ONEDNN && sys::cpu_supports(sys::SimdPath::kAvx512) &&
        !openblas_kernel_has_avx512()) {
      c.f32 = kOneDnn;
    }
    return c;
  }
  if (choice != "onednn") {
    return invalid_argument("STRATA_CPU_GEMM '" + choice +
                            "' is not a GEMM library; use auto, onednn or openblas");
  }
  if (!STRATA_HAVE_ONEDNN) {
    return invalid_argument(
        "STRATA_CPU_GEMM=onednn, but this build has no oneDNN (install libdnnl-dev and rebuild)");
  }
  if (!bf16_units) {
    return invalid_argument(
        "STRATA_CPU_GEMM=onednn, but this CPU has neither avx512_bf16 nor AMX-BF16 for bf16 "
        "products; use auto or openblas");
  }
  c.f32 = kOneDnn;
  c.bf16 = kOneDnn;
  return c;
}

#if STRATA_HAVE_ONEDNN

struct OneDnnGemm::Impl {
  // What a primitive is made for; alpha and beta by their bits (a primitive bakes them in).
  struct Problem {
    DType dtype;
    bool trans_a, trans_b;
    std::int64_t m, n, k, lda, ldb, ldc;
    std::uint32_t alpha_bits, beta_bits;
    auto operator<=>(const Problem&) const = default;
  };

  // The library's primitives are cached by problem; a run that sees more distinct problems than
  // this (a model with many shapes, or variable sequence lengths) starts the cache afresh.
  static constexpr std::size_t kMaxCached = 512;

  struct Entry {
    dnnl::memory::desc a, b, c, scratch;
    dnnl::matmul matmul;
  };

  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mu;
  std::map<Problem, std::optional<Entry>> cache;  // nullopt: only a reference implementation

  // A primitive for `p`, or nullopt where oneDNN would run its reference loops.
  std::optional<Entry> make(const Problem& p) const {
    using dnnl::memory;
    const auto type = p.dtype == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
    // Row-major storage; a transposed operand is the same matrix read with swapped strides.
    const memory::desc a({p.m, p.k}, type,
                         p.trans_a ? memory::dims{1, p.lda} : memory::dims{p.lda, 1});
    const memory::desc b({p.k, p.n}, type,
                         p.trans_b ? memory::dims{1, p.ldb} : memory::dims{p.ldb, 1});
    const memory::desc c({p.m, p.n}, type, memory::dims{p.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const auto alpha = std::bit_cast<float>(p.alpha_bits);
    const auto beta = std::bit_cast<float>(p.beta_bits);
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops post;
      post.append_sum(beta);  // C = alpha * A * B + beta * C, the sum taken in fp32
      attr.set_post_ops(post);
    }
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, engine);
      if (std::string(pd.impl_info_str()).find("ref") != std::string::npos) return std::nullopt;
      return Entry{a, b, c, pd.scratchpad_desc(), dnnl::matmul(pd)};
    } catch (const dnnl::error& e) {
      if (e.status == dnnl_unimplemented) return std::nullopt;
      STRATA_CHECK(false, "oneDNN could not make a", dtype_name(p.dtype),
                   "matmul for m, n, k =", p.m, p.n, p.k, e.what());
      return std::nullopt;  // unreachable
    }
  }

  std::optional<Entry> find(const GemmArgs& g) {
    STRATA_CHECK(
        (g.dtype == DType::kBF16 || g.dtype == DType::kF32) && g.m > 0 && g.n > 0 && g.k > 0,
        "oneDNN GEMM takes f32 or bf16 products of positive sizes, got", dtype_name(g.dtype), g.m,
        g.n, g.k);
    const Problem p{g.dtype,
                    g.trans_a,
                    g.trans_b,
                    g.m,
                    g.n,
                    g.k,
                    g.lda,
                    g.ldb,
                    g.ldc,
                    std::bit_cast<std::uint32_t>(g.alpha),
                    std::bit_cast<std::uint32_t>(g.beta)};
    // One thread: OpenMP's thread count is a per-thread setting, so set it on whichever thread
    // calls, before the primitive is made (it plans its split for that many) and before it runs.
    omp_set_num_threads(1);
    std::lock_guard lock(mu);
    auto it = cache.find(p);
    if (it == cache.end()) {
      if (cache.size() >= kMaxCached) cache.clear();
      it = cache.emplace(p, make(p)).first;
    }
    return it->second;  // handles: the primitive itself is shared, not copied
  }
};

OneDnnGemm::OneDnnGemm() : impl_(std::make_unique<Impl>()) {}

OneDnnGemm::~OneDnnGemm() = default;

std::optional<std::size_t> OneDnnGemm::prepare(const GemmArgs& g) const {
  const std::optional<Impl::Entry> entry = impl_->find(g);
  if (!entry) return std::nullopt;
  return entry->scratch.get_size();
}

void OneDnnGemm::run(const GemmArgs& g, void* scratch) const {
  const std::optional<Impl::Entry> entry = impl_->find(g);
  STRATA_CHECK(entry.has_value(), "oneDNN GEMM run without a primitive for m, n, k =", g.m, g.n,
               g.k);
  try {
    dnnl::memory a(entry->a, impl_->engine, const_cast<void*>(g.a));
    dnnl::memory b(entry->b, impl_->engine, const_cast<void*>(g.b));
    dnnl::memory c(entry->c, impl_->engine, g.c);
    dnnl::memory pad(entry->scratch, impl_->engine, scratch);
    dnnl::stream stream(impl_->engine);
    entry->matmul.execute(
        stream,
        {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, pad}});
    stream.wait();
  } catch (const dnnl::error& e) {
    STRATA_CHECK(false, "oneDNN", dtype_name(g.dtype), "matmul failed for m, n, k =", g.m, g.n, g.k,
                 e.what());
  }
}

#else  // !STRATA_HAVE_ONEDNN

struct OneDnnGemm::Impl {};

OneDnnGemm::OneDnnGemm() {
  STRATA_CHECK(false, "this build has no oneDNN; resolve_cpu_gemm never picks it");
}

OneDnnGemm::~OneDnnGemm() = default;

std::optional<std::size_t> OneDnnGemm::prepare(const GemmArgs& /*g*/) const { return std::nullopt; }

void OneDnnGemm::run(const GemmArgs& /*g*/, void* /*scratch*/) const {}

#endif  // STRATA_HAVE_ONEDNN

}  // namespace strata::device::cpu
