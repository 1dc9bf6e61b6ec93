// The CPU op table: row-parallel (oneTBB) elementwise and normalization ops, OpenBLAS and oneDNN
// GEMMs.
#include <cblas.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "src/device/cpu/cpu_device.h"
#include "src/device/cpu/cpu_ops_internal.h"
#include "strata/core/summation_tree.h"
#include "strata/device/moe_route.h"
#include "strata/device/nf4.h"

namespace strata::device {
namespace {

using cpu::CpuContext;
using cpu::dispatch_float;
using cpu::from_f32;
using cpu::load_row;
using cpu::store_row;
using cpu::to_f32;

// Elements per task for cheap elementwise loops: large enough to amortize scheduling.
constexpr std::int64_t kElemGrain = 32768;

// Rows per task such that each task touches about kElemGrain elements.
std::int64_t row_grain(std::int64_t dim) {
  return std::max<std::int64_t>(1, kElemGrain / std::max<std::int64_t>(dim, 1));
}

class CpuOps final : public Ops {
 public:
  CpuOps(int num_threads, sys::SimdPath simd, cpu::CpuGemmChoice gemm)
      : ctx_(num_threads, simd, gemm) {
    if (num_threads > 0) openblas_set_num_threads(num_threads);
  }

  void gemm(const GemmArgs& args) const override { cpu::cpu_gemm(ctx_, args); }

  // out: [rows, dim] = table[ids[i], :]
  void embedding_forward(const std::int32_t* ids, std::int64_t rows, const void* table,
                         std::int64_t dim, void* out, DType dtype) const override {
    const std::size_t row_bytes = static_cast<std::size_t>(dim) * dtype_size(dtype);
    const auto* src = static_cast<const std::byte*>(table);
    auto* dst = static_cast<std::byte*>(out);
    ctx_.parallel_for(rows, row_grain(dim), [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t i = r0; i < r1; ++i) {
        if (ids[i] < 0) {
          std::memset(dst + i * row_bytes, 0, row_bytes);  // a row another rank holds
        } else {
          std::memcpy(dst + i * row_bytes, src + ids[i] * row_bytes, row_bytes);
        }
      }
    });
  }

  // dtable: [vocab, dim] += scatter of dout [rows, dim]. Tasks own column ranges so repeated
  // ids never race and the accumulation order is always the row order.
  void embedding_backward(const std::int32_t* ids, std::int64_t rows, const void* dout,
                          std::int64_t dim, void* dtable, DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* d = static_cast<const T*>(dout);
      T* t = static_cast<T*>(dtable);
      const std::int64_t cols_per_task = 64;
      ctx_.parallel_chunks(dim, cols_per_task, [&](std::int64_t, std::int64_t c0, std::int64_t c1) {
        for (std::int64_t i = 0; i < rows; ++i) {
          if (ids[i] < 0) continue;  // a row another rank holds
          T* trow = t + ids[i] * dim;
          const T* drow = d + i * dim;
          for (std::int64_t c = c0; c < c1; ++c) {
            trow[c] = from_f32<T>(to_f32(trow[c]) + to_f32(drow[c]));
          }
        }
      });
    });
  }

  // x, out: [rows, dim]; w: [dim]; rstd: [rows]
  void rmsnorm_forward(const void* x, const void* w, void* out, float* rstd, std::int64_t rows,
                       std::int64_t dim, float eps, DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* xs = static_cast<const T*>(x);
      T* os = static_cast<T*>(out);
      auto wbuf = ctx_.scratch(static_cast<std::size_t>(dim));
      float* wf = wbuf.data();
      load_row(ctx_.kernels(), static_cast<const T*>(w), wf, dim);
      ctx_.parallel_for(rows, row_grain(dim), [&](std::int64_t r0, std::int64_t r1) {
        auto rowbuf = ctx_.scratch(static_cast<std::size_t>(dim));
        float* xr = rowbuf.data();
        for (std::int64_t i = r0; i < r1; ++i) {
          load_row(ctx_.kernels(), xs + i * dim, xr, dim);
          const float ss = cpu::dot_f32(xr, xr, dim);
          const float r = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
          rstd[i] = r;
          T* o = os + i * dim;
          for (std::int64_t j = 0; j < dim; ++j) o[j] = from_f32<T>(xr[j] * r * wf[j]);
        }
      });
    });
  }

  // dout, x, dx: [rows, dim]; w, dw: [dim]; rstd: [rows]. With y = x r w:
  // dx = r (dout w) - x r^3 / dim * sum(dout w x), dw += sum_rows dout x r.
  void rmsnorm_backward(const void* dout, const void* x, const void* w, const float* rstd, void* dx,
                        void* dw, std::int64_t rows, std::int64_t dim, DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* dys = static_cast<const T*>(dout);
      const T* xs = static_cast<const T*>(x);
      T* dxs = static_cast<T*>(dx);
      // Fixed row chunks with one dw partial each, summed in chunk order: reproducible.
      const std::int64_t chunk = std::max<std::int64_t>(16, row_grain(dim));
      const std::int64_t num_chunks = (rows + chunk - 1) / chunk;
      auto part_buf = ctx_.scratch(static_cast<std::size_t>((num_chunks + 1) * dim));
      float* wf = part_buf.data();
      float* partials = wf + dim;
      load_row(ctx_.kernels(), static_cast<const T*>(w), wf, dim);
      ctx_.parallel_chunks(rows, chunk, [&](std::int64_t c, std::int64_t r0, std::int64_t r1) {
        auto rowbuf = ctx_.scratch(static_cast<std::size_t>(2 * dim));
        float* xr = rowbuf.data();
        float* gr = xr + dim;
        float* part = partials + c * dim;
        std::fill(part, part + dim, 0.0f);
        for (std::int64_t i = r0; i < r1; ++i) {
          load_row(ctx_.kernels(), xs + i * dim, xr, dim);
          load_row(ctx_.kernels(), dys + i * dim, gr, dim);
          const float r = rstd[i];
          for (std::int64_t j = 0; j < dim; ++j) {
            part[j] += gr[j] * xr[j] * r;
            gr[j] *= wf[j];
          }
          const float k = cpu::dot_f32(gr, xr, dim) * r * r * r / static_cast<float>(dim);
          T* o = dxs + i * dim;
          for (std::int64_t j = 0; j < dim; ++j) o[j] = from_f32<T>(r * gr[j] - k * xr[j]);
        }
      });
      if (dw == nullptr) return;
      T* dws = static_cast<T*>(dw);
      ctx_.parallel_for(dim, 1024, [&](std::int64_t j0, std::int64_t j1) {
        for (std::int64_t j = j0; j < j1; ++j) {
          float s = 0.0f;
          for (std::int64_t c = 0; c < num_chunks; ++c) s += partials[c * dim + j];
          dws[j] = from_f32<T>(to_f32(dws[j]) + s);
        }
      });
    });
  }

  // x: [batch, seq, heads, head_dim], rotated in place; pairs (i, i + head_dim / 2).
  void rope(void* x, std::int64_t batch, std::int64_t seq, std::int64_t heads,
            std::int64_t head_dim, const RopeParams& rope, bool inverse,
            DType dtype) const override {
    STRATA_CHECK(head_dim % 2 == 0, "rope needs an even head_dim", head_dim);
    const std::int64_t half = head_dim / 2;
    auto table = ctx_.scratch(static_cast<std::size_t>(2 * seq * half));
    float* cos_t = table.data();
    float* sin_t = cos_t + seq * half;
    for (std::int64_t j = 0; j < half; ++j) {
      const double inv_freq = rope.inv_freq(j, head_dim);
      for (std::int64_t p = 0; p < seq; ++p) {
        const double angle = static_cast<double>(p + rope.position_offset) * inv_freq;
        cos_t[p * half + j] = static_cast<float>(std::cos(angle));
        sin_t[p * half + j] = static_cast<float>(inverse ? -std::sin(angle) : std::sin(angle));
      }
    }
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      T* xs = static_cast<T*>(x);
      const std::int64_t row = heads * head_dim;
      ctx_.parallel_for(batch * seq, row_grain(row), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          const float* c = cos_t + (r % seq) * half;
          const float* s = sin_t + (r % seq) * half;
          for (std::int64_t h = 0; h < heads; ++h) {
            T* v = xs + r * row + h * head_dim;
            for (std::int64_t j = 0; j < half; ++j) {
              const float a = to_f32(v[j]), b = to_f32(v[j + half]);
              v[j] = from_f32<T>(a * c[j] - b * s[j]);
              v[j + half] = from_f32<T>(b * c[j] + a * s[j]);
            }
          }
        }
      });
    });
  }

  void attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                         const AttentionShape& shape, DType dtype) const override {
    cpu::cpu_attention_forward(ctx_, q, k, v, out, lse, shape, dtype);
  }
  void attention_backward(const void* dout, const void* q, const void* k, const void* v,
                          const void* out, const float* lse, void* dq, void* dk, void* dv,
                          const AttentionShape& shape, DType dtype) const override {
    cpu::cpu_attention_backward(ctx_, dout, q, k, v, out, lse, dq, dk, dv, shape, dtype);
  }

  void attention_decode(const void* q, const void* k_cache, const void* v_cache, void* out,
                        const DecodeAttentionShape& shape, DType dtype) const override {
    cpu::cpu_attention_decode(ctx_, q, k_cache, v_cache, out, shape, dtype);
  }

  // gate, up, out: [n]
  void swiglu_forward(const void* gate, const void* up, void* out, std::int64_t n,
                      DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const auto kernel = ctx_.kernels().swiglu_forward[cpu::kernel_dtype(T{})];
      const T* g = static_cast<const T*>(gate);
      const T* u = static_cast<const T*>(up);
      T* o = static_cast<T*>(out);
      ctx_.parallel_for(n, kElemGrain, [&](std::int64_t i0, std::int64_t i1) {
        kernel(g + i0, u + i0, o + i0, i1 - i0);
      });
    });
  }

  // dout, gate, up, dgate, dup: [n]
  void swiglu_backward(const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                       std::int64_t n, DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const auto kernel = ctx_.kernels().swiglu_backward[cpu::kernel_dtype(T{})];
      const T* d = static_cast<const T*>(dout);
      const T* g = static_cast<const T*>(gate);
      const T* u = static_cast<const T*>(up);
      T* dg = static_cast<T*>(dgate);
      T* du = static_cast<T*>(dup);
      ctx_.parallel_for(n, kElemGrain, [&](std::int64_t i0, std::int64_t i1) {
        kernel(d + i0, g + i0, u + i0, dg + i0, du + i0, i1 - i0);
      });
    });
  }

  void sum_blocks(const void* in, std::int64_t blocks, std::int64_t n, DType in_dtype, void* out,
                  DType out_dtype) const override {
    STRATA_CHECK(blocks >= 1 && n >= 0, "sum_blocks: bad shape", blocks, n);
    dispatch_float(in_dtype, [&](auto in_tag) {
      using In = decltype(in_tag);
      const In* x = static_cast<const In*>(in);
      dispatch_float(out_dtype, [&](auto out_tag) {
        using Out = decltype(out_tag);
        Out* o = static_cast<Out*>(out);
        ctx_.parallel_for(n, kElemGrain, [&](std::int64_t i0, std::int64_t i1) {
          for (std::int64_t i = i0; i < i1; ++i) {
            o[i] = from_f32<Out>(
                canonical_sum(blocks, [&](std::int64_t b) { return to_f32(x[b * n + i]); }));
          }
        });
      });
    });
  }

  void add(const void* a, const void* b, void* out, std::int64_t n, DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* x = static_cast<const T*>(a);
      const T* y = static_cast<const T*>(b);
      T* o = static_cast<T*>(out);
      ctx_.parallel_for(n, kElemGrain, [&](std::int64_t i0, std::int64_t i1) {
        for (std::int64_t i = i0; i < i1; ++i) o[i] = from_f32<T>(to_f32(x[i]) + to_f32(y[i]));
      });
    });
  }

  void add_bias(void* x, const void* bias, std::int64_t rows, std::int64_t cols,
                DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      T* xs = static_cast<T*>(x);
      const T* bs = static_cast<const T*>(bias);
      ctx_.parallel_for(rows, row_grain(cols), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          T* row = xs + r * cols;
          for (std::int64_t j = 0; j < cols; ++j) {
            row[j] = from_f32<T>(to_f32(row[j]) + to_f32(bs[j]));
          }
        }
      });
    });
  }

  void bias_grad(const void* dy, void* dbias, std::int64_t rows, std::int64_t cols,
                 DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* dys = static_cast<const T*>(dy);
      // Fixed row chunks with one partial each, summed in chunk order: reproducible.
      const std::int64_t chunk = std::max<std::int64_t>(16, row_grain(cols));
      const std::int64_t num_chunks = (rows + chunk - 1) / chunk;
      auto part_buf =
          ctx_.scratch(static_cast<std::size_t>(std::max<std::int64_t>(1, num_chunks * cols)));
      float* partials = part_buf.data();
      ctx_.parallel_chunks(rows, chunk, [&](std::int64_t c, std::int64_t r0, std::int64_t r1) {
        float* part = partials + c * cols;
        std::fill(part, part + cols, 0.0f);
        for (std::int64_t i = r0; i < r1; ++i) {
          for (std::int64_t j = 0; j < cols; ++j) part[j] += to_f32(dys[i * cols + j]);
        }
      });
      T* db = static_cast<T*>(dbias);
      ctx_.parallel_for(cols, 1024, [&](std::int64_t j0, std::int64_t j1) {
        for (std::int64_t j = j0; j < j1; ++j) {
          float sum = 0.0f;
          for (std::int64_t c = 0; c < num_chunks; ++c) sum += partials[c * cols + j];
          db[j] = from_f32<T>(to_f32(db[j]) + sum);
        }
      });
    });
  }

  // logits, dlogits: [rows, vocab]; targets, losses: [rows]
  void cross_entropy(const void* logits, const std::int32_t* targets, float* losses, void* dlogits,
                     std::int64_t rows, std::int64_t vocab, float dloss_scale,
                     DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* ls = static_cast<const T*>(logits);
      T* ds = static_cast<T*>(dlogits);
      const cpu::CpuKernels& k = ctx_.kernels();
      ctx_.parallel_for(rows, row_grain(vocab), [&](std::int64_t r0, std::int64_t r1) {
        auto rowbuf = ctx_.scratch(static_cast<std::size_t>(vocab));
        float* z = rowbuf.data();
        for (std::int64_t i = r0; i < r1; ++i) {
          const std::int32_t t = targets[i];
          STRATA_CHECK(t < vocab, "cross_entropy target out of range", t, vocab);
          if (t < 0) {
            losses[i] = 0.0f;
            if (ds != nullptr) std::fill(ds + i * vocab, ds + (i + 1) * vocab, from_f32<T>(0.0f));
            continue;
          }
          // The whole row is read before any of it is written, so dlogits may alias logits.
          load_row(k, ls + i * vocab, z, vocab);
          const float zt = z[t];
          const float mx = k.max(z, vocab);
          const double sum = k.exp_shift_sum(z, vocab, mx);
          losses[i] = static_cast<float>(std::log(sum) + static_cast<double>(mx - zt));
          if (ds == nullptr) continue;
          // p_j = z_j / sum - [j == t], times the loss scale.
          const float inv = static_cast<float>(1.0 / sum);
          T* d = ds + i * vocab;
          k.scale_store[cpu::kernel_dtype(T{})](z, inv, dloss_scale, d, vocab);
          d[t] = from_f32<T>((z[t] * inv - 1.0f) * dloss_scale);
        }
      });
    });
  }

  void cross_entropy_stats(const void* logits, const std::int32_t* targets, std::int64_t rows,
                           std::int64_t vocab, std::int64_t vocab_begin, float* stats,
                           DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* ls = static_cast<const T*>(logits);
      const cpu::CpuKernels& k = ctx_.kernels();
      ctx_.parallel_for(rows, row_grain(vocab), [&](std::int64_t r0, std::int64_t r1) {
        auto rowbuf = ctx_.scratch(static_cast<std::size_t>(vocab));
        float* z = rowbuf.data();
        for (std::int64_t i = r0; i < r1; ++i) {
          float* st = stats + 3 * i;
          const std::int64_t t = targets[i];
          if (t < 0) {
            st[0] = -std::numeric_limits<float>::infinity();
            st[1] = st[2] = 0.0f;
            continue;
          }
          load_row(k, ls + i * vocab, z, vocab);
          const std::int64_t local = t - vocab_begin;
          st[2] = local >= 0 && local < vocab ? z[local] : 0.0f;
          st[0] = k.max(z, vocab);
          st[1] = static_cast<float>(k.exp_shift_sum(z, vocab, st[0]));
        }
      });
    });
  }

  void cross_entropy_grad(const void* logits, const std::int32_t* targets, std::int64_t rows,
                          std::int64_t vocab, std::int64_t vocab_begin, const float* row_max,
                          const float* row_sum, void* dlogits, float dloss_scale,
                          DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* ls = static_cast<const T*>(logits);
      T* ds = static_cast<T*>(dlogits);
      const cpu::CpuKernels& k = ctx_.kernels();
      ctx_.parallel_for(rows, row_grain(vocab), [&](std::int64_t r0, std::int64_t r1) {
        auto rowbuf = ctx_.scratch(static_cast<std::size_t>(vocab));
        float* z = rowbuf.data();
        for (std::int64_t i = r0; i < r1; ++i) {
          T* d = ds + i * vocab;
          const std::int64_t t = targets[i];
          if (t < 0) {
            std::fill(d, d + vocab, from_f32<T>(0.0f));
            continue;
          }
          // The whole row is read before any of it is written, so dlogits may alias logits.
          load_row(k, ls + i * vocab, z, vocab);
          (void)k.exp_shift_sum(z, vocab, row_max[i]);  // z_j = exp(z_j - max)
          const float inv = static_cast<float>(1.0 / static_cast<double>(row_sum[i]));
          k.scale_store[cpu::kernel_dtype(T{})](z, inv, dloss_scale, d, vocab);
          const std::int64_t local = t - vocab_begin;
          if (local >= 0 && local < vocab) {
            d[local] = from_f32<T>((z[local] * inv - 1.0f) * dloss_scale);
          }
        }
      });
    });
  }

  void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype,
            std::int64_t n) const override {
    cpu::parallel_convert(ctx_, src, src_dtype, dst, dst_dtype, n);
  }

  void moe_route(const float* logits, std::int64_t tokens, std::int64_t experts, std::int64_t k,
                 bool normalize, float* probs, std::int32_t* chosen,
                 float* weights) const override {
    ctx_.parallel_for(tokens, row_grain(experts), [&](std::int64_t t0, std::int64_t t1) {
      for (std::int64_t t = t0; t < t1; ++t) {
        moe_route_token(logits + t * experts, experts, k, normalize, probs + t * experts,
                        chosen + t * k, weights + t * k);
      }
    });
  }

  void moe_route_backward(const float* probs, const std::int32_t* chosen, const float* dweights,
                          const float* aux_grad, std::int64_t tokens, std::int64_t experts,
                          std::int64_t k, bool normalize, float* dlogits) const override {
    ctx_.parallel_for(tokens, row_grain(experts), [&](std::int64_t t0, std::int64_t t1) {
      for (std::int64_t t = t0; t < t1; ++t) {
        moe_route_token_backward(probs + t * experts, chosen + t * k, dweights + t * k, aux_grad,
                                 experts, k, normalize, dlogits + t * experts);
      }
    });
  }

  void scale_rows(void* x, const float* scale, std::int64_t rows, std::int64_t cols,
                  DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      T* xs = static_cast<T*>(x);
      ctx_.parallel_for(rows, row_grain(cols), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          const float s = to_f32(from_f32<T>(scale[r]));
          T* row = xs + r * cols;
          for (std::int64_t j = 0; j < cols; ++j) row[j] = from_f32<T>(to_f32(row[j]) * s);
        }
      });
    });
  }

  void row_dots(const void* a, const void* b, std::int64_t rows, std::int64_t cols,
                const std::int32_t* index, float* out, DType dtype) const override {
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* as = static_cast<const T*>(a);
      const T* bs = static_cast<const T*>(b);
      ctx_.parallel_for(rows, row_grain(cols), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          float sum = 0.0f;
          for (std::int64_t j = 0; j < cols; ++j) {
            sum += to_f32(as[r * cols + j]) * to_f32(bs[r * cols + j]);
          }
          out[index[r]] = sum;
        }
      });
    });
  }

  void dropout(const void* x, void* out, const DropoutBlock& block, float p, std::uint64_t key,
               DType dtype) const override {
    STRATA_CHECK(block.valid(), "a dropout block outside its matrix", block.rows, block.cols,
                 block.col_begin, block.full_cols);
    const std::uint32_t threshold = dropout_threshold(p);
    const float scale = 1.0f / (1.0f - p);
    const std::int64_t cols = block.cols;
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* xs = static_cast<const T*>(x);
      T* os = static_cast<T*>(out);
      ctx_.parallel_for(block.size(), kElemGrain, [&](std::int64_t i0, std::int64_t i1) {
        // Row by row: each row's counters run on from its first column's place in the whole.
        for (std::int64_t i = i0; i < i1;) {
          const std::int64_t end = std::min(i1, (i / cols + 1) * cols);
          const std::uint64_t at = block.index(i);
          for (std::int64_t k = 0; k < end - i; ++k) {
            const bool keep = dropout_keeps(key, at + static_cast<std::uint64_t>(k), threshold);
            os[i + k] = from_f32<T>(keep ? to_f32(xs[i + k]) * scale : 0.0f);
          }
          i = end;
        }
      });
    });
  }

  void dequantize_nf4(const void* packed, std::int64_t n, void* out, DType dtype) const override {
    const Nf4Layout l = nf4_layout(n);
    const auto* codes = static_cast<const std::uint8_t*>(packed) + l.codes;
    const float* levels = kNf4Levels.data();
    dispatch_float(dtype, [&](auto tag) {
      using T = decltype(tag);
      const auto kernel = ctx_.kernels().nf4_decode[cpu::kernel_dtype(T{})];
      T* o = static_cast<T*>(out);
      // In runs of whole blocks, each decoding its blocks' maxima first.
      ctx_.parallel_for(l.blocks, kElemGrain / kNf4BlockElems,
                        [&](std::int64_t b0, std::int64_t b1) {
                          std::vector<float> absmax(static_cast<std::size_t>(b1 - b0));
                          nf4_block_absmax(packed, n, b0, b1 - b0, absmax.data());
                          const std::int64_t i0 = b0 * kNf4BlockElems;
                          const std::int64_t i1 = std::min(n, b1 * kNf4BlockElems);
                          kernel(codes + i0 / 2, absmax.data(), levels, o + i0, i1 - i0);
                        });
    });
  }

  void sum_squares(const void* x, std::int64_t n, DType dtype, ExactSum* result) const override {
    // Chunked as core/dtype.h says (kSumSquaresChunkElems), so host and device sums agree.
    *result = cpu::parallel_sum_squares(ctx_, x, dtype, n);
  }

  void adamw(const AdamWArgs& args) const override { cpu::cpu_adamw(ctx_, args); }

 private:
  CpuContext ctx_;
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops(int num_threads, sys::SimdPath simd, cpu::CpuGemmChoice gemm) {
  return std::make_unique<CpuOps>(num_threads, simd, gemm);
}

}  // namespace strata::device
