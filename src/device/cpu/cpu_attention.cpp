// Causal grouped-query attention on the CPU, blocked by query rows so that it never holds more
// than a budget of fp32 scores, however long the sequence: each block of query rows multiplies
// against the keys it can see (from the sliding window's start to the block's end), with a
// softmax between the products: on OpenBLAS, each product on its threads and the softmax
// row-parallel; where fp32 GEMMs run on oneDNN, one task per head (per kv head in backward)
// doing its products single-threaded and its softmax rows. Blocks are as tall as the budget
// allows (the whole sequence, for the usual lengths) so the products stay deep; inside a block
// the products run in kSubBlock-row (or -column) pieces that skip most of the masked upper
// triangle. bf16 tensors are converted one batch element at a time.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "src/device/cpu/cpu_ops_internal.h"

namespace strata::device::cpu {
namespace {

// Rows (or key columns) per causal piece: rows [s0, s1) multiply only against keys below s1.
constexpr std::int64_t kSubBlock = 64;
// Score floats per block of query rows over a chunk of heads (backward keeps two such blocks).
constexpr std::int64_t kScoreBudgetFloats = std::int64_t{4} << 20;

struct Dims {
  std::int64_t batch, seq, heads, kv_heads, hd, group;
  std::int64_t window;       // 0: full causal
  std::int64_t q_ld, kv_ld;  // row strides of q/out and k/v
  float scale;
  std::int64_t block_rows;  // query rows per block: a multiple of kSubBlock
  std::int64_t head_chunk;  // heads whose score blocks are held at once

  explicit Dims(const AttentionShape& s)
      : batch(s.batch),
        seq(s.seq),
        heads(s.heads),
        kv_heads(s.kv_heads),
        hd(s.head_dim),
        group(s.kv_heads > 0 ? s.heads / s.kv_heads : 0),
        window(s.window),
        q_ld(s.heads * s.head_dim),
        kv_ld(s.kv_heads * s.head_dim),
        scale(1.0f / std::sqrt(static_cast<float>(s.head_dim))) {
    STRATA_CHECK(batch >= 0 && seq >= 0 && hd > 0 && kv_heads > 0 && heads % kv_heads == 0,
                 "bad attention shape", batch, seq, heads, kv_heads, hd);
    const std::int64_t s_pad = round_up(std::max<std::int64_t>(seq, 1));
    block_rows = std::clamp(kScoreBudgetFloats / s_pad / kSubBlock * kSubBlock, kSubBlock, s_pad);
    head_chunk = std::clamp<std::int64_t>(kScoreBudgetFloats / (block_rows * s_pad), 1, heads);
  }
  static std::int64_t round_up(std::int64_t n) {
    return (n + kSubBlock - 1) / kSubBlock * kSubBlock;
  }
  // The first key query i attends to.
  std::int64_t first_key(std::int64_t i) const {
    return window > 0 ? std::max<std::int64_t>(0, i - window + 1) : 0;
  }
  // Score floats of one block for one head (at most).
  std::int64_t block_floats() const { return block_rows * seq; }
};

// Query rows [i0, i1) against keys [k0, i1): score rows are width() long, and row i is valid on
// [first_key(i) - k0, i - k0].
struct RowBlock {
  std::int64_t i0, i1, k0;
  std::int64_t rows() const { return i1 - i0; }
  std::int64_t width() const { return i1 - k0; }
};

RowBlock row_block(const Dims& d, std::int64_t i0) {
  const std::int64_t i1 = std::min(d.seq, i0 + d.block_rows);
  return {i0, i1, d.first_key(i0)};
}

// fn(block, h0, nh) for every block of query rows in order and, within it, every chunk of
// heads [h0, h0 + nh) whose score blocks are held at once.
template <typename Fn>
void for_each_block(const Dims& d, Fn&& fn) {
  for (std::int64_t i0 = 0; i0 < d.seq; i0 += d.block_rows) {
    const RowBlock blk = row_block(d, i0);
    for (std::int64_t h0 = 0; h0 < d.heads; h0 += d.head_chunk) {
      fn(blk, h0, std::min(d.head_chunk, d.heads - h0));
    }
  }
}

// Rows per task of a row-parallel loop over score rows `width` long.
std::int64_t score_row_grain(std::int64_t width) {
  return std::max<std::int64_t>(1, 8192 / std::max<std::int64_t>(width, 1));
}

// Whether attention's products run inside per-head (or per-kv-head) tasks on the arena: where
// the context runs fp32 GEMMs on oneDNN. On OpenBLAS they run from the calling thread only.
bool products_in_tasks(const CpuContext& ctx) { return ctx.onednn_for(DType::kF32) != nullptr; }

// One of attention's fp32 products, small ones (64 x 256 x 64 for the usual shapes). On OpenBLAS
// it runs from the calling thread, spread over OpenBLAS's own threads; on oneDNN on the calling
// task's thread alone (gemm_onednn: one block for products this small), so that heads run side
// by side with fewer hand-offs.
void product(const CpuContext& ctx, bool ta, bool tb, std::int64_t m, std::int64_t n,
             std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
             std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  const OneDnnGemm* dnnl = ctx.onednn_for(DType::kF32);
  if (dnnl == nullptr) {
    sgemm_f32(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (m == 0 || n == 0) return;
  const GemmArgs g{.trans_a = ta,
                   .trans_b = tb,
                   .m = m,
                   .n = n,
                   .k = k,
                   .alpha = alpha,
                   .a = a,
                   .lda = lda,
                   .b = b,
                   .ldb = ldb,
                   .beta = beta,
                   .c = c,
                   .ldc = ldc,
                   .dtype = DType::kF32};
  STRATA_CHECK(k > 0 && gemm_onednn(ctx, *dnnl, g),
               "oneDNN has no fp32 kernel for an attention product", m, n, k);
}

// One block of query rows over heads [h0, h0 + nh), whose score blocks are `rows` x `w`: for each
// head h, scores(h), then row(r) over its score rows r, then finish(h). Where products
// run in tasks, one task per `unit` heads (aligned: one per kv head when finish adds up over the
// heads that share it), each head's steps in turn, in head order; on OpenBLAS, every head's
// scores, the rows in parallel, then every head's finish, in head order.
template <typename Scores, typename Row, typename Finish>
void run_heads(const CpuContext& ctx, std::int64_t h0, std::int64_t nh, std::int64_t rows,
               std::int64_t w, std::int64_t unit, Scores&& scores, Row&& row, Finish&& finish) {
  if (products_in_tasks(ctx)) {
    const std::int64_t u0 = h0 / unit, u1 = (h0 + nh - 1) / unit + 1;
    ctx.parallel_for(u1 - u0, 1, [&](std::int64_t t0, std::int64_t t1) {
      const std::int64_t ha = std::max(h0, (u0 + t0) * unit);
      const std::int64_t hb = std::min(h0 + nh, (u0 + t1) * unit);
      for (std::int64_t h = ha; h < hb; ++h) {
        scores(h);
        for (std::int64_t r = (h - h0) * rows; r < (h - h0 + 1) * rows; ++r) row(r);
        finish(h);
      }
    });
    return;
  }
  for (std::int64_t h = h0; h < h0 + nh; ++h) scores(h);
  ctx.parallel_for(nh * rows, score_row_grain(w), [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) row(r);
  });
  for (std::int64_t h = h0; h < h0 + nh; ++h) finish(h);
}

// sc[i, j] = alpha a_i . b_j over the block (sc: rows x width, row i0 first, key k0 first), for
// the keys each kSubBlock piece of rows can see; a rows have stride lda from row i0, b rows ldb
// from key 0.
void block_abt(const CpuContext& ctx, const Dims& d, const RowBlock& blk, float alpha,
               const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* sc) {
  const std::int64_t w = blk.width();
  for (std::int64_t s0 = blk.i0; s0 < blk.i1; s0 += kSubBlock) {
    const std::int64_t s1 = std::min(blk.i1, s0 + kSubBlock), fk = d.first_key(s0);
    product(ctx, false, true, s1 - s0, s1 - fk, d.hd, alpha, a + (s0 - blk.i0) * lda, lda,
            b + fk * ldb, ldb, 0.0f, sc + (s0 - blk.i0) * w + (fk - blk.k0), w);
  }
}

// c_i = sum_j p[i, j] x_j for the block's rows (p zero outside each row's valid keys); x rows
// have stride ldx from key 0, c rows ldc from row i0.
void block_px(const CpuContext& ctx, const Dims& d, const RowBlock& blk, const float* p,
              const float* x, std::int64_t ldx, float* c, std::int64_t ldc) {
  const std::int64_t w = blk.width();
  for (std::int64_t s0 = blk.i0; s0 < blk.i1; s0 += kSubBlock) {
    const std::int64_t s1 = std::min(blk.i1, s0 + kSubBlock), fk = d.first_key(s0);
    product(ctx, false, false, s1 - s0, d.hd, s1 - fk, 1.0f, p + (s0 - blk.i0) * w + (fk - blk.k0),
            w, x + fk * ldx, ldx, 0.0f, c + (s0 - blk.i0) * ldc, ldc);
  }
}

// c_j += sum_i p[i, j] x_i over the block's rows i >= j: the transpose of block_px, accumulated
// (c rows ldc from key 0; x rows ldx from row i0).
void block_ptx_add(const CpuContext& ctx, const Dims& d, const RowBlock& blk, const float* p,
                   const float* x, std::int64_t ldx, float* c, std::int64_t ldc) {
  const std::int64_t w = blk.width();
  for (std::int64_t j0 = blk.k0; j0 < blk.i1; j0 += kSubBlock) {
    const std::int64_t j1 = std::min(blk.i1, j0 + kSubBlock), r0 = std::max(blk.i0, j0);
    product(ctx, true, false, j1 - j0, d.hd, blk.i1 - r0, 1.0f,
            p + (r0 - blk.i0) * w + (j0 - blk.k0), w, x + (r0 - blk.i0) * ldx, ldx, 1.0f,
            c + j0 * ldc, ldc);
  }
}

// n elements of src as fp32: src itself for f32, else converted into scratch.
template <typename T>
const float* view_f32(const CpuContext& ctx, const T* src, std::int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    ctx.parallel_for(n, 16384, [&](std::int64_t i0, std::int64_t i1) {
      load_row(ctx.kernels(), src + i0, scratch + i0, i1 - i0);
    });
    return scratch;
  }
}

// Where to compute an output in fp32: dst itself for f32, else scratch (see flush_f32).
template <typename T>
float* target_f32(T* dst, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return scratch;
  }
}
template <typename T>
void flush_f32(const CpuContext& ctx, const float* src, T* dst, std::int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    ctx.parallel_for(n, 16384, [&](std::int64_t i0, std::int64_t i1) {
      store_row(ctx.kernels(), src + i0, dst + i0, i1 - i0);
    });
  }
}

// q/out: [b, s, heads, hd]; k/v: [b, s, kv_heads, hd]; lse: [b, heads, s].
template <typename T>
void forward_impl(const CpuContext& ctx, const Dims& d, const T* q, const T* k, const T* v, T* out,
                  float* lse) {
  const std::int64_t S = d.seq, hc = d.head_chunk;
  const std::int64_t nq = S * d.q_ld, nk = S * d.kv_ld;
  constexpr bool kConvert = !std::is_same_v<T, float>;
  const CpuKernels& kern = ctx.kernels();
  auto scores = ctx.scratch(static_cast<std::size_t>(hc * d.block_floats()));
  auto conv = ctx.scratch(kConvert ? static_cast<std::size_t>(2 * nq + 2 * nk) : 1);
  float* sc = scores.data();
  for (std::int64_t b = 0; b < d.batch; ++b) {
    const float* qb = view_f32(ctx, q + b * nq, nq, conv.data());
    const float* kb = view_f32(ctx, k + b * nk, nk, conv.data() + nq);
    const float* vb = view_f32(ctx, v + b * nk, nk, conv.data() + nq + nk);
    float* ob = target_f32(out + b * nq, conv.data() + nq + 2 * nk);
    for_each_block(d, [&](const RowBlock& blk, std::int64_t h0, std::int64_t nh) {
      const std::int64_t i0 = blk.i0, rows = blk.rows(), w = blk.width(), bf = rows * w;
      const auto scores_of = [&](std::int64_t h) {
        block_abt(ctx, d, blk, d.scale, qb + i0 * d.q_ld + h * d.hd, d.q_ld,
                  kb + (h / d.group) * d.hd, d.kv_ld, sc + (h - h0) * bf);
      };
      // Row r of the chunk's score blocks (head h0 + r / rows) becomes its softmax.
      const auto softmax_row = [&](std::int64_t r) {
        const std::int64_t h = h0 + r / rows, i = i0 + r % rows;
        float* row = sc + r * w;
        const std::int64_t lo = d.first_key(i) - blk.k0, hi = i - blk.k0 + 1;
        std::fill(row, row + lo, 0.0f);
        const float mx = kern.max(row + lo, hi - lo);
        const double sum = kern.exp_shift_sum(row + lo, hi - lo, mx);
        kern.scale_store[kKernelF32](row + lo, static_cast<float>(1.0 / sum), 1.0f, row + lo,
                                     hi - lo);
        // Zeros up to the end of the row's kSubBlock piece, which block_px reads.
        std::fill(row + hi, row + std::min(w, Dims::round_up(i + 1) - blk.k0), 0.0f);
        lse[(b * d.heads + h) * S + i] = mx + static_cast<float>(std::log(sum));
      };
      const auto output_of = [&](std::int64_t h) {
        block_px(ctx, d, blk, sc + (h - h0) * bf, vb + (h / d.group) * d.hd, d.kv_ld,
                 ob + i0 * d.q_ld + h * d.hd, d.q_ld);
      };
      run_heads(ctx, h0, nh, rows, w, 1, scores_of, softmax_row, output_of);
    });
    flush_f32(ctx, ob, out + b * nq, nq);
  }
}

// With P = exp(scale * q k^T - lse) and D_i = dout_i . out_i:
// dv_j = sum_i P_ij dout_i, dS_ij = scale P_ij (dout_i . v_j - D_i), dq_i = sum_j dS_ij k_j,
// dk_j = sum_i dS_ij q_i; dk and dv add up over the row blocks in order and, within a block,
// over the query heads that share the kv head, in head order.
template <typename T>
void backward_impl(const CpuContext& ctx, const Dims& d, const T* dout, const T* q, const T* k,
                   const T* v, const T* out, const float* lse, T* dq, T* dk, T* dv) {
  const std::int64_t S = d.seq, hc = d.head_chunk;
  const std::int64_t nq = S * d.q_ld, nk = S * d.kv_ld;
  constexpr bool kConvert = !std::is_same_v<T, float>;
  const CpuKernels& kern = ctx.kernels();
  auto scores = ctx.scratch(static_cast<std::size_t>(2 * hc * d.block_floats()));
  auto conv = ctx.scratch(kConvert ? static_cast<std::size_t>(4 * nq + 4 * nk) : 1);
  float* ps = scores.data();                // scores, then P
  float* dps = ps + hc * d.block_floats();  // dout v^T, then dS
  float* cq = conv.data();                  // bf16 only: q, out, dout, dq, then k, v, dk, dv
  float* ck = cq + 4 * nq;
  for (std::int64_t b = 0; b < d.batch; ++b) {
    const float* qb = view_f32(ctx, q + b * nq, nq, cq);
    const float* ob = view_f32(ctx, out + b * nq, nq, cq + nq);
    const float* dob = view_f32(ctx, dout + b * nq, nq, cq + 2 * nq);
    const float* kb = view_f32(ctx, k + b * nk, nk, ck);
    const float* vb = view_f32(ctx, v + b * nk, nk, ck + nk);
    float* dqb = target_f32(dq + b * nq, cq + 3 * nq);
    float* dkb = target_f32(dk + b * nk, ck + 2 * nk);
    float* dvb = target_f32(dv + b * nk, ck + 3 * nk);
    std::memset(dkb, 0, static_cast<std::size_t>(nk) * sizeof(float));
    std::memset(dvb, 0, static_cast<std::size_t>(nk) * sizeof(float));
    for_each_block(d, [&](const RowBlock& blk, std::int64_t h0, std::int64_t nh) {
      const std::int64_t i0 = blk.i0, rows = blk.rows(), w = blk.width(), bf = rows * w;
      const auto scores_of = [&](std::int64_t h) {
        const std::int64_t g = h / d.group;
        block_abt(ctx, d, blk, d.scale, qb + i0 * d.q_ld + h * d.hd, d.q_ld, kb + g * d.hd, d.kv_ld,
                  ps + (h - h0) * bf);
        block_abt(ctx, d, blk, 1.0f, dob + i0 * d.q_ld + h * d.hd, d.q_ld, vb + g * d.hd, d.kv_ld,
                  dps + (h - h0) * bf);
      };
      // Row r of the chunk's blocks (head h0 + r / rows): P and dS from the scores.
      const auto grad_row = [&](std::int64_t r) {
        const std::int64_t h = h0 + r / rows, i = i0 + r % rows;
        float* p = ps + r * w;
        float* ds = dps + r * w;
        const float li = lse[(b * d.heads + h) * S + i];
        const std::int64_t off = i * d.q_ld + h * d.hd;
        const float di = dot_f32(dob + off, ob + off, d.hd);
        const std::int64_t lo = d.first_key(i) - blk.k0, hi = i - blk.k0 + 1;
        std::fill(p, p + lo, 0.0f);
        std::fill(ds, ds + lo, 0.0f);
        kern.exp_shift_sum(p + lo, hi - lo, li);
        for (std::int64_t j = lo; j < hi; ++j) ds[j] = p[j] * (ds[j] - di) * d.scale;
        // Zeros right of the diagonal: the products below read whole kSubBlock pieces.
        std::fill(p + hi, p + w, 0.0f);
        std::fill(ds + hi, ds + w, 0.0f);
      };
      const auto grads_of = [&](std::int64_t h) {
        const std::int64_t g = h / d.group;
        const float* p = ps + (h - h0) * bf;
        const float* ds = dps + (h - h0) * bf;
        block_ptx_add(ctx, d, blk, p, dob + i0 * d.q_ld + h * d.hd, d.q_ld, dvb + g * d.hd,
                      d.kv_ld);
        block_ptx_add(ctx, d, blk, ds, qb + i0 * d.q_ld + h * d.hd, d.q_ld, dkb + g * d.hd,
                      d.kv_ld);
        block_px(ctx, d, blk, ds, kb + g * d.hd, d.kv_ld, dqb + i0 * d.q_ld + h * d.hd, d.q_ld);
      };
      // One task per kv head: dk and dv add up over its query heads in head order.
      run_heads(ctx, h0, nh, rows, w, d.group, scores_of, grad_row, grads_of);
    });
    flush_f32(ctx, dqb, dq + b * nq, nq);
    flush_f32(ctx, dkb, dk + b * nk, nk);
    flush_f32(ctx, dvb, dv + b * nk, nk);
  }
}

template <typename T>
void decode_impl(const CpuContext& ctx, const T* q, const T* k, const T* v, T* out,
                 const DecodeAttentionShape& s) {
  const std::int64_t hd = s.head_dim, group = s.heads / s.kv_heads;
  const std::int64_t keys = s.past + s.queries;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  ctx.parallel_for(s.queries * s.heads, 1, [&](std::int64_t r0, std::int64_t r1) {
    auto buf = ctx.scratch(static_cast<std::size_t>(keys + 2 * hd));
    float* sc = buf.data();
    float* qf = sc + keys;
    float* acc = qf + hd;
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int64_t i = r / s.heads, h = r % s.heads, g = h / group;
      const std::int64_t pos = s.past + i;
      const std::int64_t lo = s.window > 0 ? std::max<std::int64_t>(0, pos - s.window + 1) : 0;
      load_row(ctx.kernels(), q + (i * s.heads + h) * hd, qf, hd);
      float mx = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = lo; j <= pos; ++j) {
        const T* kr = k + (j * s.kv_heads + g) * hd;
        float dot = 0.0f;
        for (std::int64_t x = 0; x < hd; ++x) dot += qf[x] * to_f32(kr[x]);
        sc[j] = dot * scale;
        mx = std::max(mx, sc[j]);
      }
      const auto sum = static_cast<float>(ctx.kernels().exp_shift_sum(sc + lo, pos - lo + 1, mx));
      std::fill(acc, acc + hd, 0.0f);
      for (std::int64_t j = lo; j <= pos; ++j) {
        const T* vr = v + (j * s.kv_heads + g) * hd;
        const float p = sc[j] / sum;
        for (std::int64_t x = 0; x < hd; ++x) acc[x] += p * to_f32(vr[x]);
      }
      store_row(ctx.kernels(), acc, out + (i * s.heads + h) * hd, hd);
    }
  });
}

}  // namespace

void cpu_attention_decode(const CpuContext& ctx, const void* q, const void* k_cache,
                          const void* v_cache, void* out, const DecodeAttentionShape& shape,
                          DType dtype) {
  STRATA_CHECK(shape.queries >= 0 && shape.past >= 0 && shape.head_dim > 0 && shape.kv_heads > 0 &&
                   shape.heads % shape.kv_heads == 0,
               "bad decode attention shape", shape.queries, shape.past, shape.heads, shape.kv_heads,
               shape.head_dim);
  if (shape.queries == 0) return;
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    decode_impl(ctx, static_cast<const T*>(q), static_cast<const T*>(k_cache),
                static_cast<const T*>(v_cache), static_cast<T*>(out), shape);
  });
}

void cpu_attention_forward(const CpuContext& ctx, const void* q, const void* k, const void* v,
                           void* out, float* lse, const AttentionShape& shape, DType dtype) {
  const Dims d(shape);
  if (d.seq == 0) return;
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    forward_impl(ctx, d, static_cast<const T*>(q), static_cast<const T*>(k),
                 static_cast<const T*>(v), static_cast<T*>(out), lse);
  });
}

void cpu_attention_backward(const CpuContext& ctx, const void* dout, const void* q, const void* k,
                            const void* v, const void* out, const float* lse, void* dq, void* dk,
                            void* dv, const AttentionShape& shape, DType dtype) {
  const Dims d(shape);
  if (d.seq == 0) return;
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    backward_impl(ctx, d, static_cast<const T*>(dout), static_cast<const T*>(q),
                  static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out),
                  lse, static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv));
  });
}

}  // namespace strata::device::cpu
