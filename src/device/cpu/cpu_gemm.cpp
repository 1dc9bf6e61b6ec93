// GEMM on the CPU: oneDNN where the context runs the dtype's GEMMs there (the CPU's bf16 units,
// AVX-512 FMA), else OpenBLAS sgemm for f32 and, for bf16 and f16, tiles converted to fp32
// around it.
#include <cblas.h>

#include <type_traits>

#include "src/device/cpu/cpu_ops_internal.h"

namespace strata::device::cpu {

void sgemm_f32(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
               float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
               float beta, float* c, std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

namespace {

// The half-precision path's fp32 copies of its A, B and C tiles hold at most this many floats
// together (32 MiB, reused across calls through the scratch pool). Whole operands when they fit:
// one deep sgemm reached 93-95% of the fp32 rate at 2048^3 on a Zen 2, where 512^3 tiles reached
// 75-85% (bench/RESULTS.md).
constexpr std::int64_t kHalfTileBudgetFloats = std::int64_t{8} << 20;
// Tiles shrink no further than this edge (256^3 tiles need 0.2M floats).
constexpr std::int64_t kMinTileEdge = 256;

struct TileShape {
  std::int64_t m, n, k;
};

// The largest tiles within the budget: the output's edges halve first (each halving converts
// the other operand once more), the inner dimension last (each halving of k adds a pass over
// the C tile).
TileShape half_tiles(std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t budget) {
  TileShape t{m, n, k};
  while (t.m * t.k + t.k * t.n + t.m * t.n > budget) {
    if (std::max(t.m, t.n) > kMinTileEdge) {
      (t.m >= t.n ? t.m : t.n) = (std::max(t.m, t.n) + 1) / 2;
    } else if (t.k > kMinTileEdge) {
      t.k = (t.k + 1) / 2;
    } else {
      break;
    }
  }
  return t;
}

// C = beta * C for k == 0 (BLAS leaves C alone for beta == 1 and zeroes it for beta == 0).
template <typename T>
void scale_c(const GemmArgs& g) {
  T* c = static_cast<T*>(g.c);
  for (std::int64_t i = 0; i < g.m; ++i) {
    for (std::int64_t j = 0; j < g.n; ++j) {
      T& x = c[i * g.ldc + j];
      x = from_f32<T>(g.beta == 0.0f ? 0.0f : g.beta * to_f32(x));
    }
  }
}

// Copies the [rows, cols] block at (r0, c0) of a half-precision matrix with leading dimension ld
// into a dense fp32 buffer.
template <typename T>
void load_block(const CpuContext& ctx, const T* src, std::int64_t ld, std::int64_t r0,
                std::int64_t c0, std::int64_t rows, std::int64_t cols, float* dst) {
  ctx.parallel_for(rows, std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(cols, 1)),
                   [&](std::int64_t i0, std::int64_t i1) {
                     for (std::int64_t i = i0; i < i1; ++i) {
                       load_row(ctx.kernels(), src + (r0 + i) * ld + c0, dst + i * cols, cols);
                     }
                   });
}

// oneDNN's blocks of C: about kTargetBlocks of them (work for as many threads, on any thread
// count), each at least kMinBlockMacs multiply-adds (smaller products run whole), edges in
// multiples of kBlockEdge, the width of its kernels' tiles.
constexpr std::int64_t kTargetBlocks = 16;
constexpr std::int64_t kMinBlockMacs = std::int64_t{1} << 23;
constexpr std::int64_t kBlockEdge = 64;
// No block's C larger than this (8 MiB as fp32), but for a kBlockEdge-wide strip: oneDNN's bf16
// GEMM accumulates C in an fp32 scratch of C's size, which for a whole 32000 x 2048 embedding
// gradient would be 262 MB (for Llama 3's 128256 x 3072, 1.6 GB).
constexpr std::int64_t kMaxBlockFloats = std::int64_t{1} << 21;
constexpr std::uintptr_t kScratchAlign = 64;

std::int64_t round_up(std::int64_t x, std::int64_t to) { return (x + to - 1) / to * to; }

// The sub-product of g for C's rows [r0, r1) (by_rows) or columns [r0, r1).
GemmArgs gemm_block(const GemmArgs& g, bool by_rows, std::int64_t r0, std::int64_t r1) {
  GemmArgs b = g;
  const auto* a = static_cast<const std::byte*>(g.a);
  const auto* bm = static_cast<const std::byte*>(g.b);
  auto* c = static_cast<std::byte*>(g.c);
  const auto elem = static_cast<std::int64_t>(dtype_size(g.dtype));
  if (by_rows) {
    b.m = r1 - r0;
    b.a = a + (g.trans_a ? r0 : r0 * g.lda) * elem;
    b.c = c + r0 * g.ldc * elem;
  } else {
    b.n = r1 - r0;
    b.b = bm + (g.trans_b ? r0 * g.ldb : r0) * elem;
    b.c = c + r0 * elem;
  }
  return b;
}

// The half-precision GEMM's tiles: A, B and C widened to fp32, sgemm, C rounded back.
template <typename T>
void gemm_tiled(const CpuContext& ctx, const GemmArgs& g, std::int64_t budget_floats, const T* a,
                const T* b, T* c) {
  const TileShape tile = half_tiles(g.m, g.n, g.k, budget_floats);
  const std::int64_t tm = tile.m, tn = tile.n, tk = tile.k;
  auto a_tile = ctx.scratch(static_cast<std::size_t>(tm * tk));
  auto b_tile = ctx.scratch(static_cast<std::size_t>(tk * tn));
  auto c_tile = ctx.scratch(static_cast<std::size_t>(tm * tn));
  for (std::int64_t m0 = 0; m0 < g.m; m0 += tm) {
    const std::int64_t mb = std::min(tm, g.m - m0);
    for (std::int64_t n0 = 0; n0 < g.n; n0 += tn) {
      const std::int64_t nb = std::min(tn, g.n - n0);
      float beta = g.beta;
      if (beta != 0.0f) load_block(ctx, c, g.ldc, m0, n0, mb, nb, c_tile.data());
      for (std::int64_t k0 = 0; k0 < g.k; k0 += tk) {
        const std::int64_t kb = std::min(tk, g.k - k0);
        // Tiles keep the storage orientation; sgemm applies the transposes.
        if (g.trans_a) {
          load_block(ctx, a, g.lda, k0, m0, kb, mb, a_tile.data());
        } else {
          load_block(ctx, a, g.lda, m0, k0, mb, kb, a_tile.data());
        }
        if (g.trans_b) {
          load_block(ctx, b, g.ldb, n0, k0, nb, kb, b_tile.data());
        } else {
          load_block(ctx, b, g.ldb, k0, n0, kb, nb, b_tile.data());
        }
        sgemm_f32(g.trans_a, g.trans_b, mb, nb, kb, g.alpha, a_tile.data(), g.trans_a ? mb : kb,
                  b_tile.data(), g.trans_b ? kb : nb, beta, c_tile.data(), nb);
        beta = 1.0f;
      }
      const float* ct = c_tile.data();
      ctx.parallel_for(mb, std::max<std::int64_t>(1, 16384 / nb),
                       [&](std::int64_t i0, std::int64_t i1) {
                         for (std::int64_t i = i0; i < i1; ++i) {
                           store_row(ctx.kernels(), ct + i * nb, c + (m0 + i) * g.ldc + n0, nb);
                         }
                       });
    }
  }
}

}  // namespace

bool gemm_onednn(const CpuContext& ctx, const OneDnnGemm& dnnl, const GemmArgs& g) {
  // Blocks of whole rows or columns along C's longer edge, so every element's sum over k stays
  // in one product, and a partition that depends on the shape only.
  const bool by_rows = g.m > g.n;
  const std::int64_t edge = by_rows ? g.m : g.n;
  const std::int64_t other = by_rows ? g.n : g.m;
  const std::int64_t min_edge = (kMinBlockMacs + other * g.k - 1) / (other * g.k);
  std::int64_t size =
      round_up(std::max((edge + kTargetBlocks - 1) / kTargetBlocks, min_edge), kBlockEdge);
  size = std::min(size, std::max(kBlockEdge, kMaxBlockFloats / other / kBlockEdge * kBlockEdge));
  size = std::min(size, edge);
  const std::int64_t blocks = (edge + size - 1) / size;
  // Every block has the first block's shape or the last one's: both must have a real kernel.
  const std::optional<std::size_t> first = dnnl.prepare(gemm_block(g, by_rows, 0, size));
  const std::optional<std::size_t> last =
      dnnl.prepare(gemm_block(g, by_rows, (blocks - 1) * size, edge));
  if (!first || !last) return false;
  // Each task's own oneDNN scratch, from the pool (floats), 64-byte aligned.
  const std::size_t scratch_floats = (std::max(*first, *last) + kScratchAlign) / sizeof(float) + 1;
  ctx.parallel_for(blocks, 1, [&](std::int64_t b0, std::int64_t b1) {
    auto lease = ctx.scratch(scratch_floats);
    const auto base = reinterpret_cast<std::uintptr_t>(lease.data());
    void* scratch =
        reinterpret_cast<void*>((base + kScratchAlign - 1) / kScratchAlign * kScratchAlign);
    for (std::int64_t b = b0; b < b1; ++b) {
      dnnl.run(gemm_block(g, by_rows, b * size, std::min(edge, (b + 1) * size)), scratch);
    }
  });
  return true;
}

void gemm_half_tiled(const CpuContext& ctx, const GemmArgs& g, std::int64_t budget_floats) {
  dispatch_float(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      STRATA_CHECK(false, "gemm_half_tiled takes bf16 or f16, not f32");
    } else {
      gemm_tiled(ctx, g, budget_floats, static_cast<const T*>(g.a), static_cast<const T*>(g.b),
                 static_cast<T*>(g.c));
    }
  });
}

void cpu_gemm(const CpuContext& ctx, const GemmArgs& g) {
  check_gemm_args(g, "gemm:");
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    dispatch_float(g.dtype, [&](auto t) { scale_c<decltype(t)>(g); });
    return;
  }
  if (const OneDnnGemm* dnnl = ctx.onednn_for(g.dtype);
      dnnl != nullptr && gemm_onednn(ctx, *dnnl, g)) {
    return;
  }
  switch (g.dtype) {
    case DType::kF32:
      sgemm_f32(g.trans_a, g.trans_b, g.m, g.n, g.k, g.alpha, static_cast<const float*>(g.a), g.lda,
                static_cast<const float*>(g.b), g.ldb, g.beta, static_cast<float*>(g.c), g.ldc);
      return;
    case DType::kBF16:
    case DType::kF16:
      gemm_half_tiled(ctx, g, kHalfTileBudgetFloats);
      return;
    default:
      STRATA_CHECK(false, "gemm supports f32, bf16 and f16, got", dtype_name(g.dtype));
  }
}

}  // namespace strata::device::cpu
