// Causal GQA attention backward, flash style, in two deterministic kernels that recompute the
// probabilities from the saved lse: one per 64-key tile of a kv head accumulates dK and dV over
// every query head of its group and every later query tile; one per 64-query tile of a head
// accumulates dQ over the key tiles. No atomics, no [seq, seq] matrix. With a sliding window
// each block visits only the tiles its window reaches (later query tiles up to the keys' last
// window for dK/dV, key tiles from the first row's first key for dQ) and masks the rest to P = 0.
#include "attention_flash.cuh"

namespace strata::kernels {
namespace {

using namespace flash;  // NOLINT(google-build-using-namespace): this file's own toolkit

// ---- dK, dV: a block owns kBkv keys (16 per warp); query tiles of kBq stream past them.
constexpr int kBkv = 64;
constexpr int kBq = 32;

template <int HD>
struct DkvLayout {
  static constexpr int kLdQ = HD + 8;   // bf16 Q and dO tiles [kBq]
  static constexpr int kLdS = kBq + 4;  // fp32 S^T and dP^T [kBkv]
  static constexpr int kLdP = kBq + 8;  // bf16 P^T and dS^T [kBkv]
  static constexpr int kLdA = HD + 4;   // fp32 dK and dV accumulators [kBkv]; stage K and V
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kDO = kQ + align_region(kBq * kLdQ * 2);
  static constexpr std::size_t kS = kDO + align_region(kBq * kLdQ * 2);
  static constexpr std::size_t kDP = kS + align_region(kBkv * kLdS * 4);
  static constexpr std::size_t kP = kDP + align_region(kBkv * kLdS * 4);
  static constexpr std::size_t kDS = kP + align_region(kBkv * kLdP * 2);
  static constexpr std::size_t kDK = kDS + align_region(kBkv * kLdP * 2);
  static constexpr std::size_t kDV = kDK + align_region(kBkv * kLdA * 4);
  static constexpr std::size_t kLse = kDV + align_region(kBkv * kLdA * 4);
  static constexpr std::size_t kD = kLse + align_region(kBq * 4);
  static constexpr std::size_t kBytes = kD + align_region(kBq * 4);
  // K and V are staged as bf16 [kBkv][HD + 8] in the accumulators' space before they are zeroed.
  static_assert(kBkv * (HD + 8) * 2 <= kBkv * kLdA * 4, "staging does not fit");
};

// grid (ceil(seq / kBkv), kv_heads, batch). With P^T = exp(scale K Q^T - lse) (masked),
// dP^T = V dO^T and dS^T = scale P^T (dP^T - D): dV += P^T dO and dK += dS^T Q.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_dkdv_kernel(const bf16_t* __restrict__ dout, const bf16_t* __restrict__ q,
                      const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                      const float* __restrict__ lse, const float* __restrict__ drow,
                      bf16_t* __restrict__ dk, bf16_t* __restrict__ dv, Dims d) {
  using L = DkvLayout<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* Qs = reinterpret_cast<bf16_t*>(smem + L::kQ);
  bf16_t* dOs = reinterpret_cast<bf16_t*>(smem + L::kDO);
  float* St = reinterpret_cast<float*>(smem + L::kS);
  float* dPt = reinterpret_cast<float*>(smem + L::kDP);
  bf16_t* Pt = reinterpret_cast<bf16_t*>(smem + L::kP);
  bf16_t* dSt = reinterpret_cast<bf16_t*>(smem + L::kDS);
  float* dKa = reinterpret_cast<float*>(smem + L::kDK);
  float* dVa = reinterpret_cast<float*>(smem + L::kDV);
  float* lse_s = reinterpret_cast<float*>(smem + L::kLse);
  float* d_s = reinterpret_cast<float*>(smem + L::kD);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * kBkv;
  const std::int64_t g = blockIdx.y, b = blockIdx.z;

  // This warp's 16 keys and values as A fragments, staged through the accumulators.
  bf16_t* stage_k = reinterpret_cast<bf16_t*>(dKa);
  bf16_t* stage_v = reinterpret_cast<bf16_t*>(dVa);
  load_tile<kBkv, HD>(stage_k, HD + 8, k, b, j0, d.seq, d.kv_heads, g);
  load_tile<kBkv, HD>(stage_v, HD + 8, v, b, j0, d.seq, d.kv_heads, g);
  __syncthreads();
  FragA kf[HD / 16], vf[HD / 16];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    wmma::load_matrix_sync(kf[kk], stage_k + warp * 16 * (HD + 8) + kk * 16, HD + 8);
    wmma::load_matrix_sync(vf[kk], stage_v + warp * 16 * (HD + 8) + kk * 16, HD + 8);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kBkv * L::kLdA; idx += kThreads) {
    dKa[idx] = 0.0f;
    dVa[idx] = 0.0f;
  }

  // Elementwise split: lane pair (2r, 2r + 1) owns key row warp * 16 + r, half the queries each.
  const int krow = warp * 16 + (lane >> 1);
  const int half = lane & 1;
  const std::int64_t j = j0 + krow;
  // One past the last query any of this block's keys is attended by (seq without a window).
  const std::int64_t i_end = query_end(d, (j0 + kBkv < d.seq ? j0 + kBkv : d.seq) - 1);

  for (std::int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
    const float* lse_h = lse + (b * d.heads + h) * d.seq;
    const float* drow_h = drow + (b * d.heads + h) * d.seq;
    // Query tiles before j0 / kBq hold only queries i < j0, and tiles from i_end on only
    // queries whose window ends before j0: fully masked, skipped.
    for (std::int64_t i0 = j0 / kBq * kBq; i0 < i_end; i0 += kBq) {
      __syncthreads();  // the previous tile's Q, dO, lse and D are no longer read
      load_tile<kBq, HD>(Qs, L::kLdQ, q, b, i0, d.seq, d.heads, h);
      load_tile<kBq, HD>(dOs, L::kLdQ, dout, b, i0, d.seq, d.heads, h);
      for (int r = threadIdx.x; r < kBq; r += kThreads) {
        const bool in = i0 + r < d.seq;
        lse_s[r] = in ? lse_h[i0 + r] : 0.0f;
        d_s[r] = in ? drow_h[i0 + r] : 0.0f;
      }
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T (16 x kBq per warp); Q's rows are B's columns.
#pragma unroll
      for (int n = 0; n < kBq / 16; ++n) {
        FragC s, dp;
        wmma::fill_fragment(s, 0.0f);
        wmma::fill_fragment(dp, 0.0f);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          FragBCol qb, ob;
          wmma::load_matrix_sync(qb, Qs + n * 16 * L::kLdQ + kk * 16, L::kLdQ);
          wmma::load_matrix_sync(ob, dOs + n * 16 * L::kLdQ + kk * 16, L::kLdQ);
          wmma::mma_sync(s, kf[kk], qb, s);
          wmma::mma_sync(dp, vf[kk], ob, dp);
        }
        wmma::store_matrix_sync(St + warp * 16 * L::kLdS + n * 16, s, L::kLdS, wmma::mem_row_major);
        wmma::store_matrix_sync(dPt + warp * 16 * L::kLdS + n * 16, dp, L::kLdS,
                                wmma::mem_row_major);
      }
      __syncwarp();

      constexpr int kHalf = kBq / 2;
#pragma unroll
      for (int c = 0; c < kHalf; ++c) {
        const int col = half * kHalf + c;
        const std::int64_t i = i0 + col;
        const bool valid = i < d.seq && j < d.seq && attends(d, i, j);
        const float p = valid ? expf(d.scale * St[krow * L::kLdS + col] - lse_s[col]) : 0.0f;
        const float ds = p * (dPt[krow * L::kLdS + col] - d_s[col]) * d.scale;
        Pt[krow * L::kLdP + col] = __float2bfloat16_rn(p);
        dSt[krow * L::kLdP + col] = __float2bfloat16_rn(ds);
      }
      __syncwarp();

      // dV += P^T dO, dK += dS^T Q (16 x HD per warp); dO's and Q's rows are B's rows.
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        FragC av, ak;
        float* v_tile = dVa + warp * 16 * L::kLdA + dn * 16;
        float* k_tile = dKa + warp * 16 * L::kLdA + dn * 16;
        wmma::load_matrix_sync(av, v_tile, L::kLdA, wmma::mem_row_major);
        wmma::load_matrix_sync(ak, k_tile, L::kLdA, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < kBq / 16; ++kk) {
          FragA pa, sa;
          FragBRow ob, qb;
          wmma::load_matrix_sync(pa, Pt + warp * 16 * L::kLdP + kk * 16, L::kLdP);
          wmma::load_matrix_sync(sa, dSt + warp * 16 * L::kLdP + kk * 16, L::kLdP);
          wmma::load_matrix_sync(ob, dOs + kk * 16 * L::kLdQ + dn * 16, L::kLdQ);
          wmma::load_matrix_sync(qb, Qs + kk * 16 * L::kLdQ + dn * 16, L::kLdQ);
          wmma::mma_sync(av, pa, ob, av);
          wmma::mma_sync(ak, sa, qb, ak);
        }
        wmma::store_matrix_sync(v_tile, av, L::kLdA, wmma::mem_row_major);
        wmma::store_matrix_sync(k_tile, ak, L::kLdA, wmma::mem_row_major);
      }
      __syncwarp();
    }
  }
  store_rows<HD>(dKa, L::kLdA, warp * 16, nullptr, dk, b, j0, d.seq, d.kv_heads, g);
  store_rows<HD>(dVa, L::kLdA, warp * 16, nullptr, dv, b, j0, d.seq, d.kv_heads, g);
}

// ---- dQ: a block owns kBqq query rows (16 per warp); key tiles of kBk stream past them.
constexpr int kBqq = 64;
constexpr int kBk = 32;

template <int HD>
struct DqLayout {
  static constexpr int kLdKV = HD + 8;  // bf16 K and V tiles [kBk]
  static constexpr int kLdS = kBk + 4;  // fp32 S and dP [kBqq]
  static constexpr int kLdP = kBk + 8;  // bf16 dS [kBqq]
  static constexpr int kLdA = HD + 4;   // fp32 dQ accumulator [kBqq]; stages Q
  static constexpr std::size_t kK = 0;
  static constexpr std::size_t kV = kK + align_region(kBk * kLdKV * 2);
  static constexpr std::size_t kS = kV + align_region(kBk * kLdKV * 2);
  static constexpr std::size_t kDP = kS + align_region(kBqq * kLdS * 4);   // right after S:
  static constexpr std::size_t kDS = kDP + align_region(kBqq * kLdS * 4);  // S+dP stage dO
  static constexpr std::size_t kDQ = kDS + align_region(kBqq * kLdP * 2);
  static constexpr std::size_t kBytes = kDQ + align_region(kBqq * kLdA * 4);
  static_assert(kBqq * (HD + 8) * 2 <= kBqq * kLdA * 4, "Q staging does not fit");
  static_assert(kBqq * (HD + 8) * 2 <= kDS - kS, "dO staging does not fit");
};

// grid (ceil(seq / kBqq), heads, batch). dQ += dS K with dS = scale P (dO V^T - D).
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_dq_kernel(const bf16_t* __restrict__ dout, const bf16_t* __restrict__ q,
                    const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                    const float* __restrict__ lse, const float* __restrict__ drow,
                    bf16_t* __restrict__ dq, Dims d) {
  using L = DqLayout<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* Ks = reinterpret_cast<bf16_t*>(smem + L::kK);
  bf16_t* Vs = reinterpret_cast<bf16_t*>(smem + L::kV);
  float* Ss = reinterpret_cast<float*>(smem + L::kS);
  float* dPs = reinterpret_cast<float*>(smem + L::kDP);
  bf16_t* dSs = reinterpret_cast<bf16_t*>(smem + L::kDS);
  float* dQa = reinterpret_cast<float*>(smem + L::kDQ);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t qt = gridDim.x - 1 - blockIdx.x;
  const std::int64_t h = blockIdx.y, b = blockIdx.z, g = h / d.group;
  const std::int64_t i0 = qt * kBqq;

  // This warp's 16 rows of Q and dO as A fragments, staged through dQa and S+dP.
  bf16_t* stage_q = reinterpret_cast<bf16_t*>(dQa);
  bf16_t* stage_do = reinterpret_cast<bf16_t*>(Ss);
  load_tile<kBqq, HD>(stage_q, HD + 8, q, b, i0, d.seq, d.heads, h);
  load_tile<kBqq, HD>(stage_do, HD + 8, dout, b, i0, d.seq, d.heads, h);
  __syncthreads();
  FragA qf[HD / 16], of[HD / 16];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    wmma::load_matrix_sync(qf[kk], stage_q + warp * 16 * (HD + 8) + kk * 16, HD + 8);
    wmma::load_matrix_sync(of[kk], stage_do + warp * 16 * (HD + 8) + kk * 16, HD + 8);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kBqq * L::kLdA; idx += kThreads) dQa[idx] = 0.0f;

  const int row = warp * 16 + (lane >> 1);
  const int half = lane & 1;
  const std::int64_t i = i0 + row;
  const float li = i < d.seq ? lse[(b * d.heads + h) * d.seq + i] : 0.0f;
  const float di = i < d.seq ? drow[(b * d.heads + h) * d.seq + i] : 0.0f;
  const std::int64_t last = (i0 + kBqq < d.seq ? i0 + kBqq : d.seq) - 1;
  const std::int64_t num_tiles = last / kBk + 1;
  // Window: key tiles wholly left of the first row's first key are skipped.
  const std::int64_t first_tile = first_key(d, i0) / kBk;

  for (std::int64_t kt = first_tile; kt < num_tiles; ++kt) {
    const std::int64_t j0 = kt * kBk;
    __syncthreads();  // staging and the previous tile's K/V are no longer read
    load_tile<kBk, HD>(Ks, L::kLdKV, k, b, j0, d.seq, d.kv_heads, g);
    load_tile<kBk, HD>(Vs, L::kLdKV, v, b, j0, d.seq, d.kv_heads, g);
    __syncthreads();

    // S = Q K^T and dP = dO V^T (16 x kBk per warp).
#pragma unroll
    for (int n = 0; n < kBk / 16; ++n) {
      FragC s, dp;
      wmma::fill_fragment(s, 0.0f);
      wmma::fill_fragment(dp, 0.0f);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        FragBCol kb, vb;
        wmma::load_matrix_sync(kb, Ks + n * 16 * L::kLdKV + kk * 16, L::kLdKV);
        wmma::load_matrix_sync(vb, Vs + n * 16 * L::kLdKV + kk * 16, L::kLdKV);
        wmma::mma_sync(s, qf[kk], kb, s);
        wmma::mma_sync(dp, of[kk], vb, dp);
      }
      wmma::store_matrix_sync(Ss + warp * 16 * L::kLdS + n * 16, s, L::kLdS, wmma::mem_row_major);
      wmma::store_matrix_sync(dPs + warp * 16 * L::kLdS + n * 16, dp, L::kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    constexpr int kHalf = kBk / 2;
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const int col = half * kHalf + c;
      const std::int64_t j = j0 + col;
      const bool valid = i < d.seq && j < d.seq && attends(d, i, j);
      const float p = valid ? expf(d.scale * Ss[row * L::kLdS + col] - li) : 0.0f;
      const float ds = p * (dPs[row * L::kLdS + col] - di) * d.scale;
      dSs[row * L::kLdP + col] = __float2bfloat16_rn(ds);
    }
    __syncwarp();

    // dQ += dS K (16 x HD per warp); K's rows are B's rows.
#pragma unroll
    for (int dn = 0; dn < HD / 16; ++dn) {
      FragC acc;
      float* q_tile = dQa + warp * 16 * L::kLdA + dn * 16;
      wmma::load_matrix_sync(acc, q_tile, L::kLdA, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kBk / 16; ++kk) {
        FragA sa;
        FragBRow kb;
        wmma::load_matrix_sync(sa, dSs + warp * 16 * L::kLdP + kk * 16, L::kLdP);
        wmma::load_matrix_sync(kb, Ks + kk * 16 * L::kLdKV + dn * 16, L::kLdKV);
        wmma::mma_sync(acc, sa, kb, acc);
      }
      wmma::store_matrix_sync(q_tile, acc, L::kLdA, wmma::mem_row_major);
    }
    __syncwarp();
  }
  store_rows<HD>(dQa, L::kLdA, warp * 16, nullptr, dq, b, i0, d.seq, d.heads, h);
}

template <int HD>
int launch_backward(const LaunchContext& ctx, const bf16_t* dout, const bf16_t* q, const bf16_t* k,
                    const bf16_t* v, const float* lse, const float* drow, bf16_t* dq, bf16_t* dk,
                    bf16_t* dv, const AttentionDims& ad) {
  const Dims d = dims_of(ad);
  cudaError_t e =
      cudaFuncSetAttribute(flash_dkdv_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(DkvLayout<HD>::kBytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  e = cudaFuncSetAttribute(flash_dq_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(DqLayout<HD>::kBytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 kv_grid(static_cast<unsigned>((ad.seq + kBkv - 1) / kBkv),
                     static_cast<unsigned>(ad.kv_heads), static_cast<unsigned>(ad.batch));
  flash_dkdv_kernel<HD><<<kv_grid, kThreads, DkvLayout<HD>::kBytes, stream_of(ctx)>>>(
      dout, q, k, v, lse, drow, dk, dv, d);
  if (const int err = launch_check(); err != 0) return err;
  const dim3 q_grid(static_cast<unsigned>((ad.seq + kBqq - 1) / kBqq),
                    static_cast<unsigned>(ad.heads), static_cast<unsigned>(ad.batch));
  flash_dq_kernel<HD>
      <<<q_grid, kThreads, DqLayout<HD>::kBytes, stream_of(ctx)>>>(dout, q, k, v, lse, drow, dq, d);
  return launch_check();
}

}  // namespace

std::size_t flash_backward_smem_bytes(std::int64_t head_dim) {
  auto larger = [](std::size_t a, std::size_t b) { return a > b ? a : b; };
  if (head_dim == 64) return larger(DkvLayout<64>::kBytes, DqLayout<64>::kBytes);
  if (head_dim == 128) return larger(DkvLayout<128>::kBytes, DqLayout<128>::kBytes);
  return 0;
}

int attention_backward_flash(const LaunchContext& ctx, const void* dout, const void* q,
                             const void* k, const void* v, const float* lse, const float* drow,
                             void* dq, void* dk, void* dv, const AttentionDims& d) {
  if (d.seq == 0 || d.batch == 0) return 0;
  for (const void* p : {dout, q, k, v, static_cast<const void*>(dq), static_cast<const void*>(dk),
                        static_cast<const void*>(dv)}) {
    if (!aligned16(p)) return static_cast<int>(cudaErrorNotSupported);
  }
  if (!flash_attention_applies(ctx, d, Elem::kBF16, true)) {
    return static_cast<int>(cudaErrorNotSupported);
  }
  const auto* dob = static_cast<const bf16_t*>(dout);
  const auto* qb = static_cast<const bf16_t*>(q);
  const auto* kb = static_cast<const bf16_t*>(k);
  const auto* vb = static_cast<const bf16_t*>(v);
  auto* dqb = static_cast<bf16_t*>(dq);
  auto* dkb = static_cast<bf16_t*>(dk);
  auto* dvb = static_cast<bf16_t*>(dv);
  return d.head_dim == 64 ? launch_backward<64>(ctx, dob, qb, kb, vb, lse, drow, dqb, dkb, dvb, d)
                          : launch_backward<128>(ctx, dob, qb, kb, vb, lse, drow, dqb, dkb, dvb, d);
}

}  // namespace strata::kernels
