// Causal grouped-query attention on the CPU: per (batch, head) OpenBLAS products into fp32
// [seq, seq] score blocks (row blocks skip most of the masked upper triangle) and a row-parallel
// softmax between them; a sliding window zeroes the probabilities left of it. bf16 tensors are
// converted one batch element at a time.
#include <cmath>
#include <limits>
#include <type_traits>

#include "src/device/cpu/cpu_ops_internal.h"

namespace strata::device::cpu {
namespace {

// Rows per causal block: block [i0, i1) multiplies only against keys [0, i1).
constexpr std::int64_t kRowBlock = 64;
// Score floats per chunk of heads (one [seq, seq] block per head; backward keeps two).
constexpr std::int64_t kScoreBudgetFloats = std::int64_t{4} << 20;

struct Dims {
  std::int64_t batch, seq, heads, kv_heads, hd, group;
  std::int64_t window;       // 0: full causal
  std::int64_t q_ld, kv_ld;  // row strides of q/out and k/v
  float scale;

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
  }
  // The first key query i attends to.
  std::int64_t first_key(std::int64_t i) const {
    return window > 0 ? std::max<std::int64_t>(0, i - window + 1) : 0;
  }
  std::int64_t block_end(std::int64_t i) const {
    return std::min(seq, (i / kRowBlock + 1) * kRowBlock);
  }
  std::int64_t heads_per_chunk() const {
    return std::clamp<std::int64_t>(kScoreBudgetFloats / std::max<std::int64_t>(seq * seq, 1), 1,
                                    heads);
  }
};

// sc[i, j] = alpha * a_i . b_j for j < block_end(i); a rows have stride lda, b rows ldb.
void causal_abt(const Dims& d, float alpha, const float* a, std::int64_t lda, const float* b,
                std::int64_t ldb, float* sc) {
  for (std::int64_t i0 = 0; i0 < d.seq; i0 += kRowBlock) {
    const std::int64_t i1 = std::min(d.seq, i0 + kRowBlock);
    sgemm_f32(false, true, i1 - i0, i1, d.hd, alpha, a + i0 * lda, lda, b, ldb, 0.0f,
              sc + i0 * d.seq, d.seq);
  }
}

// c_i = sum_j p[i, j] x_j (+ beta c_i); p is zero above the diagonal up to block_end(i).
void causal_px(const Dims& d, const float* p, const float* x, std::int64_t ldx, float beta,
               float* c, std::int64_t ldc) {
  for (std::int64_t i0 = 0; i0 < d.seq; i0 += kRowBlock) {
    const std::int64_t i1 = std::min(d.seq, i0 + kRowBlock);
    sgemm_f32(false, false, i1 - i0, d.hd, i1, 1.0f, p + i0 * d.seq, d.seq, x, ldx, beta,
              c + i0 * ldc, ldc);
  }
}

// c_j = sum_{i >= j} p[i, j] x_i (+ beta c_j): the transpose of causal_px.
void causal_ptx(const Dims& d, const float* p, const float* x, std::int64_t ldx, float beta,
                float* c, std::int64_t ldc) {
  for (std::int64_t j0 = 0; j0 < d.seq; j0 += kRowBlock) {
    const std::int64_t j1 = std::min(d.seq, j0 + kRowBlock);
    sgemm_f32(true, false, j1 - j0, d.hd, d.seq - j0, 1.0f, p + j0 * d.seq + j0, d.seq,
              x + j0 * ldx, ldx, beta, c + j0 * ldc, ldc);
  }
}

// n elements of src as fp32: src itself for f32, else converted into scratch.
template <typename T>
const float* view_f32(const CpuContext& ctx, const T* src, std::int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    ctx.parallel_for(n, 16384, [&](std::int64_t i0, std::int64_t i1) {
      load_row(src + i0, scratch + i0, i1 - i0);
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
      store_row(src + i0, dst + i0, i1 - i0);
    });
  }
}

// q/out: [b, s, heads, hd]; k/v: [b, s, kv_heads, hd]; lse: [b, heads, s].
template <typename T>
void forward_impl(const CpuContext& ctx, const Dims& d, const T* q, const T* k, const T* v, T* out,
                  float* lse) {
  const std::int64_t S = d.seq, hc = d.heads_per_chunk();
  const std::int64_t nq = S * d.q_ld, nk = S * d.kv_ld;
  constexpr bool kConvert = !std::is_same_v<T, float>;
  auto scores = ctx.scratch(static_cast<std::size_t>(hc * S * S));
  auto conv = ctx.scratch(kConvert ? static_cast<std::size_t>(2 * nq + 2 * nk) : 1);
  float* sc = scores.data();
  for (std::int64_t b = 0; b < d.batch; ++b) {
    const float* qb = view_f32(ctx, q + b * nq, nq, conv.data());
    const float* kb = view_f32(ctx, k + b * nk, nk, conv.data() + nq);
    const float* vb = view_f32(ctx, v + b * nk, nk, conv.data() + nq + nk);
    float* ob = target_f32(out + b * nq, conv.data() + nq + 2 * nk);
    for (std::int64_t h0 = 0; h0 < d.heads; h0 += hc) {
      const std::int64_t nh = std::min(hc, d.heads - h0);
      for (std::int64_t h = h0; h < h0 + nh; ++h) {
        causal_abt(d, d.scale, qb + h * d.hd, d.q_ld, kb + (h / d.group) * d.hd, d.kv_ld,
                   sc + (h - h0) * S * S);
      }
      ctx.parallel_for(nh * S, std::max<std::int64_t>(1, 8192 / std::max<std::int64_t>(S, 1)),
                       [&](std::int64_t r0, std::int64_t r1) {
                         for (std::int64_t r = r0; r < r1; ++r) {
                           const std::int64_t h = h0 + r / S, i = r % S;
                           float* row = sc + r * S;
                           const std::int64_t lo = d.first_key(i);
                           std::fill(row, row + lo, 0.0f);
                           float mx = -std::numeric_limits<float>::infinity();
                           for (std::int64_t j = lo; j <= i; ++j) mx = std::max(mx, row[j]);
                           float sum = 0.0f;
                           for (std::int64_t j = lo; j <= i; ++j) {
                             row[j] = std::exp(row[j] - mx);
                             sum += row[j];
                           }
                           const float inv = 1.0f / sum;
                           for (std::int64_t j = lo; j <= i; ++j) row[j] *= inv;
                           std::fill(row + i + 1, row + d.block_end(i), 0.0f);
                           lse[(b * d.heads + h) * S + i] = mx + std::log(sum);
                         }
                       });
      for (std::int64_t h = h0; h < h0 + nh; ++h) {
        causal_px(d, sc + (h - h0) * S * S, vb + (h / d.group) * d.hd, d.kv_ld, 0.0f, ob + h * d.hd,
                  d.q_ld);
      }
    }
    flush_f32(ctx, ob, out + b * nq, nq);
  }
}

// With P = exp(scale * q k^T - lse) and D_i = dout_i . out_i:
// dv_j = sum_i P_ij dout_i, dS_ij = scale P_ij (dout_i . v_j - D_i), dq_i = sum_j dS_ij k_j,
// dk_j = sum_i dS_ij q_i; a kv head sums over the query heads that share it, in head order.
template <typename T>
void backward_impl(const CpuContext& ctx, const Dims& d, const T* dout, const T* q, const T* k,
                   const T* v, const T* out, const float* lse, T* dq, T* dk, T* dv) {
  const std::int64_t S = d.seq, hc = d.heads_per_chunk();
  const std::int64_t nq = S * d.q_ld, nk = S * d.kv_ld;
  constexpr bool kConvert = !std::is_same_v<T, float>;
  auto scores = ctx.scratch(static_cast<std::size_t>(2 * hc * S * S));
  auto conv = ctx.scratch(kConvert ? static_cast<std::size_t>(4 * nq + 4 * nk) : 1);
  float* ps = scores.data();     // scores, then P
  float* dps = ps + hc * S * S;  // dout v^T, then dS
  float* cq = conv.data();       // bf16 only: q, out, dout, dq, then k, v, dk, dv
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
    for (std::int64_t h0 = 0; h0 < d.heads; h0 += hc) {
      const std::int64_t nh = std::min(hc, d.heads - h0);
      for (std::int64_t h = h0; h < h0 + nh; ++h) {
        const std::int64_t g = h / d.group;
        causal_abt(d, d.scale, qb + h * d.hd, d.q_ld, kb + g * d.hd, d.kv_ld,
                   ps + (h - h0) * S * S);
        causal_abt(d, 1.0f, dob + h * d.hd, d.q_ld, vb + g * d.hd, d.kv_ld, dps + (h - h0) * S * S);
      }
      ctx.parallel_for(nh * S, std::max<std::int64_t>(1, 8192 / std::max<std::int64_t>(S, 1)),
                       [&](std::int64_t r0, std::int64_t r1) {
                         for (std::int64_t r = r0; r < r1; ++r) {
                           const std::int64_t h = h0 + r / S, i = r % S;
                           float* p = ps + r * S;
                           float* ds = dps + r * S;
                           const float li = lse[(b * d.heads + h) * S + i];
                           const std::int64_t off = i * d.q_ld + h * d.hd;
                           const float di = dot_f32(dob + off, ob + off, d.hd);
                           const std::int64_t lo = d.first_key(i);
                           std::fill(p, p + lo, 0.0f);
                           std::fill(ds, ds + lo, 0.0f);
                           for (std::int64_t j = lo; j <= i; ++j) {
                             p[j] = std::exp(p[j] - li);
                             ds[j] = p[j] * (ds[j] - di) * d.scale;
                           }
                           std::fill(p + i + 1, p + d.block_end(i), 0.0f);
                           std::fill(ds + i + 1, ds + d.block_end(i), 0.0f);
                         }
                       });
      for (std::int64_t h = h0; h < h0 + nh; ++h) {
        const std::int64_t g = h / d.group;
        const float beta = h % d.group == 0 ? 0.0f : 1.0f;  // first head of its group overwrites
        const float* p = ps + (h - h0) * S * S;
        const float* ds = dps + (h - h0) * S * S;
        causal_ptx(d, p, dob + h * d.hd, d.q_ld, beta, dvb + g * d.hd, d.kv_ld);
        causal_ptx(d, ds, qb + h * d.hd, d.q_ld, beta, dkb + g * d.hd, d.kv_ld);
        causal_px(d, ds, kb + g * d.hd, d.kv_ld, 0.0f, dqb + h * d.hd, d.q_ld);
      }
    }
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
      load_row(q + (i * s.heads + h) * hd, qf, hd);
      float mx = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = lo; j <= pos; ++j) {
        const T* kr = k + (j * s.kv_heads + g) * hd;
        float dot = 0.0f;
        for (std::int64_t x = 0; x < hd; ++x) dot += qf[x] * to_f32(kr[x]);
        sc[j] = dot * scale;
        mx = std::max(mx, sc[j]);
      }
      float sum = 0.0f;
      for (std::int64_t j = lo; j <= pos; ++j) {
        sc[j] = std::exp(sc[j] - mx);
        sum += sc[j];
      }
      std::fill(acc, acc + hd, 0.0f);
      for (std::int64_t j = lo; j <= pos; ++j) {
        const T* vr = v + (j * s.kv_heads + g) * hd;
        const float p = sc[j] / sum;
        for (std::int64_t x = 0; x < hd; ++x) acc[x] += p * to_f32(vr[x]);
      }
      store_row(acc, out + (i * s.heads + h) * hd, hd);
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
