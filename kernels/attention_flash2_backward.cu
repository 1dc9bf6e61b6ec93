// Causal GQA attention backward, the flash kernels (see attention_flash2.cuh). Two deterministic
// kernels (dK/dV per key tile over every query head of its group and every later query tile; dQ
// per query tile over the key tiles; no atomics); the recomputed P and dS and the dK, dV, dQ
// accumulators stay in registers for the whole loop (they need no rescaling), and the streamed
// tiles (Q, dO, lse, D for dK/dV; K, V for dQ) are double buffered with cp.async. P =
// exp(scale s - lse) (here exp2 of log2(e)-prescaled terms), dS = scale P (dP - D), both rounded
// to bf16 for their products, every gradient rounded once at the end; sliding windows skip and
// mask by `attends`.
#include "attention_flash2.cuh"

namespace strata::kernels {
namespace {

using namespace flash2;  // NOLINT(google-build-using-namespace): this file's own toolkit

// ---- dK, dV: a block owns kBkv keys (16 per warp); query tiles of kBq stream past them.
constexpr int kBkv = 64;

template <int HD>
struct Dkv2Layout {
  // Smaller query tiles at head_dim 128 keep S^T, dP^T and the two 16 x HD accumulators in
  // registers.
  static constexpr int kBq = HD == 64 ? 64 : 32;
  static constexpr std::size_t kKV = align_region(kBkv * kLd<HD> * 2);  // K or V (then dK, dV)
  static constexpr std::size_t kQ = align_region(kBq * kLd<HD> * 2);    // Q or dO of one tile
  static constexpr std::size_t kVec = align_region(kBq * 4);            // lse or D of one tile
  static constexpr std::size_t kStage = 2 * kQ + 2 * kVec;              // Q, dO, lse, D
  static constexpr std::size_t kK = 0;
  static constexpr std::size_t kV = kKV;
  static constexpr std::size_t kStages = 2 * kKV;
  static constexpr std::size_t kBytes = kStages + 2 * kStage;
};

// grid (ceil(seq / kBkv), kv_heads, batch). With P^T = exp(scale K Q^T - lse) (masked),
// dP^T = V dO^T and dS^T = scale P^T (dP^T - D): dV += P^T dO and dK += dS^T Q.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash2_dkdv_kernel(const bf16_t* __restrict__ dout, const bf16_t* __restrict__ q,
                       const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                       const float* __restrict__ lse, const float* __restrict__ drow,
                       bf16_t* __restrict__ dk, bf16_t* __restrict__ dv, Dims d) {
  using L = Dkv2Layout<HD>;
  constexpr int kBq = L::kBq;
  constexpr int ld = kLd<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* Ks = reinterpret_cast<bf16_t*>(smem + L::kK);
  bf16_t* Vs = reinterpret_cast<bf16_t*>(smem + L::kV);
  auto stage_base = [&](int s) { return smem + L::kStages + s * L::kStage; };
  auto q_tile = [&](int s) { return reinterpret_cast<bf16_t*>(stage_base(s)); };
  auto do_tile = [&](int s) { return reinterpret_cast<bf16_t*>(stage_base(s) + L::kQ); };
  auto lse_tile = [&](int s) { return reinterpret_cast<float*>(stage_base(s) + 2 * L::kQ); };
  auto d_tile = [&](int s) {
    return reinterpret_cast<float*>(stage_base(s) + 2 * L::kQ + L::kVec);
  };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * kBkv;
  const std::int64_t g = blockIdx.y, b = blockIdx.z;
  // One past the last query any of this block's keys is attended by (seq without a window).
  // Query tiles before j0 / kBq hold only queries i < j0, and tiles from i_end on only queries
  // whose window ends before j0: fully masked, skipped. The (head, query tile) pairs are one
  // flat sequence so that the pipeline runs across heads.
  const std::int64_t i_end = query_end(d, (j0 + kBkv < d.seq ? j0 + kBkv : d.seq) - 1);
  const std::int64_t i_start = j0 / kBq * kBq;
  const std::int64_t per_head = (i_end - i_start + kBq - 1) / kBq;
  const std::int64_t total = per_head * d.group;
  auto tile_head = [&](std::int64_t t) { return g * d.group + t / per_head; };
  auto tile_row0 = [&](std::int64_t t) { return i_start + (t % per_head) * kBq; };
  auto issue = [&](std::int64_t t, int s) {
    const std::int64_t h = tile_head(t), i0 = tile_row0(t);
    load_rows_async<kBq, HD>(q_tile(s), q, b, i0, d.seq, d.heads, h);
    load_rows_async<kBq, HD>(do_tile(s), dout, b, i0, d.seq, d.heads, h);
    const int r = threadIdx.x;  // threads [0, kBq) copy lse, [kBq, 2 kBq) copy D
    if (r < 2 * kBq) {
      const int rr = r < kBq ? r : r - kBq;
      const float* src = (r < kBq ? lse : drow) + (b * d.heads + h) * d.seq;
      const bool in = i0 + rr < d.seq;
      cp_async4((r < kBq ? lse_tile(s) : d_tile(s)) + rr, in ? src + i0 + rr : src, in);
    }
  };
  static_assert(2 * kBq <= kThreads, "one thread per lse and D element");

  load_rows_async<kBkv, HD>(Ks, k, b, j0, d.seq, d.kv_heads, g);
  load_rows_async<kBkv, HD>(Vs, v, b, j0, d.seq, d.kv_heads, g);
  issue(0, 0);
  cp_async_commit();

  float dka[HD / 8][4], dva[HD / 8][4];
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[nb][e] = dva[nb][e] = 0.0f;
  }
  const float scale_log2 = d.scale * kLog2e;
  const std::int64_t wkey0 = j0 + warp * 16;  // this warp's first key
  const std::int64_t key_lo = wkey0 + grp, key_hi = key_lo + 8;

  for (std::int64_t t = 0; t < total; ++t) {
    const int stage = static_cast<int>(t & 1);
    if (t + 1 < total) issue(t + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const std::int64_t i0 = tile_row0(t);
    const bf16_t* Qs = q_tile(stage);
    const bf16_t* dOs = do_tile(stage);
    const float* lse_s = lse_tile(stage);
    const float* d_s = d_tile(stage);

    // S^T = K Q^T and dP^T = V dO^T (16 x kBq per warp); Q's and dO's rows are B's columns.
    float st[kBq / 8][4], dpt[kBq / 8][4];
#pragma unroll
    for (int nb = 0; nb < kBq / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nb][e] = dpt[nb][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      unsigned ka[4], va[4];
      ldmatrix_x4(ka, a_addr(Ks, ld, warp * 16, kk * 16));
      ldmatrix_x4(va, a_addr(Vs, ld, warp * 16, kk * 16));
#pragma unroll
      for (int np = 0; np < kBq / 16; ++np) {
        unsigned qb[4], ob[4];
        ldmatrix_x4(qb, bt_addr(Qs, ld, np * 16, kk * 16));
        ldmatrix_x4(ob, bt_addr(dOs, ld, np * 16, kk * 16));
        mma(st[2 * np], ka, qb[0], qb[1]);
        mma(st[2 * np + 1], ka, qb[2], qb[3]);
        mma(dpt[2 * np], va, ob[0], ob[1]);
        mma(dpt[2 * np + 1], va, ob[2], ob[3]);
      }
    }

    // P^T and dS^T in place of S^T and dP^T. Element (nb, e) is key row e < 2 ? lo : hi and
    // query column nb * 8 + 2 tig + (e & 1). Tiles where every (i, j) is causal, in the window
    // and in the sequence skip the mask.
    const bool need_mask = i0 < wkey0 + 15 || i0 + kBq > d.seq || wkey0 + 16 > d.seq ||
                           (d.window > 0 && i0 + kBq - 1 - wkey0 >= d.window);
#pragma unroll
    for (int nb = 0; nb < kBq / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nb * 8 + tig * 2 + (e & 1);
        float p = exp2f(st[nb][e] * scale_log2 - lse_s[col] * kLog2e);
        if (need_mask) {
          const std::int64_t i = i0 + col, j = e < 2 ? key_lo : key_hi;
          if (!(i < d.seq && j < d.seq && attends(d, i, j))) p = 0.0f;
        }
        st[nb][e] = p;
        dpt[nb][e] = p * (dpt[nb][e] - d_s[col]) * d.scale;
      }
    }

    // dV += P^T dO and dK += dS^T Q (16 x HD per warp): query blocks 2kk, 2kk + 1 of P^T and
    // dS^T are the A fragment of query block kk; dO's and Q's rows are B's rows.
#pragma unroll
    for (int kk = 0; kk < kBq / 16; ++kk) {
      unsigned pa[4];
      a_from_c(pa, st, kk);
      unsigned sa[4];
      a_from_c(sa, dpt, kk);
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        unsigned ob[4], qb[4];
        ldmatrix_x4_trans(ob, b_addr(dOs, ld, kk * 16, dp * 16));
        ldmatrix_x4_trans(qb, b_addr(Qs, ld, kk * 16, dp * 16));
        mma(dva[2 * dp], pa, ob[0], ob[1]);
        mma(dva[2 * dp + 1], pa, ob[2], ob[3]);
        mma(dka[2 * dp], sa, qb[0], qb[1]);
        mma(dka[2 * dp + 1], sa, qb[2], qb[3]);
      }
    }
    __syncthreads();  // this stage is the target of the next iteration's prefetch
  }

  // K and V are no longer read (the loop's last barrier; every group has landed): stage the
  // bf16 gradients there, 16 rows per warp.
  cp_async_wait<0>();
  store_rows<HD>(dka, 1.0f, 1.0f, Ks + warp * 16 * ld, dk, b, wkey0, d.seq, d.kv_heads, g);
  store_rows<HD>(dva, 1.0f, 1.0f, Vs + warp * 16 * ld, dv, b, wkey0, d.seq, d.kv_heads, g);
}

// ---- dQ: a block owns kBqq query rows (16 per warp); key tiles of kBk stream past them.
constexpr int kBqq = 64;

template <int HD>
struct Dq2Layout {
  static constexpr int kBk = HD == 64 ? 64 : 32;  // keeps S, dP and dQ in registers at 128
  static constexpr std::size_t kTile = align_region(kBk * kLd<HD> * 2);  // one K or V tile
  // K0, V0, K1, V1; before the loop Q and dO are staged over them.
  static constexpr std::size_t kRows = align_region(kBqq * kLd<HD> * 2);
  static constexpr std::size_t kBytes = 4 * kTile > 2 * kRows ? 4 * kTile : 2 * kRows;
};

// grid (ceil(seq / kBqq), heads, batch). dQ += dS K with dS = scale P (dO V^T - D).
template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash2_dq_kernel(const bf16_t* __restrict__ dout, const bf16_t* __restrict__ q,
                     const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                     const float* __restrict__ lse, const float* __restrict__ drow,
                     bf16_t* __restrict__ dq, Dims d) {
  using L = Dq2Layout<HD>;
  constexpr int kBk = L::kBk;
  constexpr int ld = kLd<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  auto buffer = [&](int i) { return reinterpret_cast<bf16_t*>(smem + i * L::kTile); };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const std::int64_t qt = gridDim.x - 1 - blockIdx.x;
  const std::int64_t h = blockIdx.y, b = blockIdx.z, g = h / d.group;
  const std::int64_t i0 = qt * kBqq;
  const std::int64_t last = (i0 + kBqq < d.seq ? i0 + kBqq : d.seq) - 1;
  const std::int64_t num_tiles = last / kBk + 1;
  // Window: key tiles wholly left of the first row's first key are skipped.
  const std::int64_t first_tile = first_key(d, i0) / kBk;

  // This warp's rows of Q and dO as A fragments, staged over the K/V buffers.
  bf16_t* stage_q = reinterpret_cast<bf16_t*>(smem);
  bf16_t* stage_do = reinterpret_cast<bf16_t*>(smem + L::kRows);
  load_rows_async<kBqq, HD>(stage_q, q, b, i0, d.seq, d.heads, h);
  load_rows_async<kBqq, HD>(stage_do, dout, b, i0, d.seq, d.heads, h);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  unsigned qa[HD / 16][4], oa[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    ldmatrix_x4(qa[kk], a_addr(stage_q, ld, warp * 16, kk * 16));
    ldmatrix_x4(oa[kk], a_addr(stage_do, ld, warp * 16, kk * 16));
  }
  __syncthreads();  // the staging is overwritten by the first tiles
  load_rows_async<kBk, HD>(buffer(0), k, b, first_tile * kBk, d.seq, d.kv_heads, g);
  load_rows_async<kBk, HD>(buffer(1), v, b, first_tile * kBk, d.seq, d.kv_heads, g);
  cp_async_commit();

  const std::int64_t wrow0 = i0 + warp * 16;
  const std::int64_t row_lo = wrow0 + grp, row_hi = row_lo + 8;
  const float* lse_bh = lse + (b * d.heads + h) * d.seq;
  const float* drow_bh = drow + (b * d.heads + h) * d.seq;
  const float lse2_lo = row_lo < d.seq ? lse_bh[row_lo] * kLog2e : 0.0f;
  const float lse2_hi = row_hi < d.seq ? lse_bh[row_hi] * kLog2e : 0.0f;
  const float d_lo = row_lo < d.seq ? drow_bh[row_lo] : 0.0f;
  const float d_hi = row_hi < d.seq ? drow_bh[row_hi] : 0.0f;
  const float scale_log2 = d.scale * kLog2e;
  float dqa[HD / 8][4];
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb) dqa[nb][0] = dqa[nb][1] = dqa[nb][2] = dqa[nb][3] = 0.0f;

  for (std::int64_t kt = first_tile; kt < num_tiles; ++kt) {
    const int stage = static_cast<int>((kt - first_tile) & 1);
    if (kt + 1 < num_tiles) {
      load_rows_async<kBk, HD>(buffer(2 * (stage ^ 1)), k, b, (kt + 1) * kBk, d.seq, d.kv_heads, g);
      load_rows_async<kBk, HD>(buffer(2 * (stage ^ 1) + 1), v, b, (kt + 1) * kBk, d.seq, d.kv_heads,
                               g);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16_t* Ks = buffer(2 * stage);
    const bf16_t* Vs = buffer(2 * stage + 1);
    const std::int64_t j0 = kt * kBk;

    // S = Q K^T and dP = dO V^T (16 x kBk per warp); K's and V's rows are B's columns.
    float s[kBk / 8][4], dp[kBk / 8][4];
#pragma unroll
    for (int nb = 0; nb < kBk / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBk / 16; ++np) {
        unsigned kb[4], vb[4];
        ldmatrix_x4(kb, bt_addr(Ks, ld, np * 16, kk * 16));
        ldmatrix_x4(vb, bt_addr(Vs, ld, np * 16, kk * 16));
        mma(s[2 * np], qa[kk], kb[0], kb[1]);
        mma(s[2 * np + 1], qa[kk], kb[2], kb[3]);
        mma(dp[2 * np], oa[kk], vb[0], vb[1]);
        mma(dp[2 * np + 1], oa[kk], vb[2], vb[3]);
      }
    }

    // dS in place of dP. Element (nb, e) is row e < 2 ? lo : hi and key nb * 8 + 2 tig + (e & 1).
    const bool need_mask = j0 + kBk - 1 > wrow0 || j0 + kBk > d.seq || wrow0 + 16 > d.seq ||
                           (d.window > 0 && wrow0 + 15 - j0 >= d.window);
#pragma unroll
    for (int nb = 0; nb < kBk / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[nb][e] * scale_log2 - (e < 2 ? lse2_lo : lse2_hi));
        if (need_mask) {
          const std::int64_t i = e < 2 ? row_lo : row_hi, j = j0 + nb * 8 + tig * 2 + (e & 1);
          if (!(i < d.seq && j < d.seq && attends(d, i, j))) p = 0.0f;
        }
        dp[nb][e] = p * (dp[nb][e] - (e < 2 ? d_lo : d_hi)) * d.scale;
      }
    }

    // dQ += dS K (16 x HD per warp): key blocks 2kk, 2kk + 1 of dS are the A fragment of key
    // block kk; K's rows are B's rows.
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      unsigned sa[4];
      a_from_c(sa, dp, kk);
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        unsigned kb[4];
        ldmatrix_x4_trans(kb, b_addr(Ks, ld, kk * 16, dn * 16));
        mma(dqa[2 * dn], sa, kb[0], kb[1]);
        mma(dqa[2 * dn + 1], sa, kb[2], kb[3]);
      }
    }
    __syncthreads();  // this stage is the target of the next iteration's prefetch
  }

  // Every group has landed and the loop's last barrier passed: the output is staged where Q
  // was ([kBqq][HD + 8] over the K/V buffers).
  cp_async_wait<0>();
  store_rows<HD>(dqa, 1.0f, 1.0f, stage_q + warp * 16 * ld, dq, b, wrow0, d.seq, d.heads, h);
}

template <int HD>
int launch_backward2(const LaunchContext& ctx, const bf16_t* dout, const bf16_t* q, const bf16_t* k,
                     const bf16_t* v, const float* lse, const float* drow, bf16_t* dq, bf16_t* dk,
                     bf16_t* dv, const AttentionDims& ad) {
  const Dims d = dims_of(ad);
  cudaError_t e =
      cudaFuncSetAttribute(flash2_dkdv_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Dkv2Layout<HD>::kBytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  e = cudaFuncSetAttribute(flash2_dq_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Dq2Layout<HD>::kBytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  const dim3 kv_grid(static_cast<unsigned>((ad.seq + kBkv - 1) / kBkv),
                     static_cast<unsigned>(ad.kv_heads), static_cast<unsigned>(ad.batch));
  flash2_dkdv_kernel<HD><<<kv_grid, kThreads, Dkv2Layout<HD>::kBytes, stream_of(ctx)>>>(
      dout, q, k, v, lse, drow, dk, dv, d);
  if (const int err = launch_check(); err != 0) return err;
  const dim3 q_grid(static_cast<unsigned>((ad.seq + kBqq - 1) / kBqq),
                    static_cast<unsigned>(ad.heads), static_cast<unsigned>(ad.batch));
  flash2_dq_kernel<HD><<<q_grid, kThreads, Dq2Layout<HD>::kBytes, stream_of(ctx)>>>(
      dout, q, k, v, lse, drow, dq, d);
  return launch_check();
}

}  // namespace

std::size_t flash2_backward_smem_bytes(std::int64_t head_dim) {
  auto larger = [](std::size_t a, std::size_t b) { return a > b ? a : b; };
  if (head_dim == 64) return larger(Dkv2Layout<64>::kBytes, Dq2Layout<64>::kBytes);
  if (head_dim == 128) return larger(Dkv2Layout<128>::kBytes, Dq2Layout<128>::kBytes);
  return 0;
}

int attention_backward_flash2(const LaunchContext& ctx, const void* dout, const void* q,
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
  if (const cudaError_t e = flash2_device_supported(); e != cudaSuccess) {
    return static_cast<int>(e);
  }
  const auto* dob = static_cast<const bf16_t*>(dout);
  const auto* qb = static_cast<const bf16_t*>(q);
  const auto* kb = static_cast<const bf16_t*>(k);
  const auto* vb = static_cast<const bf16_t*>(v);
  auto* dqb = static_cast<bf16_t*>(dq);
  auto* dkb = static_cast<bf16_t*>(dk);
  auto* dvb = static_cast<bf16_t*>(dv);
  return d.head_dim == 64
             ? launch_backward2<64>(ctx, dob, qb, kb, vb, lse, drow, dqb, dkb, dvb, d)
             : launch_backward2<128>(ctx, dob, qb, kb, vb, lse, drow, dqb, dkb, dvb, d);
}

}  // namespace strata::kernels
