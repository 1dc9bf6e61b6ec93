// Causal GQA attention forward, the flash kernels (see attention_flash2.cuh): a block owns 64
// query rows of one head (16 per warp) and streams 64-key tiles of K and V, double buffered
// with cp.async so the next tile loads while this one computes. Scores, probabilities and the
// output accumulator never leave registers; the online softmax works in base 2 on scores
// prescaled by scale * log2(e). P is rounded to bf16 for the P V product, the row sums are not,
// lse = max(scale s) + log(sum), out rounded once from O / sum (the simple kernels' contract).
// Sliding windows skip the key tiles wholly left of the block's windows and mask the rest by
// `attends`.
#include "attention_flash2.cuh"

namespace strata::kernels {
namespace {

using namespace flash2;  // NOLINT(google-build-using-namespace): this file's own toolkit

constexpr int kBr = 64;  // query rows per block: 16 per warp
constexpr int kBc = 64;  // keys per tile

template <int HD>
struct Fwd2Layout {
  static constexpr std::size_t kTile = align_region(kBc * kLd<HD> * 2);  // one K or V tile
  // Buffers: K0, V0 (stage 0), K1, V1 (stage 1). Q is staged in K1 before the loop, the bf16
  // output in K0 after it.
  static constexpr std::size_t kBytes = 4 * kTile;
  static_assert(kBr * kLd<HD> * 2 <= kTile, "Q and the output must fit a tile buffer");
};

// grid (ceil(seq / kBr), heads, batch); the last query tiles (the most keys) start first.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash2_forward_kernel(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                          const bf16_t* __restrict__ v, bf16_t* __restrict__ out,
                          float* __restrict__ lse, Dims d) {
  using L = Fwd2Layout<HD>;
  constexpr int ld = kLd<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  auto buffer = [&](int i) { return reinterpret_cast<bf16_t*>(smem + i * L::kTile); };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const std::int64_t qt = gridDim.x - 1 - blockIdx.x;
  const std::int64_t h = blockIdx.y, b = blockIdx.z, g = h / d.group;
  const std::int64_t i0 = qt * kBr;
  const std::int64_t last = (i0 + kBr < d.seq ? i0 + kBr : d.seq) - 1;
  const std::int64_t num_tiles = last / kBc + 1;  // causal: keys up to the block's last row
  // Window: key tiles wholly left of the first row's first key are skipped (see the first
  // variant: every valid row still meets its own diagonal key, so its sum ends positive).
  const std::int64_t first_tile = first_key(d, i0) / kBc;

  // Q (staged in K1) and the first K/V tile, then this warp's Q rows as A fragments.
  load_rows_async<kBr, HD>(buffer(2), q, b, i0, d.seq, d.heads, h);
  load_rows_async<kBc, HD>(buffer(0), k, b, first_tile * kBc, d.seq, d.kv_heads, g);
  load_rows_async<kBc, HD>(buffer(1), v, b, first_tile * kBc, d.seq, d.kv_heads, g);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  unsigned qa[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
    ldmatrix_x4(qa[kk], a_addr(buffer(2), ld, warp * 16, kk * 16));
  __syncthreads();  // K1 is the next tile's target

  float o[HD / 8][4];
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.0f;
  // Per row (lo: grp, hi: grp + 8 of this warp's 16): the running max of the raw scores and
  // this thread's part of the running sum (its quad's four parts add up at the end).
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
  const float scale_log2 = d.scale * kLog2e;
  const std::int64_t wrow0 = i0 + warp * 16;  // this warp's first row
  const std::int64_t row_lo = wrow0 + grp, row_hi = row_lo + 8;

  for (std::int64_t jt = first_tile; jt < num_tiles; ++jt) {
    const int stage = static_cast<int>((jt - first_tile) & 1);
    if (jt + 1 < num_tiles) {
      load_rows_async<kBc, HD>(buffer(2 * (stage ^ 1)), k, b, (jt + 1) * kBc, d.seq, d.kv_heads, g);
      load_rows_async<kBc, HD>(buffer(2 * (stage ^ 1) + 1), v, b, (jt + 1) * kBc, d.seq, d.kv_heads,
                               g);
    }
    cp_async_commit();   // possibly empty: keeps one group per iteration
    cp_async_wait<1>();  // this tile's group has landed (for this thread) ...
    __syncthreads();     // ... and for every thread
    const bf16_t* Ks = buffer(2 * stage);
    const bf16_t* Vs = buffer(2 * stage + 1);
    const std::int64_t j0 = jt * kBc;

    // S (16 x kBc per warp) = Q K^T; K's rows are B's columns.
    float s[kBc / 8][4];
#pragma unroll
    for (int nb = 0; nb < kBc / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBc / 16; ++np) {
        unsigned kb[4];
        ldmatrix_x4(kb, bt_addr(Ks, ld, np * 16, kk * 16));
        mma(s[2 * np], qa[kk], kb[0], kb[1]);
        mma(s[2 * np + 1], qa[kk], kb[2], kb[3]);
      }
    }

    // Masked scores (j > i, i - j >= window, j >= seq) are -inf. Tiles wholly inside every
    // row's causal window and the sequence skip the test.
    const bool need_mask =
        j0 + kBc - 1 > wrow0 || j0 + kBc > d.seq || (d.window > 0 && wrow0 + 15 - j0 >= d.window);
    if (need_mask) {
#pragma unroll
      for (int nb = 0; nb < kBc / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const std::int64_t i = e < 2 ? row_lo : row_hi;
          const std::int64_t j = j0 + nb * 8 + tig * 2 + (e & 1);
          if (!(j < d.seq && attends(d, i, j))) s[nb][e] = -INFINITY;
        }
      }
    }

    // Online softmax in base 2. The row max reduces over the quad that shares the row.
    float t_lo = -INFINITY, t_hi = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < kBc / 8; ++nb) {
      t_lo = fmaxf(t_lo, fmaxf(s[nb][0], s[nb][1]));
      t_hi = fmaxf(t_hi, fmaxf(s[nb][2], s[nb][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      t_lo = fmaxf(t_lo, __shfl_xor_sync(0xffffffffu, t_lo, off));
      t_hi = fmaxf(t_hi, __shfl_xor_sync(0xffffffffu, t_hi, off));
    }
    const float mn_lo = fmaxf(m_lo, t_lo), mn_hi = fmaxf(m_hi, t_hi);
    // A row with no valid key yet keeps a -inf max: its base is 0 so that every (masked) score
    // gives exp2(-inf) = 0, and its (zero) state is not rescaled.
    const float base_lo = mn_lo == -INFINITY ? 0.0f : mn_lo * scale_log2;
    const float base_hi = mn_hi == -INFINITY ? 0.0f : mn_hi * scale_log2;
    const float alpha_lo = mn_lo == -INFINITY ? 1.0f : exp2f((m_lo - mn_lo) * scale_log2);
    const float alpha_hi = mn_hi == -INFINITY ? 1.0f : exp2f((m_hi - mn_hi) * scale_log2);
    m_lo = mn_lo;
    m_hi = mn_hi;
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int nb = 0; nb < kBc / 8; ++nb) {
      s[nb][0] = exp2f(s[nb][0] * scale_log2 - base_lo);
      s[nb][1] = exp2f(s[nb][1] * scale_log2 - base_lo);
      s[nb][2] = exp2f(s[nb][2] * scale_log2 - base_hi);
      s[nb][3] = exp2f(s[nb][3] * scale_log2 - base_hi);
      sum_lo += s[nb][0] + s[nb][1];
      sum_hi += s[nb][2] + s[nb][3];
    }
    l_lo = l_lo * alpha_lo + sum_lo;
    l_hi = l_hi * alpha_hi + sum_hi;
#pragma unroll
    for (int nb = 0; nb < HD / 8; ++nb) {
      o[nb][0] *= alpha_lo;
      o[nb][1] *= alpha_lo;
      o[nb][2] *= alpha_hi;
      o[nb][3] *= alpha_hi;
    }

    // O (16 x HD per warp) += P V: P's C fragments of key blocks 2kk, 2kk + 1 are the A
    // fragment of key block kk; V's rows are B's rows (ldmatrix transposes).
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      unsigned pa[4];
      a_from_c(pa, s, kk);
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        unsigned vb[4];
        ldmatrix_x4_trans(vb, b_addr(Vs, ld, kk * 16, dp * 16));
        mma(o[2 * dp], pa, vb[0], vb[1]);
        mma(o[2 * dp + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // this stage is the target of the next iteration's prefetch
  }

  // Row sums over the quad; lse = scale max(s) + log(sum) (scale > 0 commutes with the max).
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
  }
  if (tig == 0) {
    float* lse_bh = lse + (b * d.heads + h) * d.seq;
    if (row_lo < d.seq) lse_bh[row_lo] = m_lo * d.scale + logf(l_lo);
    if (row_hi < d.seq) lse_bh[row_hi] = m_hi * d.scale + logf(l_hi);
  }
  // The loop's last barrier freed K0 (no copy is in flight: the last group was empty).
  store_rows<HD>(o, 1.0f / l_lo, 1.0f / l_hi, buffer(0) + warp * 16 * ld, out, b, wrow0, d.seq,
                 d.heads, h);
}

template <int HD>
int launch_forward2(const LaunchContext& ctx, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                    bf16_t* out, float* lse, const AttentionDims& ad) {
  using L = Fwd2Layout<HD>;
  const Dims d = dims_of(ad);
  const cudaError_t e =
      cudaFuncSetAttribute(flash2_forward_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(L::kBytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 grid(static_cast<unsigned>((ad.seq + kBr - 1) / kBr), static_cast<unsigned>(ad.heads),
                  static_cast<unsigned>(ad.batch));
  flash2_forward_kernel<HD><<<grid, kThreads, L::kBytes, stream_of(ctx)>>>(q, k, v, out, lse, d);
  return launch_check();
}

}  // namespace

std::size_t flash2_forward_smem_bytes(std::int64_t head_dim) {
  if (head_dim == 64) return Fwd2Layout<64>::kBytes;
  if (head_dim == 128) return Fwd2Layout<128>::kBytes;
  return 0;
}

cudaError_t flash2_device_supported() {
  int device = 0, major = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (e != cudaSuccess) return e;
  return major >= 8 ? cudaSuccess : cudaErrorNotSupported;
}

int attention_forward_flash2(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                             void* out, float* lse, const AttentionDims& d) {
  if (d.seq == 0 || d.batch == 0) return 0;
  if (!flash_attention_applies(ctx, d, Elem::kBF16, false) || !aligned16(q) || !aligned16(k) ||
      !aligned16(v) || !aligned16(out)) {
    return static_cast<int>(cudaErrorNotSupported);
  }
  if (const cudaError_t e = flash2_device_supported(); e != cudaSuccess) {
    return static_cast<int>(e);
  }
  const auto* qb = static_cast<const bf16_t*>(q);
  const auto* kb = static_cast<const bf16_t*>(k);
  const auto* vb = static_cast<const bf16_t*>(v);
  auto* ob = static_cast<bf16_t*>(out);
  return d.head_dim == 64 ? launch_forward2<64>(ctx, qb, kb, vb, ob, lse, d)
                          : launch_forward2<128>(ctx, qb, kb, vb, ob, lse, d);
}

}  // namespace strata::kernels
